"""The expert LoRA delta over (expert, slot) groups against a per-token reference.

Reference (independent of the grouped GEMMs): for each routed (token, expert) pair,
``scale * B[slot, e] @ A[slot, e] @ x`` (plus ``x @ W[e].T`` for the whole expert linear)
with plain autograd on slot-major weights. Each node must give the same output and the
same input and weight gradients (its weight gradients arrive in the slot-major ``.grad``
in place): the delta node on grouped_mm and the loop with the group range cut into
chunks (the per-call group limit) and on the segmented Triton kernels, and the fused
expert linear (Triton: base GEMM + delta in one node)."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import max_rel_err
from trainer.lora.expert_lora_nodes import (
    MAX_GROUPS_PER_CALL,
    ExpertLinearLora,
    ExpertLoraDelta,
    GroupLayout,
    LibraryExpertOps,
    TritonExpertOps,
)
from trainer.lora.moe_lora import _expert_major, key_counts, routed_pairs
from trainer.kernels.triton_expert_lora import GroupTiles

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


def _base_weight(seed=1):
    return torch.randn(E, OUT, K, generator=torch.Generator().manual_seed(seed)) * 0.3


def _reference(x, expert, slot, a, b, scales, gy, base=None):
    x = x.clone().requires_grad_()
    a = a.clone().requires_grad_()
    b = b.clone().requires_grad_()
    h = torch.einsum("trk,tk->tr", a[slot, expert], x) * scales[slot, None]
    y = torch.einsum("tor,tr->to", b[slot, expert], h)
    if base is not None:  # the frozen expert GEMM
        y = y + torch.einsum("tok,tk->to", base[expert], x)
    (y * gy).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad


def _grouped(x, expert, slot, a, b, scales, gy, kernel, max_groups=MAX_GROUPS_PER_CALL, base=None):
    """As MoeLoraLayer does it: only the slots lo .. hi - 1 present take part. ``kernel``:
    grouped_mm or loop (LibraryExpertOps), triton (TritonExpertOps), or fused (ExpertLinearLora
    with the base weight, whose GEMM runs on grouped_mm)."""
    lo, hi = int(slot.min()), int(slot.max()) + 1
    key = expert * (hi - lo) + (slot - lo)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E * (hi - lo))
    xs = x[order].clone().requires_grad_()
    a_p = torch.nn.Parameter(a.clone())
    b_p = torch.nn.Parameter(b.clone())
    row_scale = scales[slot[order]]
    if kernel == "fused":
        e_counts = torch.bincount(expert, minlength=E)
        y = ExpertLinearLora.apply(xs, base, e_counts.cumsum(0).to(torch.int32).to(x.device), e_counts.tolist(),
                                   "grouped_mm", a_p, b_p, GroupTiles.of(counts, len(order), hi - lo), row_scale, lo)
    else:
        if kernel == "triton":
            ops = TritonExpertOps(GroupTiles.of(counts, len(order), hi - lo), a_p, b_p, lo)
        else:
            layout = GroupLayout.of(counts.tolist(), x.device, max_groups)
            ops = LibraryExpertOps(layout, kernel, _expert_major(a_p.detach()[lo:hi]), _expert_major(b_p.detach()[lo:hi]))
        y = ExpertLoraDelta.apply(xs, a_p, b_p, ops, row_scale.unsqueeze(1), lo)
    (y * gy[order]).sum().backward()
    inv = torch.argsort(order)
    return y.detach()[inv], xs.grad[inv], a_p.grad, b_p.grad


def _check(got, ref, present):
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref):
        assert max_rel_err(g, r) <= 1e-6, name
    _, _, d_a, d_b = got
    for slot in range(N):
        touched = torch.count_nonzero(d_a[slot]) > 0 and torch.count_nonzero(d_b[slot]) > 0
        assert touched == (slot in present), slot


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
@pytest.mark.parametrize("max_groups", [MAX_GROUPS_PER_CALL, 4, 1])
@pytest.mark.parametrize("present", [(0, 2), (1, 2), (2,)])
def test_grouped_expert_delta_matches_per_token_reference(kernel, max_groups, present, kernel_device):
    """present (0, 2): slot 1 between them has no tokens (empty groups inside the span);
    (1, 2) and (2,): the span starts after slot 0, whose weights must not be touched.
    fp32, on the GPU where there is one (conftest's kernel_device), else the CPU."""
    case = tuple(t.to(kernel_device) for t in _case(present=present))
    _check(_grouped(*case, kernel=kernel, max_groups=max_groups), _reference(*case), present)


@pytest.mark.parametrize("kernel", ["triton", "fused"])
@pytest.mark.parametrize("present, pairs", [((0, 2), 40), ((1, 2), 40), ((2,), 40), ((1,), 1), ((0, 1, 2), 300)])
def test_triton_expert_nodes_match_per_token_reference(kernel, present, pairs, kernel_device):
    """The segmented Triton kernels (compiled on a GPU, else Triton's interpreter) as the
    delta node and as the fused expert linear: the cases above, one routed pair in all, and
    300 pairs (groups longer than a row tile)."""
    case = tuple(t.to(kernel_device) for t in _case(present=present, pairs=pairs, seed=pairs))
    base = _base_weight().to(kernel_device) if kernel == "fused" else None
    _check(_grouped(*case, kernel=kernel, base=base), _reference(*case, base=base), present)


def test_group_chunks_cover_rows_and_groups():
    counts = [3, 0, 2, 0, 0, 5, 1]
    layout = GroupLayout.of(counts, torch.device("cpu"), max_groups=3)
    assert [(g0, g1, r0, r1) for g0, g1, r0, r1, _ in layout.chunks] == [(0, 3, 0, 5), (3, 6, 5, 10), (6, 7, 10, 11)]
    assert [o.tolist() for *_, o in layout.chunks] == [[3, 3, 5], [0, 0, 5], [1]]
    with pytest.raises(ValueError, match="max_groups must be >= 1"):
        GroupLayout.of(counts, torch.device("cpu"), max_groups=0)


@pytest.mark.parametrize("tokens, experts, topk", [(1, 8, 1), (37, 8, 2), (300, 128, 8), (5, 4, 4)])
def test_routed_pairs_equal_nonzero_without_a_sync(tokens, experts, topk):
    """The MoE layer's pairs come from the routing map without ``nonzero`` (whose output size needs
    a host sync): same pairs, same order (token-major, experts ascending), for top-k maps of any
    shape, one expert per token and every expert per token included."""
    g = torch.Generator().manual_seed(tokens + topk)
    top = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    tok, exp = routed_pairs(routing_map, topk)
    ref_tok, ref_exp = routing_map.nonzero(as_tuple=True)
    assert torch.equal(tok, ref_tok) and torch.equal(exp, ref_exp)


@pytest.mark.parametrize("row", [[True, False, False], [True, True, True]])
def test_routed_pairs_refuse_a_token_without_exactly_topk_experts(row):
    """The invariant (exactly top-k experts a token) broken, with fewer or more: refused (on the
    device an asynchronous assert; on the CPU at once), no pair lands silently on a wrong expert."""
    routing_map = torch.tensor([[True, False, True], row])
    with pytest.raises(RuntimeError, match="exactly top-k"):
        routed_pairs(routing_map, 2)


def test_key_counts_equal_bincount():
    g = torch.Generator().manual_seed(3)
    key = torch.randint(0, 41, (500,), generator=g) * 2  # odd values never occur: empty groups
    assert int(key.max()) == 80  # the last group is used too
    assert torch.equal(key_counts(key, 81), torch.bincount(key, minlength=81))
    assert key_counts(key[:0], 5).tolist() == [0] * 5


def test_expert_gemm_without_host_counts():
    """The MoE layer passes no host counts to the expert GEMM on grouped_mm (offsets on the device
    suffice): the same result as with them; the loop kernel, which needs them, refuses None."""
    from trainer.kernels.segmented_mm import segment_mm, segment_mm_nt, segmented_matmul

    counts = [3, 0, 5, 2]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w, gy = torch.randn(10, 16), torch.randn(4, 8, 16), torch.randn(10, 8)
    assert torch.equal(segment_mm(x, w, offs, None, "grouped_mm"), segment_mm(x, w, offs, counts, "grouped_mm"))
    assert torch.equal(segment_mm_nt(gy, w, offs, None, "grouped_mm"), segment_mm_nt(gy, w, offs, counts, "grouped_mm"))
    assert torch.allclose(segmented_matmul(x, w, offs, None, "grouped_mm"), segment_mm(x, w, offs, counts, "loop"),
                          rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="loop kernel needs the segment counts"):
        segment_mm(x, w, offs, None, "loop")
