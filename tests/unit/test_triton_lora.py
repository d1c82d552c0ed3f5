"""The Triton rank-R kernels (trainer/kernels/triton_lora.py) against plain per-segment matmuls,
fp32, through Triton's interpreter on the CPU (tests/conftest.py switches it on): a
segment longer than a weight-gradient chunk (atomic adds), empty segments, one-row
segments, ranks below and between tl.dot's 16-wide blocks, strided (transposed) weights."""

import pytest
import torch

from tests.numerics import max_rel_err
from trainer.kernels import triton_lora
from trainer.kernels.triton_lora import SlotTiles, shrink, weight_grad_into

pytestmark = pytest.mark.unit


def _segments(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


@pytest.mark.parametrize("counts, rank", [([70, 0, 1500, 1], 8), ([3, 64, 65, 0], 24), ([0, 200], 16)])
def test_kernels_equal_per_segment_matmuls(counts, rank, kernel_device):
    g = torch.Generator().manual_seed(sum(counts) + rank)
    t, k, n = sum(counts), 96, 40
    x, gy = torch.randn(t, k, generator=g).to(kernel_device), torch.randn(t, n, generator=g).to(kernel_device)
    a = torch.randn(len(counts), rank, k, generator=g).to(kernel_device)
    b = torch.randn(len(counts), n, rank, generator=g).to(kernel_device)
    scale = torch.rand(t, 1, generator=g).to(kernel_device)
    tiles = SlotTiles.of(counts, x.device)
    assert tiles.wgrad_split == (max(counts) > triton_lora.WGRAD_CHUNK)
    seg = _segments(counts).to(kernel_device)

    h = shrink(x, a, tiles, scale, wide_dim=2)
    gh = shrink(gy, b, tiles, None, wide_dim=1)
    assert max_rel_err(h, torch.einsum("tk,trk->tr", x, a[seg]) * scale) <= 1e-6
    assert max_rel_err(gh, torch.einsum("tn,tnr->tr", gy, b[seg])) <= 1e-6

    grad_a = torch.full_like(a, 0.5)  # accumulates into what is there
    grad_b = torch.full_like(b, -1.0)
    weight_grad_into(grad_a, x, gh, tiles, wide_dim=2)
    weight_grad_into(grad_b, gy, h, tiles, wide_dim=1)
    for s, count in enumerate(counts):
        rows = seg == s
        if count == 0:  # an empty segment's rows are not touched at all
            assert torch.equal(grad_a[s], torch.full_like(grad_a[s], 0.5))
            assert torch.equal(grad_b[s], torch.full_like(grad_b[s], -1.0))
            continue
        # sums over up to 1,500 rows in another order: 1.15e-6 seen compiled on the H200
        assert max_rel_err(grad_a[s], 0.5 + gh[rows].t() @ x[rows]) <= 1e-5
        assert max_rel_err(grad_b[s], -1.0 + gy[rows].t() @ h[rows]) <= 1e-5


def test_strided_weights_and_shape_errors(kernel_device):
    """A transposed view of the weights reads the same numbers; a wrong wide dim or a
    non-fp32 gradient buffer is refused with the shapes."""
    counts = [10, 20]
    x = torch.randn(30, 32, device=kernel_device)
    a = torch.randn(2, 32, 16, device=kernel_device).transpose(1, 2)  # [G, R, K], not contiguous
    tiles = SlotTiles.of(counts, x.device)
    seg = _segments(counts).to(kernel_device)
    assert max_rel_err(shrink(x, a, tiles, None, wide_dim=2), torch.einsum("tk,trk->tr", x, a[seg])) <= 1e-6
    with pytest.raises(ValueError, match="wide dim is 16"):
        shrink(x, a, tiles, None, wide_dim=1)
    with pytest.raises(ValueError, match="fp32 grad"):
        weight_grad_into(torch.zeros(2, 16, 32, dtype=torch.float64, device=kernel_device), x, torch.randn(30, 16, device=kernel_device), tiles,
                         wide_dim=2)


def test_pick(kernel_device):
    x = torch.zeros(2, 2, device=kernel_device)
    assert triton_lora.pick("library", x, 4) == "library"
    assert triton_lora.pick("auto", x, 4) == ("triton" if x.is_cuda else "library")  # never the interpreter by itself
    assert triton_lora.pick("auto", x, 1) == "library"  # one segment: cuBLAS's plain GEMMs
    assert triton_lora.pick("triton", x, 1) == "triton"  # the interpreter is on in the CPU tests
    with pytest.raises(ValueError, match="'auto', 'triton' or 'library'"):
        triton_lora.pick("cutlass", x, 1)
