"""The fused AdamW kernel (trainer/kernels/triton_adamw.py) against the torch ops of
``adamw_apply``, run by Triton's interpreter on the CPU (the same kernel source the GPU
compiles): updated rows, untouched rows, zeroed gradients, version bumps; and the
trainer's entry with the Triton branch forced against ``torch.optim.AdamW`` per slot."""

import pytest
import torch

from tests.numerics import max_rel_err
from trainer.kernels import triton_adamw
from trainer.optim.per_slot_optim import AdamwColumns, adamw_apply

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


def test_forced_triton_branch_equals_torch_adamw_per_slot(kernel_device, monkeypatch):
    """The trainer's own entry (``adamw_update_slots``: coefficient columns, their stacking
    into the kernel's table, the kernel) with the Triton branch forced (the interpreter on the
    CPU; on a GPU it is taken anyway), against ``torch.optim.AdamW`` on each slot alone: five
    steps, every slot its own lr, betas, eps, weight decay and grad scale, the stepping set
    changing between steps (non-contiguous, a slot that skips a step), lr changing per step.
    The kernel's table columns are read by position, so a swapped pair in the table (say
    1 - beta1 and 1 - beta2) gives wrong moments here."""
    from trainer.optim.per_slot_optim import adamw_update_slots

    calls = []
    real_rows = triton_adamw.adamw_rows

    def counted_rows(*args):
        calls.append(args[4])
        return real_rows(*args)

    monkeypatch.setattr(triton_adamw, "available", lambda t: True)
    monkeypatch.setattr(triton_adamw, "adamw_rows", counted_rows)
    g = torch.Generator().manual_seed(3)
    n, p = 5, triton_adamw.BLOCK + 300  # two column blocks, the last one partial
    hyper = {  # slot: (lr, beta1, beta2, eps, weight decay, grad scale)
        0: (1e-2, 0.9, 0.999, 1e-8, 0.0, 1.0),
        1: (3e-3, 0.5, 0.9, 1e-3, 0.1, 0.25),
        3: (2e-2, 0.8, 0.95, 1e-6, 0.02, 4.0),
        4: (5e-3, 0.95, 0.99, 1e-5, 0.3, 0.5),
    }
    weight = torch.randn(n, p, generator=g)
    refs = {s: weight[s].clone().requires_grad_() for s in hyper}
    opts = {s: torch.optim.AdamW([refs[s]], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
            for s, (lr, b1, b2, eps, wd, _) in hyper.items()}
    weight, grad = weight.to(kernel_device), torch.zeros(n, p, device=kernel_device)
    exp_avg, exp_avg_sq = torch.zeros_like(weight), torch.zeros_like(weight)
    untouched = weight[2].clone()
    steps = {s: 0 for s in hyper}
    stepping_sets = [[0, 1, 3, 4], [1, 4], [0, 3, 4], [0, 1, 3, 4], [3]]
    for i, slots in enumerate(stepping_sets):
        raw = torch.randn(n, p, generator=g)
        grad.copy_(raw)
        lrs = {s: hyper[s][0] * (1.0 - 0.1 * i) for s in slots}  # the schedule moves the lr per step
        for s in slots:
            steps[s] += 1
            refs[s].grad = raw[s] * hyper[s][5]
            opts[s].param_groups[0]["lr"] = lrs[s]
            opts[s].step()
        col = lambda k: torch.tensor([hyper[s][k] for s in slots], dtype=torch.float64)  # noqa: E731
        adamw_update_slots(weight, grad, exp_avg, exp_avg_sq, slots, grad_scale=col(5),
                           lr=torch.tensor([lrs[s] for s in slots], dtype=torch.float64), weight_decay=col(4),
                           beta1=col(1), beta2=col(2), eps=col(3),
                           step=torch.tensor([float(steps[s]) for s in slots], dtype=torch.float64))
        assert calls[-1] == slots  # the Triton branch ran, with this step's slots
        assert torch.equal(grad[slots], torch.zeros_like(grad[slots]))  # consumed
    assert len(calls) == len(stepping_sets)
    for s in hyper:
        state = opts[s].state[refs[s]]
        for name, got, want in (("weight", weight[s], refs[s].detach()), ("exp_avg", exp_avg[s], state["exp_avg"]),
                                ("exp_avg_sq", exp_avg_sq[s], state["exp_avg_sq"])):
            err = max_rel_err(got.cpu(), want)
            assert err <= 2e-6, f"slot {s} {name}: relative error {err:.2e}"
    assert torch.equal(weight[2], untouched) and torch.count_nonzero(exp_avg[2]) == 0  # never stepped
