"""A LoRA-wrapped linear's base GEMM and slot deltas as one autograd node.

    y[t] = x[t] @ W.T + scale(t) * B[g(t)] @ A[g(t)] @ x[t]        (g(t) = slot of token t)

The general path (multi_lora.py) runs the base linear, then the delta as two
segmented GEMMs, then adds them, each its own autograd node. For a frozen base
with tensor parallel 1 and packed tokens (the trainer's default), this node does
the same math with fewer passes over memory, which is what a LoRA step costs on
top of the frozen base (the rank-R GEMMs themselves are memory-bound):

* the delta is the C operand of the base GEMM (``addmm_`` in place, beta = 1), so no
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

Same result as the general path up to float rounding (tests/unit/test_fused_lora.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from trainer import triton_lora
from trainer.segmented_mm import Kernel, segment_mm, segment_mm_nt, segment_weight_grad


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

    @staticmethod
    def of(offsets: torch.Tensor, counts: list[int]) -> "SlotSpan":
        present = [g for g, n in enumerate(counts) if n]
        if not present:
            raise ValueError("a routed micro-batch has no tokens")
        lo, hi = present[0], present[-1] + 1
        return SlotSpan(lo, hi, offsets[lo:hi], counts[lo:hi])


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
    Triton kernels of triton_lora.py when ``rank_kernels == "triton"``, else ``kernel`` too."""

    @staticmethod
    def forward(ctx, x, weight, a_param, b_param, a_c, b_c, span, scale_col, kernel, rank_kernels="library"):  # noqa: ANN001
        a, b = a_c[span.lo : span.hi], b_c[span.lo : span.hi]
        if rank_kernels == "triton":
            h = triton_lora.shrink(x, a, span.tiles(x.device), scale_col, wide_dim=2)  # [T, R], scaled
        else:
            h = segment_mm(x, a, span.offsets, span.counts, kernel) * scale_col
        # In place on the fresh delta: out-of-place addmm would first copy C into its result.
        y = segment_mm(h, b, span.offsets, span.counts, kernel).addmm_(x, weight.t())  # delta + x W^T
        ctx.save_for_backward(x, weight, h, a, b, scale_col)
        ctx.span, ctx.kernel, ctx.rank_kernels = span, kernel, rank_kernels
        ctx.a_param, ctx.b_param = a_param, b_param
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001
        x, weight, h, a, b, scale_col = ctx.saved_tensors
        span, kernel = ctx.span, ctx.kernel
        gy = gy.contiguous()
        tiles = span.tiles(x.device) if ctx.rank_kernels == "triton" else None
        if tiles is not None:
            gh = triton_lora.shrink(gy, b, tiles, scale_col, wide_dim=1)  # d(x A^T) [T, R]
        else:
            gh = segment_mm_nt(gy, b, span.offsets, span.counts, kernel) * scale_col
        gx = None
        if ctx.needs_input_grad[0]:
            gx = segment_mm_nt(gh, a, span.offsets, span.counts, kernel).addmm_(gy, weight)
        for param in (ctx.a_param, ctx.b_param):
            if param.grad is None:  # as autograd would; the trainer presets them (SlotBuffers)
                param.grad = torch.zeros_like(param)
        grad_a, grad_b = ctx.a_param.grad[span.lo : span.hi], ctx.b_param.grad[span.lo : span.hi]
        if tiles is not None:
            triton_lora.weight_grad_into(grad_b, gy, h, tiles, wide_dim=1)
            triton_lora.weight_grad_into(grad_a, x, gh, tiles, wide_dim=2)
        else:
            grad_b.add_(segment_weight_grad(gy, h, span.offsets, span.counts, kernel))
            grad_a.add_(segment_weight_grad(gh, x, span.offsets, span.counts, kernel))
        return gx, None, None, None, None, None, None, None, None, None
