"""LoRA kernel choice per call: grouped_mm where torch accepts the shapes, the loop elsewhere.

torch's grouped_mm checks, on every device, that each 2D operand's leading stride is a
multiple of 16 bytes (CUDA also needs 16-byte aligned starts): a layer whose input or
output width (or the max rank) is not a multiple of 16 bytes in the compute dtype must
fall back to the per-segment loop instead of failing, and an input view that is not
aligned is copied rather than refused.
"""

import pytest
import torch
import torch.nn.functional as F

from trainer.kernels.segmented_mm import grouped_mm_eligible, pick_kernel, segmented_matmul

pytestmark = pytest.mark.unit


def _reference(x, w, counts):
    out, start = [], 0
    for g, n in enumerate(counts):
        out.append(x[start : start + n] @ w[g].t())
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("k, n, eligible", [(8, 12, True), (6, 12, False), (8, 10, False), (4, 4, True)])
def test_eligibility_follows_16_byte_strides_fp32(k, n, eligible):
    x = torch.randn(5, k)
    w = torch.randn(3, n, k)
    assert grouped_mm_eligible(x, w) is eligible
    assert pick_kernel("auto", x, w) == ("grouped_mm" if eligible else "loop")
    if not eligible:
        with pytest.raises(ValueError, match="multiples of 4 elements"):
            pick_kernel("grouped_mm", x, w)
        # torch itself refuses these strides (here in the weight-gradient GEMM gy^T @ x, which
        # has both widths as leading strides): the fallback is needed, not cosmetic
        gy = torch.randn(5, n)
        with pytest.raises(RuntimeError, match="16 bytes"):
            F.grouped_mm(gy.t(), x, offs=torch.tensor([2, 4, 5], dtype=torch.int32))


def test_bf16_needs_multiples_of_8():
    x = torch.randn(5, 12, dtype=torch.bfloat16)
    assert not grouped_mm_eligible(x, torch.randn(2, 16, 12))
    assert grouped_mm_eligible(torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(2, 24, 16))
    assert not grouped_mm_eligible(torch.randn(5, 16, dtype=torch.float64), torch.randn(2, 24, 16))


@pytest.mark.parametrize("k, n", [(6, 10), (8, 12)])
def test_auto_kernel_matches_reference_forward_and_backward(k, n):
    torch.manual_seed(0)
    counts = [3, 0, 4, 2]  # an empty segment
    x = torch.randn(sum(counts), k, requires_grad=True)
    w = torch.randn(len(counts), n, k, requires_grad=True)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    y = segmented_matmul(x, w, offsets, counts, pick_kernel("auto", x, w))
    g = torch.randn_like(y)
    y.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference(x2, w2, counts)
    ref.backward(g)
    assert torch.allclose(y, ref, atol=1e-5)
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)
    assert torch.allclose(w.grad, w2.grad, atol=1e-5)
    assert w.grad[1].abs().max() == 0


def test_unaligned_input_view_is_copied_for_grouped_mm():
    torch.manual_seed(1)
    counts = [2, 3]
    base = torch.randn(sum(counts), 9)
    x = base[:, 1:]  # leading stride 9 floats = 36 bytes: grouped_mm would refuse it as is
    w = torch.randn(2, 4, 8)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    assert pick_kernel("auto", x, w) == "grouped_mm"
    y = segmented_matmul(x, w, offsets, counts, "grouped_mm")
    assert torch.allclose(y, _reference(x, w, counts), atol=1e-5)
