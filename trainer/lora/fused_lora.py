"""A LoRA-wrapped linear's base GEMM and slot deltas as one autograd node.

    y[t] = x[t] @ W.T + scale(t) * B[g(t)] @ A[g(t)] @ x[t]        (g(t) = slot of token t)

The general path (multi_lora.py) runs the base linear, then the delta as two
segmented GEMMs, then adds them, each its own autograd node. For a frozen base
and packed tokens (the trainer's default), this node does
the same math with fewer passes over memory, which is what a LoRA step costs on
top of the frozen base (the rank-R GEMMs themselves are memory-bound):

* the delta is the C operand of the base GEMM (``addmm_`` in place, beta = 1; at TP 1 and
  column-parallel), so no
  separate pass adds it to the [T, out] output; in backward, the LoRA part of the
  input gradient is likewise the C operand of ``g @ W``, so autograd does not sum
  two [T, in] gradients;
* the stacked fp32 slot weights come in the compute dtype from a cache that is
  refreshed only when the weights change (``ComputeWeights``), not cast four times
  per micro-batch;
* only the slots from the first to the last one present in the micro-batch take
  part (``lo:hi``): a micro-batch of one adapter among 64 resident ones does not
  read, or produce gradients for, the other 63;
* the slot gradients, computed in the compute dtype with fp32 accumulation by the
  GEMM, are added in place into the fp32 gradient buffers (one mixed-dtype add),
  instead of being cast to fp32 and then accumulated by autograd. The node returns
  no gradient for the LoRA parameters themselves: they are inputs only so that
  autograd runs this backward even when ``x`` needs no gradient (the first layer).

Tensor parallelism (``tp``, no sequence parallelism: the trainer turns it off). The node
then stands in for the whole Megatron linear, its TP communication included:

* column-parallel (qkv, fc1; x replicated, W and B split on outputs, A replicated). Forward:
  h = s x A^T is computed whole on every rank, y_local = x W_local^T + h B_local^T, no
  communication. Backward: gh_r = s g_local B_local is rank r's *partial* sum over its
  output rows (gh = sum_r gh_r), so dA = gh^T x needs gh all-reduced ([T, R]: small). The
  input gradient is all-reduced as Megatron's column-parallel linear does:
  dx = all_reduce(g_local W_local + gh_r A) = g W + (sum_r gh_r) A = g W + gh A.
  Invariant: dx is built from the partial gh_r, never from the reduced gh, else the LoRA
  part of dx would be counted tp times. dB_local = g_local^T h is complete on its rank.
* row-parallel (proj, fc2; x split on inputs, W and A split on inputs, B replicated).
  Forward: y = reduce(x W_local^T) + reduce(s x A_local^T) B^T, where both reductions are
  ONE all-reduce over the partial [x W_local^T | s x A_local^T] in a single flat buffer.
  Invariant: B's delta is added after the reduce, never before (B and the reduced h are
  the same on every rank, so a delta added before the sum would be counted tp times).
  Backward needs no communication: g is replicated, so gh = s g B is whole on every rank,
  dB = g^T h and dA_local = gh^T x_local are complete, and dx_local = g W_local + gh A_local
  is this rank's input shard, as Megatron's row-parallel linear returns it.

Same result as the general path up to float rounding (tests/unit/test_fused_lora.py; at
TP 2: tests/integration/test_fused_lora_tp.py).

LoRA in the GEMM (``lora_gemm``, trainer/kernels/cutlass_lora): with ``cutlass`` (or ``auto`` where it
measured faster) the forward's ``x W^T + h B_g^T`` and the input gradient's ``g W + gh A_g`` run as ONE
CUTLASS GEMM each, the expand as extra K blocks of the base GEMM, so the [T, out] delta and the
[T, in] LoRA input gradient never exist. Everything else above is unchanged: h and gh are computed as
before (and gh stays the partial sum under column-parallel TP), the row-parallel forward keeps its
delta after the all-reduce on today's path, and ``library`` (the default) or a CPU tensor runs
exactly today's code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from trainer.kernels import triton_lora
from trainer.kernels.cutlass_lora import dispatch as lora_gemm_dispatch
from trainer.kernels.cutlass_lora.plan import TilePlan
from trainer.kernels.segmented_mm import Kernel, segment_mm, segment_mm_nt, segment_weight_grad


@dataclass(frozen=True)
class SlotSpan:
    """The slots a micro-batch touches: ``lo:hi`` (first to last present, empty ones between
    allowed), their cumulative segment ends (int32, absolute token indices: every slot
    before ``lo`` is empty) and token counts."""

    lo: int
    hi: int
    offsets: torch.Tensor
    counts: list[int]
    _tiles: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property  # read by every layer's forward: counted once per micro-batch
    def segments(self) -> int:
        """How many slots in the span have tokens."""
        return sum(1 for n in self.counts if n)

    def tiles(self, device: torch.device) -> triton_lora.SlotTiles:
        """The segments' row tiles for the Triton rank-R kernels (made once per micro-batch)."""
        t = self._tiles.get(device)
        if t is None:
            t = self._tiles[device] = triton_lora.SlotTiles.of(self.counts, device)
        return t

    def gemm_plan(self, tile_m: int, device: torch.device) -> TilePlan:
        """The segments' row-tile table for the LoRA-in-the-GEMM kernel (made once per micro-batch and
        tile height)."""
        key = ("lora_gemm", tile_m, device)
        plan = self._tiles.get(key)
        if plan is None:
            plan = self._tiles[key] = TilePlan.of(self.counts, tile_m, device)
        return plan

    @staticmethod
    def of(offsets: torch.Tensor, counts: list[int]) -> "SlotSpan":
        present = [g for g, n in enumerate(counts) if n]
        if not present:
            raise ValueError("a routed micro-batch has no tokens")
        lo, hi = present[0], present[-1] + 1
        return SlotSpan(lo, hi, offsets[lo:hi], counts[lo:hi])


