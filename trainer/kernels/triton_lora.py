"""The rank-R GEMMs of a LoRA step as segment-aware Triton kernels (the fused node's option).

A LoRA linear's step runs four GEMMs with a rank-R side (R = 8..64) against a wide
[T, K] operand: the shrink ``h = s * x A_g^T`` and ``gh = s * g B_g`` (reduce over the wide
dim), and the weight gradients ``dA_g = gh_g^T x_g`` and ``dB_g = g_g^T h_g`` (reduce over
the tokens of slot g). All four are memory-bound: their cost is one read of the wide
operand. Library kernels do not get there for these shapes (measured on the H200:
cuBLAS 2-2.5x the byte floor for one slot, ``grouped_mm`` over 64 slot segments another
1.5-2.3x on top, docs/benchmarks-history.md, "Third version"). These kernels are written for them:

* ``shrink``: one program per tile of BT rows inside one slot segment (a tile never
  crosses a segment, so it reads one slot's A or B); it streams the wide operand once
  and keeps the [BT, R] accumulator in registers; the per-token scale is applied to the
  fp32 accumulator before the single rounding to the output dtype.
* ``weight_grad_into``: one program per (chunk of at most CHUNK rows of one segment,
  block of BM wide columns); it streams that block once and adds its fp32 [BM, R]
  partial straight into the fp32 gradient buffer (no bf16 intermediate, no separate
  add). Where a segment spans several chunks the partials are added atomically, so
  float summation order can differ between runs for those slots; a segment of one
  chunk is added with a plain load-add-store.

Tile tables (slot, first row, end row) are built once per micro-batch from the host
token counts (``SlotTiles``, cached on the SlotSpan) and shared by every layer.

On the CPU the same kernels run through Triton's interpreter (tests set
``TRITON_INTERPRET=1``), so fp32 equivalence is proven against the library path there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from trainer.platform.cpu_compat import triton_available

SHRINK_ROWS = 64  # BT of the shrink kernel
SHRINK_COLS = 128  # BK: wide columns per inner step of the shrink kernel
WGRAD_CHUNK = 1024  # most rows one weight-gradient program reduces
WGRAD_ROWS = 64  # rows per inner step of the weight-gradient kernel
WGRAD_COLS = 64  # BM: wide columns per weight-gradient program


def available(x: torch.Tensor) -> bool:
    """Whether these kernels can run on ``x``'s device: CUDA with Triton, or the CPU when
    Triton's interpreter is switched on (tests)."""
    if not triton_available():
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def pick(requested: str, x: torch.Tensor, segments: int) -> str:
    """``triton`` or ``library`` for the fused node's rank-R reductions on ``x`` over
    ``segments`` non-empty slot segments. ``auto`` takes Triton on CUDA when there is more
    than one segment: measured on the H200 (docs/benchmarks-history.md, "Fourth version"), the Triton weight
    gradients beat ``grouped_mm`` over 64 segments (mixed step at N = 64: 347 against
    361 ms), while for one segment cuBLAS's plain GEMMs are as fast or faster (N = 1: 361
    against 362 ms; the LoRA part of one linear 0.36-0.79 ms with Triton against 0.31-0.60
    ms). The CPU interpreter is for proofs only, far too slow to train with, so ``auto``
    never picks it. An explicit ``triton`` where it cannot run is refused."""
    if requested == "library":
        return "library"
    if requested == "triton":
        if not available(x):
            raise ValueError(f"lora_rank_kernels 'triton' cannot run on {x.device} (needs CUDA and triton, or "
                             "TRITON_INTERPRET=1 on the CPU); use 'auto' or 'library'")
        return "triton"
    if requested != "auto":
        raise ValueError(f"lora_rank_kernels must be 'auto', 'triton' or 'library', got {requested!r}")
    return "triton" if x.is_cuda and segments > 1 and triton_available() else "library"


