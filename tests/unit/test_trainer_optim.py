"""Per-slot AdamW equals torch.optim.AdamW bit for bit; schedule and clipping values."""

import math

import pytest
import torch

from trainer.config import SlotHyperParams
from trainer.optim.per_slot_optim import adamw_update, clip_coefficient, lr_at

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch_on_a_view(wd):
    hyper = SlotHyperParams(lr=3e-3, weight_decay=wd, betas=(0.8, 0.95), eps=1e-7)
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(3, 4, 5, generator=g)
    m, v = torch.zeros_like(stacked), torch.zeros_like(stacked)
    ref = stacked[1, :2].clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=wd, foreach=False)
    before_others = stacked.clone()
    for step in range(1, 6):
        grad = torch.randn(2, 5, generator=g)
        ref.grad = grad.clone()
        opt.step()
        adamw_update(stacked[1, :2], grad, m[1, :2], v[1, :2], step=step, lr=hyper.lr, hyper=hyper)
    assert torch.equal(stacked[1, :2], ref.detach())
    state = opt.state[ref]
    assert torch.equal(m[1, :2], state["exp_avg"]) and torch.equal(v[1, :2], state["exp_avg_sq"])
    # nothing outside the block moved
    mask = torch.ones_like(stacked, dtype=torch.bool)
    mask[1, :2] = False
    assert torch.equal(stacked[mask], before_others[mask])
    assert torch.count_nonzero(m[mask]) == 0


def test_schedule_values():
    const = SlotHyperParams(lr=1e-3, warmup_steps=4)
    assert [lr_at(const, s) for s in (1, 2, 4, 5, 100)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3])
    cos = SlotHyperParams(lr=1e-3, warmup_steps=2, lr_schedule="cosine", total_steps=12, min_lr_ratio=0.1)
    assert lr_at(cos, 2) == pytest.approx(1e-3)
    mid = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cos, 7) == pytest.approx(mid)
    assert lr_at(cos, 12) == pytest.approx(1e-4) and lr_at(cos, 50) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="start at 1"):
        lr_at(const, 0)


def test_clip_coefficient_matches_torch():
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.arange(10.0)
    norm = p.grad.norm().item()
    torch.nn.utils.clip_grad_norm_([p], 2.0)
    assert clip_coefficient(norm, 2.0) * torch.arange(10.0) == pytest.approx(p.grad)
    assert clip_coefficient(0.5, 2.0) == 1.0 and clip_coefficient(10.0, None) == 1.0


def test_vectorized_slots_update_matches_torch_per_slot():
    """adamw_update_slots on slots {0, 2} of a stacked tensor = torch AdamW on each slot
    (within an ulp or two); slot 1 untouched; zero padding stays exactly zero."""
    from trainer.optim.per_slot_optim import adamw_update_slots

    g = torch.Generator().manual_seed(1)
    hypers = {0: SlotHyperParams(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-6),
              2: SlotHyperParams(lr=3e-3, betas=(0.8, 0.95), eps=1e-8)}
    p = torch.randn(3, 4, 6, generator=g)
    p[:, 3:] = 0.0  # padding rows (rank 3 of max 4)
    m, v, grad = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    refs = {s: p[s].clone().requires_grad_() for s in hypers}
    opts = {s: torch.optim.AdamW([refs[s]], lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay, foreach=False)
            for s, h in hypers.items()}
    slot1 = p[1].clone()
    scale = {0: 0.5, 2: 2.0}
    for step in range(1, 4):
        grad.zero_()
        grad[:, :3] = torch.randn(3, 3, 6, generator=g)
        for s in hypers:
            refs[s].grad = grad[s] * scale[s]
            opts[s].step()
        f64 = dict(dtype=torch.float64)
        adamw_update_slots(
            p, grad, m, v, torch.tensor([0, 2]), grad_scale=torch.tensor([0.5, 2.0], **f64),
            lr=torch.tensor([hypers[0].lr, hypers[2].lr], **f64), weight_decay=torch.tensor([0.1, 0.0], **f64),
            beta1=torch.tensor([0.9, 0.8], **f64), beta2=torch.tensor([0.99, 0.95], **f64),
            eps=torch.tensor([1e-6, 1e-8], **f64), step=torch.tensor([float(step)] * 2, **f64),
        )
    for s in hypers:
        torch.testing.assert_close(p[s], refs[s].detach(), rtol=2e-7, atol=1e-9)
        torch.testing.assert_close(m[s], opts[s].state[refs[s]]["exp_avg"], rtol=2e-7, atol=1e-12)
        torch.testing.assert_close(v[s], opts[s].state[refs[s]]["exp_avg_sq"], rtol=2e-7, atol=1e-12)
    assert torch.equal(p[1], slot1) and torch.count_nonzero(m[1]) == 0
    assert torch.count_nonzero(p[:, 3:]) == 0 and torch.count_nonzero(m[:, 3:]) == 0 and torch.count_nonzero(v[:, 3:]) == 0


def test_slot_sets_update_in_place_or_gathered_alike():
    """A contiguous slot range is updated through views, other sets are gathered and
    scattered back: both give each slot bit-identically what updating it alone gives,
    and slots outside the set stay untouched."""
    from trainer.optim.per_slot_optim import adamw_update_slots

    g = torch.Generator().manual_seed(2)
    p0 = torch.randn(4, 3, 5, generator=g)
    grad0 = torch.randn(4, 3, 5, generator=g)
    f64 = dict(dtype=torch.float64)
    hp = dict(lr=torch.tensor([1e-2, 3e-3], **f64), weight_decay=torch.tensor([0.1, 0.0], **f64),
              beta1=torch.tensor([0.9, 0.8], **f64), beta2=torch.tensor([0.99, 0.95], **f64),
              eps=torch.tensor([1e-6, 1e-8], **f64), step=torch.tensor([3.0, 1.0], **f64),
              grad_scale=torch.tensor([0.5, 2.0], **f64))

    def state():
        return [p0.clone(), grad0.clone(), torch.full_like(p0, 0.1), torch.full_like(p0, 0.2)]

    for pair in ([1, 2], [0, 2]):  # views / gathered
        together, alone = state(), state()
        adamw_update_slots(*together, torch.tensor(pair), **hp)
        for j, slot in enumerate(pair):
            adamw_update_slots(*alone, [slot], **{k: v[j : j + 1] for k, v in hp.items()})
        for x, y in zip(together[:1] + together[2:], alone[:1] + alone[2:]):
            assert torch.equal(x, y), pair
        others = [k for k in range(4) if k not in pair]
        assert torch.equal(together[0][others], p0[others]) and not torch.equal(together[0][pair], p0[pair])
