"""AdamW's bias correction (and the warm-up) take each slot's OWN update number, through the trainer's
two step functions (trainer/optim/slot_steps.py: ``step_due_slots``, the loop's; ``adam_step``, the
Tinker API's optim_step) on the real slot buffers, by the torch ops and by the Triton kernel (its
interpreter on the CPU; compiled on a GPU).

The reference is the definition, written here in numpy float64 and never calling the product:
Adam (Kingma & Ba 2015, Algorithm 1) with decoupled weight decay (Loshchilov & Hutter 2019), as
torch.optim.AdamW applies it. For update number t of one slot:

    w <- w * (1 - lr * wd)
    m <- b1 * m + (1 - b1) * g            m_hat = m / (1 - b1^t)
    v <- b2 * v + (1 - b2) * g^2          v_hat = v / (1 - b2^t)
    w <- w - lr * m_hat / (sqrt(v_hat) + eps)

and the warm-up's lr_t = lr * t / warmup_steps for t <= warmup_steps. Each slot starts at its own
update count with moments left by earlier updates, slots step in changing sets, and the reference
counts every slot's updates itself (each round starts from the product's weights and moments, so
fp32 roundings do not pile up): an update number one too high or too low anywhere (the per-slot rows
the loop builds, the Tinker step, the factors' formula, the warm-up) moves every slot update it
reaches by 0.2 % or more (UPDATE_TOL; plants: tests/reference/plant_mutation.py, replayed by
tests/unit/off_by_one_mutations.py). The first update also has a closed form (m_hat = g,
v_hat = g^2): every weight moves by lr * |g| / (|g| + eps), about lr, checked alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.numerics import max_rel_err
from tests.unit.test_compact_adamw import path  # noqa: F401 - the fixture: torch ops, or the Triton kernel
from tests.unit.test_step_overlap import _layers
from trainer.config import SlotHyperParams
from trainer.lora.slot_buffers import SlotBuffers
from trainer.lora.slots import NUM, SAMPLES, SlotState, zero_stats
from trainer.optim.slot_steps import adam_step, step_due_slots
from trainer.optim.step_overlap import StepOverlap
from trainer.platform.distributed import ParallelLayout

pytestmark = pytest.mark.unit

LAYOUT = ParallelLayout(rank=0, world_size=1, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
# slot: (hyper-parameters, updates already taken); slot 3 never steps. Small betas make the bias
# correction large for several updates; slot 1 also warms up (its lr depends on the update number).
SLOTS = {
    0: (SlotHyperParams(lr=1e-2, betas=(0.9, 0.999), eps=1e-8), 0),
    1: (SlotHyperParams(lr=3e-3, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.1, warmup_steps=6), 3),
    2: (SlotHyperParams(lr=2e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.02), 9),
    3: (SlotHyperParams(lr=1e-2), 5),
    4: (SlotHyperParams(lr=5e-3, betas=(0.95, 0.99), eps=1e-5), 1),
}
TINKER = dict(lr=7e-3, beta1=0.7, beta2=0.97, eps=1e-6, weight_decay=0.05)  # an optim_step call's own parameters
ROUNDS = [[0, 1, 2, 4], [1, 2], ("tinker", 4), [0, 2, 4], ("tinker", 1), [0, 1, 2, 4], ("tinker", 0), [1, 4]]
# max |dw - dw_ref| / max |dw_ref| per slot and round. Measured: clean <= 6.4e-7 (torch ops and kernel);
# planted, every slot update it reaches >= 2.0e-3 (the first moment's correction of the next update at
# update 8 with beta1 0.5), most >= 1e-2, and inf or nan where an update number 0 divides by zero.
UPDATE_TOL = 1e-5


class PaperAdam:
    """One slot's Adam state in float64 and its own update count (the module doc's formulas)."""

    def __init__(self, t: int) -> None:
        self.t = t  # updates taken: counted here, never read from the product

    def start_from(self, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """The slot's weights and moments before an update (so fp32 roundings do not accumulate)."""
        self.w, self.m, self.v = (x.detach().cpu().double().numpy().copy() for x in (w, m, v))

    def update(self, g: torch.Tensor, *, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
        g = g.detach().cpu().double().numpy()
        self.t += 1
        self.w = self.w * (1.0 - lr * wd)
        self.m = b1 * self.m + (1.0 - b1) * g
        self.v = b2 * self.v + (1.0 - b2) * g * g
        m_hat = self.m / (1.0 - b1**self.t)
        v_hat = self.v / (1.0 - b2**self.t)
        self.w = self.w - lr * m_hat / (np.sqrt(v_hat) + eps)


def warmed_up_lr(h: SlotHyperParams, t: int) -> float:
    """The constant schedule with linear warm-up, for update number t (1-based)."""
    return h.lr * t / h.warmup_steps if h.warmup_steps and t <= h.warmup_steps else h.lr


def _due(states: dict[int, SlotState], slots: list[int]) -> list[SlotState]:
    """Each due slot's pending statistics: one sample, sequence_mean: its gradient is used as is."""
    for s in slots:
        states[s].pending = zero_stats()
        states[s].pending[SAMPLES], states[s].pending[NUM] = 1.0, 0.5
    return [states[s] for s in slots]


def _trainer(device: torch.device, seed: int = 0):
    torch.manual_seed(seed)
    layers = _layers(len(SLOTS))
    buf = SlotBuffers(layers, len(SLOTS), device)
    buf.weight.copy_(torch.randn(buf.weight.shape) * 2e-3)  # small weights: the update is not lost in their ulps
    states = {}
    for s, (hyper, taken) in SLOTS.items():
        h = hyper.model_copy(update={"max_grad_norm": None, "samples_per_step": 1})
        states[s] = SlotState(hyper=h, rank=4, scale=1.0, seed=s, registration=None, step=taken)
        if taken:  # moments as earlier updates leave them
            buf.exp_avg[s] = (torch.randn(buf.weight.shape[1]) * 0.1).to(device)
            buf.exp_avg_sq[s] = (torch.rand(buf.weight.shape[1]) * 0.01 + 1e-4).to(device)
    return buf, states, StepOverlap(layers, buf, device, enabled=False)


def _update_error(after: torch.Tensor, before: torch.Tensor, ref: PaperAdam) -> float:
    got = (after.detach().cpu().double() - before.detach().cpu().double()).numpy()
    want = ref.w - before.detach().cpu().double().numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_slots_at_different_update_numbers_step_like_adam(path):  # noqa: F811 - the imported fixture
    """Eight rounds: loop steps of changing slot sets and Tinker steps with a call's own parameters;
    after each, every stepped slot's update and moments equal the reference's, its update count the
    reference's, and the other slots' rows are untouched."""
    buf, states, overlap = _trainer(path)
    refs = {s: PaperAdam(taken) for s, (_, taken) in SLOTS.items()}
    for k, plan in enumerate(ROUNDS):
        buf.grad.copy_(torch.randn(buf.grad.shape, generator=torch.Generator().manual_seed(100 + k)))
        grads, before = buf.grad.clone(), buf.weight.clone()
        for s in SLOTS:
            refs[s].start_from(buf.weight[s], buf.exp_avg[s], buf.exp_avg_sq[s])
        if isinstance(plan, tuple):
            stepped = [plan[1]]
            adam_step(buf, plan[1], states[plan[1]], LAYOUT, path, max_grad_norm=None, **TINKER)
            refs[plan[1]].update(grads[plan[1]], lr=TINKER["lr"], b1=TINKER["beta1"], b2=TINKER["beta2"],
                                 eps=TINKER["eps"], wd=TINKER["weight_decay"])
        else:
            stepped = plan
            step_due_slots(buf, plan, _due(states, plan), LAYOUT, path, overlap)
            for s in plan:
                h = states[s].hyper
                refs[s].update(grads[s], lr=warmed_up_lr(h, refs[s].t + 1), b1=h.betas[0], b2=h.betas[1], eps=h.eps,
                               wd=h.weight_decay)
        for s in SLOTS:
            assert states[s].step == refs[s].t, (k, s)
            if s not in stepped:
                assert torch.equal(buf.weight[s], before[s]), (k, s)
                continue
            err = _update_error(buf.weight[s], before[s], refs[s])
            assert err <= UPDATE_TOL, f"round {k} slot {s} (update {refs[s].t}): update off by {err:.2e} of its size"
            for got, want in ((buf.exp_avg[s], refs[s].m), (buf.exp_avg_sq[s], refs[s].v)):
                assert max_rel_err(got.cpu().double(), torch.from_numpy(want)) <= 1e-6, (k, s)
            assert torch.count_nonzero(buf.grad[s]) == 0  # consumed
    assert [states[s].step for s in SLOTS] == [4, 8, 13, 5, 6]


def test_the_first_update_moves_each_weight_by_lr(path):  # noqa: F811 - the imported fixture
    """Update number 1 (the loop's and the Tinker step's): m_hat = g and v_hat = g^2, so each weight
    moves by exactly -lr * g / (|g| + eps); with |g| >= 0.5 and eps 1e-8 that is lr in size. A bias
    correction computed for update 2 moves them by lr * sqrt(1 + b2) / (1 + b1), for update 0 by nan."""
    buf, states, overlap = _trainer(path)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    for s in (0, 3):
        states[s] = SlotState(hyper=SlotHyperParams(lr=lr, betas=(b1, b2), eps=eps, max_grad_norm=None, samples_per_step=1),
                              rank=4, scale=1.0, seed=s, registration=None)
        buf.exp_avg[s].zero_()
        buf.exp_avg_sq[s].zero_()
    g = torch.rand(buf.grad.shape, generator=torch.Generator().manual_seed(7)) + 0.5
    g = g * torch.where(torch.rand(buf.grad.shape, generator=torch.Generator().manual_seed(8)) < 0.5, -1.0, 1.0)
    buf.grad.copy_(g)
    before = buf.weight.clone()
    step_due_slots(buf, [0], _due(states, [0]), LAYOUT, path, overlap)
    adam_step(buf, 3, states[3], LAYOUT, path, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=0.0, max_grad_norm=None)
    for s in (0, 3):
        moved = (buf.weight[s] - before[s]).cpu().double()
        want = -lr * g[s].double() / (g[s].double().abs() + eps)
        assert states[s].step == 1
        assert float((moved - want).abs().max()) <= 1e-3 * lr, f"slot {s}: the first update is not lr in size"