@dataclass(frozen=True)
class TensorParallel:
    """How the fused node's linear is split over tensor parallelism (module docstring)."""

    mode: Literal["column", "row"]
    group: object  # torch ProcessGroup of the TP ranks


class ComputeWeights:
    """The stacked LoRA weights of one layer in the compute dtype, cast again only when the
    fp32 masters changed.

    Change detection is torch's version counter: every in-place op on a tensor or a view
    of it (optimizer updates, slot init/clear/load: all in place on the slot buffers)
    bumps it; kernels that write through raw pointers bump it explicitly
    (``torch.autograd.graph.increment_version``)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None

    def get(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if a.dtype == dtype and b.dtype == dtype:
            return a.detach(), b.detach()
        key = (dtype, a.data_ptr(), a._version, b.data_ptr(), b._version)
        if key != self._key:
            self._a, self._b = a.detach().to(dtype), b.detach().to(dtype)
            self._key = key
        return self._a, self._b


class FusedLoraLinear(torch.autograd.Function):
    """y = x @ W.T + delta(x) for packed tokens x [T, in] (see the module docstring).

    ``kernel`` runs the GEMMs with a rank-R output dim (the expand and the LoRA input
    gradient); the four that reduce a wide operand to rank R (shrink, g B, dA, dB) run the
    Triton kernels of triton_lora.py when ``rank_kernels == "triton"``, else ``kernel`` too. The base GEMM
    with the expand, and with the LoRA input gradient, runs where ``lora_gemm`` says (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, a_param, b_param, a_c, b_c, span, scale_col, kernel, rank_kernels="library",  # noqa: ANN001
                tp=None, lora_gemm="library"):
        a, b = a_c[span.lo : span.hi], b_c[span.lo : span.hi]
        if tp is not None and tp.mode == "row":
            y, h = _row_parallel_forward(x, weight, a, b, span, scale_col, kernel, rank_kernels, tp.group)
        else:
            h = _shrink_x(x, a, span, scale_col, kernel, rank_kernels)  # [T, R], scaled (whole: A is not split)
            # Today's path in place on the fresh delta: out-of-place addmm would first copy C into its result.
            y = lora_gemm_dispatch.base_plus_delta(
                lora_gemm, "nk", x, weight, h, b, functools.partial(span.gemm_plan, device=x.device),
                lambda: segment_mm(h, b, span.offsets, span.counts, kernel).addmm_(x, weight.t()))  # delta + x W^T
        ctx.save_for_backward(x, weight, h, a, b, scale_col)
        ctx.span, ctx.kernel, ctx.rank_kernels, ctx.tp, ctx.lora_gemm = span, kernel, rank_kernels, tp, lora_gemm
        ctx.a_param, ctx.b_param = a_param, b_param
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001
        x, weight, h, a, b, scale_col = ctx.saved_tensors
        span, kernel = ctx.span, ctx.kernel
        column_tp = ctx.tp.group if ctx.tp is not None and ctx.tp.mode == "column" else None
        gy = gy.contiguous()
        tiles = span.tiles(x.device) if ctx.rank_kernels == "triton" else None
        if tiles is not None:
            gh = triton_lora.shrink(gy, b, tiles, scale_col, wide_dim=1)  # d(x A^T) [T, R]
        else:
            gh = segment_mm_nt(gy, b, span.offsets, span.counts, kernel) * scale_col
        # Column-parallel: gh is this rank's partial sum over its output rows (module docstring).
        # Its all-reduce ([T, R]: small) runs on a copy while gx is computed from the partial
        # gh, and gx's all-reduce (Megatron's input-gradient one, the partial gh A included)
        # while the slot gradients are computed.
        gx = gh_whole = gh_pending = gx_pending = None
        if column_tp is not None:
            gh_whole = gh.clone()
            gh_pending = dist.all_reduce(gh_whole, group=column_tp, async_op=True)
        if ctx.needs_input_grad[0]:
            gx = lora_gemm_dispatch.base_plus_delta(
                ctx.lora_gemm, "kn", gy, weight, gh, a, functools.partial(span.gemm_plan, device=x.device),
                lambda: segment_mm_nt(gh, a, span.offsets, span.counts, kernel).addmm_(gy, weight))
            if column_tp is not None:
                gx_pending = dist.all_reduce(gx, group=column_tp, async_op=True)
        for param in (ctx.a_param, ctx.b_param):
            if param.grad is None:  # as autograd would; the trainer presets them (SlotBuffers)
                param.grad = torch.zeros_like(param)
        grad_a, grad_b = ctx.a_param.grad[span.lo : span.hi], ctx.b_param.grad[span.lo : span.hi]
        if tiles is not None:
            triton_lora.weight_grad_into(grad_b, gy, h, tiles, wide_dim=1)
        else:
            grad_b.add_(segment_weight_grad(gy, h, span.offsets, span.counts, kernel))
        if gh_pending is not None:
            gh_pending.wait()
            gh = gh_whole  # dA = gh^T x needs the whole gh
        if tiles is not None:
            triton_lora.weight_grad_into(grad_a, x, gh, tiles, wide_dim=2)
        else:
            grad_a.add_(segment_weight_grad(gh, x, span.offsets, span.counts, kernel))
        if gx_pending is not None:
            gx_pending.wait()
        return gx, None, None, None, None, None, None, None, None, None, None, None