@dataclass(frozen=True)
class SlotTiles:
    """Row tiles of one micro-batch's slot segments, as int32 [n, 3] device tables of
    (segment index within the span, first row, end row); no tile crosses a segment."""

    shrink: torch.Tensor
    wgrad: torch.Tensor
    wgrad_split: bool  # some segment spans several weight-gradient chunks: add atomically

    @staticmethod
    def of(counts: list[int], device: torch.device) -> "SlotTiles":
        def table(step: int) -> list[tuple[int, int, int]]:
            rows, start = [], 0
            for g, n in enumerate(counts):
                rows.extend((g, s, min(s + step, start + n)) for s in range(start, start + n, step))
                start += n
            return rows

        shrink, wgrad = table(SHRINK_ROWS), table(WGRAD_CHUNK)
        split = any(n > WGRAD_CHUNK for n in counts)
        as_tensor = lambda rows: torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return SlotTiles(as_tensor(shrink), as_tensor(wgrad), split)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def shrink_kernel(x_ptr, w_ptr, s_ptr, out_ptr, tiles_ptr, K, R,
                      sx_t, sx_k, sw_g, sw_r, sw_k, so_t, so_r,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                      HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        tile = tl.program_id(0)
        g = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        r0 = tl.load(tiles_ptr + tile * 3 + 1)
        r1 = tl.load(tiles_ptr + tile * 3 + 2)
        rows = (r0 + tl.arange(0, BT)).to(tl.int64)
        row_ok = rows < r1
        rr = tl.arange(0, BR)
        rank_ok = rr < R
        acc = tl.zeros((BT, BR), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < K
            xt = tl.load(x_ptr + rows[:, None] * sx_t + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + g * sw_g + ks[:, None] * sw_k + rr[None, :] * sw_r,
                         mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
            acc += tl.dot(xt, wt, input_precision=PREC)
        if HAS_SCALE:
            acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * so_t + rr[None, :] * so_r, acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])

    @triton.jit
    def wgrad_kernel(p_ptr, q_ptr, out_ptr, tiles_ptr, M, R,
                     sp_t, sp_m, sq_t, sq_r, so_g, so_m, so_r,
                     BT: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
                     ATOMIC: tl.constexpr, PREC: tl.constexpr):
        tile = tl.program_id(0)
        g = tl.load(tiles_ptr + tile * 3).to(tl.int64)
        r0 = tl.load(tiles_ptr + tile * 3 + 1)
        r1 = tl.load(tiles_ptr + tile * 3 + 2)
        ms = tl.program_id(1) * BM + tl.arange(0, BM)
        m_ok = ms < M
        rr = tl.arange(0, BR)
        rank_ok = rr < R
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for t0 in range(r0, r1, BT):
            ts = (t0 + tl.arange(0, BT)).to(tl.int64)
            t_ok = ts < r1
            pt = tl.load(p_ptr + ts[:, None] * sp_t + ms[None, :] * sp_m, mask=t_ok[:, None] & m_ok[None, :], other=0.0)
            qt = tl.load(q_ptr + ts[:, None] * sq_t + rr[None, :] * sq_r, mask=t_ok[:, None] & rank_ok[None, :], other=0.0)
            acc += tl.dot(tl.trans(pt), qt, input_precision=PREC)
        ptrs = out_ptr + g * so_g + ms[:, None] * so_m + rr[None, :] * so_r
        ok = m_ok[:, None] & rank_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, acc, mask=ok)
        else:
            tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + acc, mask=ok)

    return shrink_kernel, wgrad_kernel


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _rank_block(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # tl.dot needs each dim >= 16


def shrink(x: torch.Tensor, w: torch.Tensor, tiles: SlotTiles, scale: torch.Tensor | None,
           *, wide_dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = scale[t] * (x[t] @ w_g) over the wide dim, for t in segment g: x [T, K].

    ``w`` is the span's stacked slot weights, [G, R, K] (``wide_dim=2``: LoRA A, giving
    x A_g^T) or [G, K, R] (``wide_dim=1``: LoRA B, giving g B_g). ``scale`` is a [T] or
    [T, 1] per-token factor or None. Returns [T, R] in x's dtype (written into ``out`` when
    given: [T, R], x's dtype, any strides)."""
    shrink_kernel, _ = _kernels()
    rank_dim = 3 - wide_dim
    t, k, r = x.shape[0], x.shape[1], w.shape[rank_dim]
    if w.shape[wide_dim] != k:
        raise ValueError(f"shrink: x has {k} columns but the slot weights' wide dim is {w.shape[wide_dim]}")
    if out is None:
        out = torch.empty(t, r, dtype=x.dtype, device=x.device)
    elif out.shape != (t, r) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"shrink: out must be [{t}, {r}] {x.dtype} on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    n = tiles.shrink.shape[0]
    if n:
        s = scale.reshape(-1) if scale is not None else x  # any pointer when unused
        shrink_kernel[(n,)](x, w, s, out, tiles.shrink, k, r,
                            x.stride(0), x.stride(1), w.stride(0), w.stride(rank_dim), w.stride(wide_dim),
                            out.stride(0), out.stride(1),
                            BT=SHRINK_ROWS, BK=SHRINK_COLS, BR=_rank_block(r),
                            HAS_SCALE=scale is not None, PREC=_prec(x.dtype))
    return out


def weight_grad_into(grad: torch.Tensor, wide: torch.Tensor, rank_side: torch.Tensor, tiles: SlotTiles,
                     *, wide_dim: int) -> None:
    """grad[g] += wide_g^T rank_side_g (laid out as ``grad``) for every segment g, in place.

    ``grad`` is the span's fp32 gradient rows, [G, R, M] (``wide_dim=2``: LoRA A, from
    gh and x) or [G, M, R] (``wide_dim=1``: LoRA B, from g and h); ``wide`` [T, M],
    ``rank_side`` [T, R]."""
    _, wgrad_kernel = _kernels()
    rank_dim = 3 - wide_dim
    m, r = wide.shape[1], rank_side.shape[1]
    if grad.dtype != torch.float32 or grad.shape[wide_dim] != m or grad.shape[rank_dim] != r:
        raise ValueError(f"weight_grad_into: fp32 grad of wide dim {m} and rank {r} expected, got "
                         f"{tuple(grad.shape)} {grad.dtype}")
    n = tiles.wgrad.shape[0]
    if n:
        import triton

        grid = (n, triton.cdiv(m, WGRAD_COLS))
        wgrad_kernel[grid](wide, rank_side, grad, tiles.wgrad, m, r,
                           wide.stride(0), wide.stride(1), rank_side.stride(0), rank_side.stride(1),
                           grad.stride(0), grad.stride(wide_dim), grad.stride(rank_dim),
                           BT=WGRAD_ROWS, BM=WGRAD_COLS, BR=_rank_block(r),
                           ATOMIC=tiles.wgrad_split, PREC=_prec(wide.dtype))
    torch.autograd.graph.increment_version(grad)
