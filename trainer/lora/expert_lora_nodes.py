"""The autograd nodes of expert LoRA over (expert, slot) groups, and their two kernel sets.

For the routed (token, expert) pairs of an MoE layer, sorted by group g = e * S + s
(moe_lora.py), with per-pair scale s(t) = the slot's alpha / rank:

    d[t] = s(t) * B_g(t) A_g(t) x[t]

Two interchangeable kernel sets compute the four products (x A^T, h B^T, g B, gh A) and
the two weight gradients (dA = gh^T x, dB = g^T h):

* ``LibraryExpertOps`` (the fallback, and the reference in tests): ``grouped_mm`` or the
  per-group loop (segmented_mm.py) over expert-major compute copies of the weights, the
  group range cut into chunks of at most ``MAX_GROUPS_PER_CALL`` groups (``GroupLayout``);
* ``TritonExpertOps``: the segmented Triton kernels of triton_expert_lora.py (one launch
  over every group, slot-major weights read in place).

``ExpertLoraDelta`` is the delta as its own node (the base GEMM and the sum stay outside),
with either kernel set; it carries expert tensor parallelism. ``ExpertLinearLora`` is one
expert linear whole, frozen base GEMM and delta in one node, Triton only, tensor parallel 1:
the expand adds into the base GEMM's output and the LoRA input gradient into the base's,
in place (what it saves: one [M, out] delta tensor and its sum in forward, one [M, in]
gradient and its sum in backward, per expert linear).

Slot gradients are added in place into the slot-major fp32 ``.grad`` (the parameters are
inputs only so that autograd runs the backward; they get no gradient through autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.kernels import triton_expert_lora as tx
from trainer.kernels.segmented_mm import Kernel, segment_mm, segment_mm_nt, segment_weight_grad

MAX_GROUPS_PER_CALL = 1023


@dataclass(frozen=True)
class GroupLayout:
    """Contiguous row segments, one per group (empty ones allowed), cut into chunks of at
    most ``max_groups`` groups: ``chunks[i] = (g0, g1, row0, row1, offsets)`` with the
    chunk's cumulative segment ends relative to ``row0`` (int32, on the rows' device).

    Group-count limit: a grouped GEMM call takes at most ``MAX_GROUPS_PER_CALL`` groups
    (1023: torch's CUDA grouped GEMM checks ``group_count < 1024`` -- its preparation kernel
    runs one thread per group in one block; measured on the H200: 1024 groups raise "Can't
    process more than 1024 groups"). Groups are consecutive in both the sorted rows and the
    expert-major weights, so a chunk is a row range and a weight range, and ceil(G / 1023)
    calls cover any E * N (E = 128, N = 32: 5 calls per GEMM)."""

    counts: list[int]
    chunks: tuple[tuple[int, int, int, int, torch.Tensor], ...]

    @staticmethod
    def of(counts: list[int], device: torch.device, max_groups: int = MAX_GROUPS_PER_CALL) -> "GroupLayout":
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        chunks, row0 = [], 0
        for g0 in range(0, len(counts), max_groups):
            g1 = min(g0 + max_groups, len(counts))
            row1 = int(ends[g1 - 1])
            offs = (ends[g0:g1] - row0).to(torch.int32).to(device)
            chunks.append((g0, g1, row0, row1, offs))
            row0 = row1
        return GroupLayout(counts, tuple(chunks))

    def mm(self, x: torch.Tensor, w: torch.Tensor, kernel: Kernel) -> torch.Tensor:
        """y[t] = x[t] @ w[g(t)].T: x [T, K], w [G, N, K] -> [T, N]."""
        return torch.cat([segment_mm(x[r0:r1], w[g0:g1], offs, self.counts[g0:g1], kernel)
                          for g0, g1, r0, r1, offs in self.chunks])

    def mm_nt(self, gy: torch.Tensor, w: torch.Tensor, kernel: Kernel) -> torch.Tensor:
        """gx[t] = gy[t] @ w[g(t)]: gy [T, N], w [G, N, K] -> [T, K]."""
        return torch.cat([segment_mm_nt(gy[r0:r1], w[g0:g1], offs, self.counts[g0:g1], kernel)
                          for g0, g1, r0, r1, offs in self.chunks])

    def weight_grad(self, gy: torch.Tensor, x: torch.Tensor, kernel: Kernel) -> torch.Tensor:
        """dW[g] = gy[seg g].T @ x[seg g]: -> [G, N, K] (zeros for empty groups)."""
        return torch.cat([segment_weight_grad(gy[r0:r1], x[r0:r1], offs, self.counts[g0:g1], kernel)
                          for g0, g1, r0, r1, offs in self.chunks])


def slot_grads(a_param: torch.Tensor, b_param: torch.Tensor, lo: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows lo .. lo + span - 1 of the slot-major fp32 gradients (made zero where missing, as
    autograd would; the trainer presets them: SlotBuffers)."""
    for param in (a_param, b_param):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return a_param.grad[lo : lo + span], b_param.grad[lo : lo + span]


class LibraryExpertOps:
    """grouped_mm / the loop over a ``GroupLayout``, on the expert-major compute copies
    ``a_c [E * S, R, in]`` and ``b_c [E * S, out, R]`` of slots lo .. lo + S - 1."""

    def __init__(self, layout: GroupLayout, kernel: Kernel, a_c: torch.Tensor, b_c: torch.Tensor) -> None:
        self.layout, self.kernel, self.a_c, self.b_c = layout, kernel, a_c, b_c

    def x_a(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.mm(x, self.a_c, self.kernel)

    def h_b(self, h: torch.Tensor) -> torch.Tensor:
        return self.layout.mm(h, self.b_c, self.kernel)

    def gy_b(self, gy: torch.Tensor) -> torch.Tensor:
        return self.layout.mm_nt(gy, self.b_c, self.kernel)

    def gh_a(self, gh: torch.Tensor) -> torch.Tensor:
        return self.layout.mm_nt(gh, self.a_c, self.kernel)

    def add_weight_grads(self, a_param, b_param, lo: int, x, gh, gy, h) -> None:  # noqa: ANN001
        e = a_param.shape[1]
        span = self.a_c.shape[0] // e
        for grad, g in zip(slot_grads(a_param, b_param, lo, span),
                           (self.layout.weight_grad(gh, x, self.kernel), self.layout.weight_grad(gy, h, self.kernel))):
            # [E * S, ...] expert-major -> the [S, E, ...] slot-major rows, in place (one strided add)
            grad.transpose(0, 1).add_(g.view(e, span, *g.shape[1:]))


class TritonExpertOps:
    """The segmented Triton kernels over ``tiles``, reading slots lo .. lo + S - 1 of the
    slot-major parameters in place."""

    def __init__(self, tiles: tx.GroupTiles, a_param: torch.Tensor, b_param: torch.Tensor, lo: int) -> None:
        span = tiles.groups_per_expert
        self.tiles, self.lo = tiles, lo
        self.a, self.b = a_param.detach()[lo : lo + span], b_param.detach()[lo : lo + span]  # [S, E, R, in] / [S, E, out, R]

    def x_a(self, x: torch.Tensor) -> torch.Tensor:
        return tx.shrink(x, self.a, self.tiles, None, wide_dim=3)

    def h_b(self, h: torch.Tensor) -> torch.Tensor:
        y = h.new_empty(h.shape[0], self.b.shape[2])
        return tx.expand_into(y, h, self.b, self.tiles, rank_dim=3, accumulate=False)

    def gy_b(self, gy: torch.Tensor) -> torch.Tensor:
        return tx.shrink(gy, self.b, self.tiles, None, wide_dim=2)

    def gh_a(self, gh: torch.Tensor) -> torch.Tensor:
        gx = gh.new_empty(gh.shape[0], self.a.shape[3])
        return tx.expand_into(gx, gh, self.a, self.tiles, rank_dim=2, accumulate=False)

    def add_weight_grads(self, a_param, b_param, lo: int, x, gh, gy, h) -> None:  # noqa: ANN001
        grad_a, grad_b = slot_grads(a_param, b_param, lo, self.tiles.groups_per_expert)
        tx.weight_grad_into(grad_a, x, gh, self.tiles, wide_dim=3)
        tx.weight_grad_into(grad_b, gy, h, self.tiles, wide_dim=2)


class ExpertLoraDelta(torch.autograd.Function):
    """d[t] = scale[t] * B_g(t) A_g(t) x[t] over (expert, slot) groups, with ``ops`` (either
    kernel set); slot weight gradients added in place into the slot-major fp32 ``.grad``.

    Tensor parallelism (``tp_group`` given), as multi_lora.py does it for dense linears:
    column-parallel fc1 (B split on outputs): h = A x on every rank, dh all-reduced in
    backward, so dA and this delta's dx are complete on every rank; row-parallel fc2 (A split
    on inputs): the partial h all-reduced in forward, B replicated, the delta complete."""

    @staticmethod
    def forward(ctx, x, a_param, b_param, ops, row_scale, lo=0, parallel=None, tp_group=None):  # noqa: ANN001
        h = ops.x_a(x)  # [M, R]
        if parallel == "row" and tp_group is not None:
            dist.all_reduce(h, group=tp_group)
        h = h * row_scale
        y = ops.h_b(h)  # [M, out]
        ctx.save_for_backward(x, h, row_scale)
        ctx.ops, ctx.a_param, ctx.b_param, ctx.lo = ops, a_param, b_param, lo
        ctx.parallel, ctx.tp_group = parallel, tp_group
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001
        x, h, row_scale = ctx.saved_tensors
        ops = ctx.ops
        gy = gy.contiguous()
        gh = ops.gy_b(gy)
        if ctx.parallel == "column" and ctx.tp_group is not None:  # each rank holds part of B's outputs: sum their dh
            dist.all_reduce(gh, group=ctx.tp_group)
        gh = gh * row_scale
        gx = ops.gh_a(gh) if ctx.needs_input_grad[0] else None
        ops.add_weight_grads(ctx.a_param, ctx.b_param, ctx.lo, x, gh, gy, h)
        return gx, None, None, None, None, None, None, None


class ExpertLinearLora(torch.autograd.Function):
    """y = x W_e^T + scale * B_g A_g x for the routed pairs x [M, in] sorted by group: the frozen
    expert GEMM (``segment_mm`` over the E expert segments, ``e_offsets`` / ``e_counts``) with
    its LoRA delta added in place by the Triton expand; tensor parallel 1 only (module doc).

    ``row_scale`` [M] fp32 is applied in the kernels' fp32 accumulators (h and gh)."""

    @staticmethod
    def forward(ctx, x, weight, e_offsets, e_counts, kernel, a_param, b_param, tiles, row_scale, lo=0):  # noqa: ANN001
        span = tiles.groups_per_expert
        a, b = a_param.detach()[lo : lo + span], b_param.detach()[lo : lo + span]
        y = segment_mm(x, weight, e_offsets, e_counts, kernel)  # [M, out], a fresh tensor
        h = tx.shrink(x, a, tiles, row_scale, wide_dim=3)  # scaled
        tx.expand_into(y, h, b, tiles, rank_dim=3)
        ctx.save_for_backward(x, weight, e_offsets, h, row_scale)
        ctx.e_counts, ctx.kernel, ctx.tiles, ctx.lo = e_counts, kernel, tiles, lo
        ctx.a_param, ctx.b_param = a_param, b_param
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001
        x, weight, e_offsets, h, row_scale = ctx.saved_tensors
        tiles, lo = ctx.tiles, ctx.lo
        grad_a, grad_b = slot_grads(ctx.a_param, ctx.b_param, lo, tiles.groups_per_expert)
        a, b = ctx.a_param.detach()[lo : lo + grad_a.shape[0]], ctx.b_param.detach()[lo : lo + grad_a.shape[0]]
        gy = gy.contiguous()
        gh = tx.shrink(gy, b, tiles, row_scale, wide_dim=2)  # scaled
        gx = None
        if ctx.needs_input_grad[0]:
            gx = segment_mm_nt(gy, weight, e_offsets, ctx.e_counts, ctx.kernel)  # fresh
            tx.expand_into(gx, gh, a, tiles, rank_dim=2)
        tx.weight_grad_into(grad_b, gy, h, tiles, wide_dim=2)
        tx.weight_grad_into(grad_a, x, gh, tiles, wide_dim=3)
        return gx, None, None, None, None, None, None, None, None, None