def _shrink_x(x, a, span, scale_col, kernel, rank_kernels, out=None):  # noqa: ANN001
    """h = s * x A_g^T for every token [T, R] (into ``out`` when given)."""
    if rank_kernels == "triton":
        return triton_lora.shrink(x, a, span.tiles(x.device), scale_col, wide_dim=2, out=out)
    h = segment_mm(x, a, span.offsets, span.counts, kernel)
    return torch.mul(h, scale_col, out=out) if out is not None else h.mul_(scale_col)


def _row_parallel_forward(x, weight, a, b, span, scale_col, kernel, rank_kernels, group):  # noqa: ANN001
    """(y, h) of a row-parallel linear: one all-reduce over the partial [x W^T | s x A^T], then
    y = base + h B^T (the delta after the reduce: module docstring)."""
    t, out, r = x.shape[0], weight.shape[0], a.shape[1]
    flat = x.new_empty(t * (r + out))
    # Two non-view tensors over the one buffer (set_, not slicing): y is returned from this
    # autograd node, and a view made inside a custom Function may not be modified in place
    # by whatever consumes it.
    h_partial, y = _carve(flat, 0, (t, r)), _carve(flat, t * r, (t, out))
    _shrink_x(x, a, span, scale_col, kernel, rank_kernels, out=h_partial)
    torch.mm(x, weight.t(), out=y)
    dist.all_reduce(flat, group=group)
    # Its own copy ([T, R]: small) for backward, so the saved h does not keep the [T, out]
    # output's storage alive until this layer's backward.
    h = h_partial.clone()
    if len(span.counts) == 1:
        y.addmm_(h, b[0].t())
    else:
        y.add_(segment_mm(h, b, span.offsets, span.counts, kernel))
    return y, h


def _carve(flat: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    """A contiguous ``shape`` tensor on ``flat``'s storage from element ``offset`` (not a view)."""
    return flat.new_empty(0).set_(flat.untyped_storage(), flat.storage_offset() + offset, shape, (shape[1], 1))
