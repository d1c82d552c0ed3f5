"""The LoRA-epilogue GEMM probe (benchmarks/bench_lora_epilogue.py) against the definition, on the
kernel device (Triton's interpreter on the CPU): its rows in docs/benchmarks-history.md are only worth
reading if the kernels compute what the trainer's linear does."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_lora_epilogue as probe


def test_both_kernels_equal_the_definition(kernel_device):
    probe.check(kernel_device)  # raises on a mismatch: forward, input gradient, pointer and TMA loads


def test_a_segment_read_from_the_wrong_rows_is_caught(kernel_device):
    torch.manual_seed(1)
    m, k, n, r, seg = 128, 64, 64, 16, 64
    x, w, h = torch.randn(m, k, device=kernel_device), torch.randn(n, k, device=kernel_device), torch.randn(m, r, device=kernel_device)
    b = torch.randn(m // seg, n, r, device=kernel_device)
    got = probe.mm_lora(x, w.t(), h, b.transpose(1, 2), seg, (32, 32, 32, 4, 1))
    swapped = probe.reference(x, w.t(), h, b.flip(0).transpose(1, 2), seg)  # each segment with the other's B
    probe.check_result("probe", got, probe.reference(x, w.t(), h, b.transpose(1, 2), seg))
    with pytest.raises(AssertionError, match="max error"):
        probe.check_result("swapped", got, swapped)
    with pytest.raises(ValueError, match="not a multiple of BM"):
        probe.mm_lora(x, w.t(), h, b.transpose(1, 2), 48, (32, 32, 32, 4, 1))
