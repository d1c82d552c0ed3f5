"""MultiLoraLinear against an explicit per-sample LoRA: forward and all gradients,
both kernels, empty and unequal segments, per-slot rank and scale."""

import pytest
import torch
from torch import nn

from tests.numerics import max_rel_err
from trainer.lora.multi_lora import MultiLoraLinear, SlotRouting
from trainer.kernels.segmented_mm import pick_kernel

pytestmark = pytest.mark.unit

N, R, IN, OUT = 5, 8, 24, 40


class _Linear(nn.Module):
    """Stands in for a Megatron linear's return convention: (output, bias)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(OUT, IN, dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.t(), None


def _layer(kernel, dtype=torch.float64):
    torch.manual_seed(0)
    routing = SlotRouting(N, kernel=kernel)
    layer = MultiLoraLinear(
        _Linear(), name="l", kind="plain", parallel="column", num_slots=N, max_rank=R,
        routing=routing, tp_group=None, device=torch.device("cpu"),
    ).to(dtype)
    ranks = [4, 8, 2, 8, 3]
    with torch.no_grad():
        for i, r in enumerate(ranks):
            layer.lora_A[i, :r] = torch.randn(r, IN, dtype=torch.float64).to(dtype)
            layer.lora_B[i, :, :r] = torch.randn(OUT, r, dtype=torch.float64).to(dtype)
    scales = torch.tensor([2.0, 0.5, 1.0, 3.0, 1.5], dtype=torch.float64)
    return layer, routing, ranks, scales


@pytest.mark.parametrize("kernel, dtype, tol", [("grouped_mm", torch.float32, 1e-5), ("loop", torch.float64, 1e-12), ("loop", torch.float32, 1e-5)])
def test_matches_per_sample_reference(kernel, dtype, tol):
    layer, routing, ranks, scales = _layer(kernel, dtype)
    slots = torch.tensor([0, 0, 2, 2, 2, 4])  # slots 1 and 3 empty, unequal counts
    s, b = 7, len(slots)
    x = torch.randn(s, b, IN, dtype=torch.float64).to(dtype).requires_grad_()
    routing.set(slots, s, scales.float())
    y, bias = layer(x)
    assert bias is None and y.shape == (s, b, OUT)
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g.to(dtype))

    A = layer.lora_A.detach().double().requires_grad_()
    B = layer.lora_B.detach().double().requires_grad_()
    x2 = x.detach().double().requires_grad_()
    W = layer.base.weight.double()
    ref = torch.stack(
        [x2[:, j] @ W.t() + scales[k] * (x2[:, j] @ A[k].t() @ B[k].t()) for j, k in enumerate(slots.tolist())], dim=1
    )
    ref.backward(g)
    # the fp32 results are compared in fp64 (torch promotes a - b to the reference's dtype)
    assert max_rel_err(y, ref) <= tol
    assert max_rel_err(x.grad, x2.grad) <= tol
    assert max_rel_err(layer.lora_A.grad, A.grad) <= tol
    assert max_rel_err(layer.lora_B.grad, B.grad) <= tol
    # empty slots get exactly zero gradient; padded rank rows/cols exactly zero
    for k in (1, 3):
        assert layer.lora_A.grad[k].abs().max() == 0 and layer.lora_B.grad[k].abs().max() == 0
    for k, r in enumerate(ranks):
        assert torch.count_nonzero(layer.lora_A.grad[k, r:]) == 0
        assert torch.count_nonzero(layer.lora_B.grad[k, :, r:]) == 0


def test_disabled_routing_is_the_base():
    layer, routing, _, _ = _layer("loop")
    x = torch.randn(3, 2, IN, dtype=torch.float64)
    y, _ = layer(x)
    assert torch.equal(y, x @ layer.base.weight.t())


def test_bad_routing_rejected():
    layer, routing, _, scales = _layer("loop")
    with pytest.raises(ValueError, match="sorted by slot"):
        routing.set(torch.tensor([2, 0]), 3, scales)
    with pytest.raises(ValueError, match="outside 0..4"):
        routing.set(torch.tensor([0, 5]), 3, scales)
    routing.set(torch.tensor([0, 1]), 3, scales)
    with pytest.raises(RuntimeError, match="routing was set for s=3, b=2"):
        layer(torch.randn(4, 2, IN, dtype=torch.float64))


def test_kernel_choice():
    x = torch.randn(4, IN)
    assert pick_kernel("auto", x, torch.zeros(N, R, IN)) == "grouped_mm"  # CPU runs grouped_mm
    assert pick_kernel("loop", x, torch.zeros(N, R, IN)) == "loop"
