"""The expert LoRA delta over (expert, slot) groups against a per-token reference.

Reference (independent of the grouped GEMMs): for each routed (token, expert) pair,
``scale * B[slot, e] @ A[slot, e] @ x`` with plain autograd on slot-major weights. The
grouped node must give the same output and the same input and weight gradients (its
weight gradients arrive in the slot-major ``.grad`` in place), on both kernels and with
the group range cut into chunks (the per-call group limit)."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import max_rel_err
from trainer.moe_lora import MAX_GROUPS_PER_CALL, ExpertLoraDelta, GroupLayout, _expert_major

pytestmark = pytest.mark.unit

N, E, R, K, OUT = 3, 5, 4, 12, 8  # slots, experts, rank, in, out


def _case(seed=0, pairs=40, present=(0, 2)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pairs, K, generator=g)
    expert = torch.randint(0, E, (pairs,), generator=g)
    slot = torch.tensor(present)[torch.randint(0, len(present), (pairs,), generator=g)]
    a = torch.randn(N, E, R, K, generator=g) * 0.3
    b = torch.randn(N, E, OUT, R, generator=g) * 0.3
    scales = torch.tensor([0.5, 2.0, 1.5])
    gy = torch.randn(pairs, OUT, generator=g)
    return x, expert, slot, a, b, scales, gy


def _reference(x, expert, slot, a, b, scales, gy):
    x = x.clone().requires_grad_()
    a = a.clone().requires_grad_()
    b = b.clone().requires_grad_()
    h = torch.einsum("trk,tk->tr", a[slot, expert], x) * scales[slot, None]
    y = torch.einsum("tor,tr->to", b[slot, expert], h)
    (y * gy).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad


def _grouped(x, expert, slot, a, b, scales, gy, kernel, max_groups=MAX_GROUPS_PER_CALL):
    """As MoeLoraLayer does it: only the slots lo .. hi - 1 present take part."""
    lo, hi = int(slot.min()), int(slot.max()) + 1
    key = expert * (hi - lo) + (slot - lo)
    order = torch.argsort(key, stable=True)
    layout = GroupLayout.of(torch.bincount(key, minlength=E * (hi - lo)).tolist(), x.device, max_groups)
    xs = x[order].clone().requires_grad_()
    a_p = torch.nn.Parameter(a.clone())
    b_p = torch.nn.Parameter(b.clone())
    y = ExpertLoraDelta.apply(xs, a_p, b_p, _expert_major(a_p.detach()[lo:hi]), _expert_major(b_p.detach()[lo:hi]),
                              layout, scales[slot[order]].unsqueeze(1), kernel, lo)
    (y * gy[order]).sum().backward()
    inv = torch.argsort(order)
    return y.detach()[inv], xs.grad[inv], a_p.grad, b_p.grad


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
@pytest.mark.parametrize("max_groups", [MAX_GROUPS_PER_CALL, 4, 1])
@pytest.mark.parametrize("present", [(0, 2), (1, 2), (2,)])
def test_grouped_expert_delta_matches_per_token_reference(kernel, max_groups, present, kernel_device):
    """present (0, 2): slot 1 between them has no tokens (empty groups inside the span);
    (1, 2) and (2,): the span starts after slot 0, whose weights must not be touched.
    fp32, on the GPU where there is one (conftest's kernel_device), else the CPU."""
    case = tuple(t.to(kernel_device) for t in _case(present=present))
    ref = _reference(*case)
    got = _grouped(*case, kernel=kernel, max_groups=max_groups)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref):
        assert max_rel_err(g, r) <= 1e-6, name
    _, _, d_a, d_b = got
    for slot in range(N):
        touched = torch.count_nonzero(d_a[slot]) > 0 and torch.count_nonzero(d_b[slot]) > 0
        assert touched == (slot in present), slot


def test_group_chunks_cover_rows_and_groups():
    counts = [3, 0, 2, 0, 0, 5, 1]
    layout = GroupLayout.of(counts, torch.device("cpu"), max_groups=3)
    assert [(g0, g1, r0, r1) for g0, g1, r0, r1, _ in layout.chunks] == [(0, 3, 0, 5), (3, 6, 5, 10), (6, 7, 10, 11)]
    assert [o.tolist() for *_, o in layout.chunks] == [[3, 3, 5], [0, 0, 5], [1]]
    with pytest.raises(ValueError, match="max_groups must be >= 1"):
        GroupLayout.of(counts, torch.device("cpu"), max_groups=0)
