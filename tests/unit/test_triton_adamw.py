"""The fused AdamW kernel (trainer/triton_adamw.py) against the torch ops of
``adamw_apply``, run by Triton's interpreter on the CPU (the same kernel source the GPU
compiles): updated rows, untouched rows, zeroed gradients, version bumps."""

import pytest
import torch

from tests.numerics import max_rel_err
from trainer import triton_adamw
from trainer.per_slot_optim import AdamwColumns, adamw_apply

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("slots", [[1, 3, 4], [0, 1, 2, 3, 4, 5], [5]])
def test_kernel_equals_torch_ops(kernel_device, slots):
    torch.manual_seed(len(slots))
    n, p = 6, 3 * triton_adamw.BLOCK + 77  # a partial last block
    w, g, m, v = (torch.randn(n, p, device=kernel_device) for _ in range(4))
    v = v.abs()
    coef = torch.rand(len(slots), 8, device=kernel_device) * 0.4 + 0.05  # every factor distinct per slot
    ref = [t.clone() for t in (w, g, m, v)]
    versions = [t._version for t in (w, g, m, v)]
    triton_adamw.adamw_rows(w, g, m, v, slots, coef)
    adamw_apply(*ref, slots, AdamwColumns(*(coef[:, i].clone() for i in range(8))))
    for name, got, want in zip(("weight", "exp_avg", "exp_avg_sq"), (w, m, v), (ref[0], ref[2], ref[3])):
        err = max_rel_err(got, want)
        assert err <= 1e-6, f"{name}: relative error {err:.2e}"
    others = [i for i in range(n) if i not in slots]
    assert torch.equal(g[slots], torch.zeros_like(g[slots])) and torch.equal(ref[1][slots], g[slots])
    assert torch.equal(g[others], ref[1][others])  # grads of other slots untouched (torch path too)
    assert all(t._version > v0 for t, v0 in zip((w, g, m, v), versions))


def test_rejects_mismatched_inputs(kernel_device):
    w = torch.zeros(2, 8, device=kernel_device)
    with pytest.raises(ValueError, match=r"coef must be fp32 \[1, 8\]"):
        triton_adamw.adamw_rows(w, w.clone(), w.clone(), w.clone(), [0], torch.zeros(2, 8, device=kernel_device))
    with pytest.raises(ValueError, match="share one"):
        triton_adamw.adamw_rows(w, torch.zeros(2, 9, device=kernel_device), w.clone(), w.clone(), [0],
                                torch.zeros(1, 8, device=kernel_device))
