"""AdamW over whole slot rows in one Triton kernel (CUDA), same math as ``adamw_apply``.

The torch version in per_slot_optim.py runs about a dozen elementwise ops over the
stepping slots' rows; each reads and writes whole fp32 rows, about 100 bytes of
memory traffic per LoRA parameter (64 slots of rank 16 on a 1.7B model: 940 M
parameters, 33 ms on an H200). This kernel reads weight, gradient and both moments
once and writes weight and moments once, and zeroes the gradient on the way (the
step consumes it): 32 bytes per parameter.

Each program updates one block of columns of one stepping slot's row; the slot ids
come in a device tensor, so any set of slots (contiguous or not) is updated in
place without gathering rows. Per-slot factors (grad scale, decay, betas, bias
corrections, eps, step size) are one row of an fp32 [D, 8] table. The blocks come
from a table too (``BlockTable``: first column and width of each): the whole row, or
only the columns of some layers (trainer/optim/step_overlap.py updates the rows layer by
layer, so the next forward can start on the first layers before the last are done).

Slots with a compact state (``SlotHyperParams.state_dtype`` bfloat16, trainer/optim/compact_state.py)
take the same kernel with ``COMPACT`` set (``adamw_rows_compact``): their moments are loaded from
bf16 and converted to fp32, the same fp32 math runs, and the new moments are stored back in bf16
with stochastic rounding (noise from a per-slot int32 key and the column, as compact_state.py
defines it): 24 bytes per parameter instead of 32. With ``COMPACT`` off the kernel is the fp32
one, op for op (a constexpr branch: the compact code is not compiled in).

Used only where Triton runs on the tensors' device (``available``); elsewhere, and
for the bit-exact CPU reference, ``adamw_apply`` keeps its torch ops.
"""

from __future__ import annotations

import functools

import torch

from trainer.platform.cpu_compat import triton_available

# Column order of the per-slot factor table.
GRAD_SCALE, DECAY, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, BC2_SQRT, EPS, NEG_STEP_SIZE = range(8)
BLOCK = 2048


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_blocks(p_ptr, g_ptr, m_ptr, v_ptr, slots_ptr, coef_ptr, keys_ptr, starts_ptr, widths_ptr, row_stride,
                     state_stride, BLOCK: tl.constexpr, COMPACT: tl.constexpr):
        blk = tl.program_id(0)
        d = tl.program_id(1)
        row = tl.load(slots_ptr + d).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        cols = tl.load(starts_ptr + blk) + lanes
        mask = lanes < tl.load(widths_ptr + blk)
        off = row * row_stride + cols
        soff = row * state_stride + cols  # the moments' offset (COMPACT: rows of m and v are 2P bf16 apart)
        c = coef_ptr + d * 8
        grad_scale = tl.load(c + 0)
        decay = tl.load(c + 1)
        one_minus_beta1 = tl.load(c + 2)
        beta2 = tl.load(c + 3)
        one_minus_beta2 = tl.load(c + 4)
        bc2_sqrt = tl.load(c + 5)
        eps = tl.load(c + 6)
        neg_step_size = tl.load(c + 7)
        g = tl.load(g_ptr + off, mask=mask, other=0.0) * grad_scale
        p = tl.load(p_ptr + off, mask=mask, other=0.0) * decay
        m = tl.load(m_ptr + soff, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + soff, mask=mask, other=0.0).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)  # torch.lerp for weights < 0.5
        v = v * beta2 + (g * one_minus_beta2) * g
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p + (m / denom) * neg_step_size
        tl.store(p_ptr + off, p, mask=mask)
        if COMPACT:  # stochastic rounding to bf16 (compact_state.py): h = mix32(key ^ column)
            h = tl.load(keys_ptr + d).to(tl.uint32, bitcast=True) ^ cols.to(tl.uint32)
            h = h ^ (h >> 16)
            h = h * 0x21F0AAAD
            h = h ^ (h >> 15)
            h = h * 0x735A2D97
            h = h ^ (h >> 15)
            m_bits = (m.to(tl.uint32, bitcast=True) + (h >> 16)) & 0xFFFF0000
            v_bits = (v.to(tl.uint32, bitcast=True) + (h & 0xFFFF)) & 0xFFFF0000
            tl.store(m_ptr + soff, m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
            tl.store(v_ptr + soff, v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
        else:
            tl.store(m_ptr + soff, m, mask=mask)
            tl.store(v_ptr + soff, v, mask=mask)
        tl.store(g_ptr + off, tl.zeros_like(g), mask=mask)

    return adamw_blocks


class BlockTable:
    """The column blocks a launch updates in every stepping row: ``starts`` (int64) and ``widths``
    (int32, at most BLOCK) on the device, one entry per block, covering ``ranges`` (half-open
    column ranges, disjoint) exactly once."""

    def __init__(self, ranges: list[tuple[int, int]], device: torch.device) -> None:
        starts, widths = [], []
        for lo, hi in ranges:
            if not 0 <= lo < hi:
                raise ValueError(f"column range [{lo}, {hi}) is empty or negative")
            for c in range(lo, hi, BLOCK):
                starts.append(c)
                widths.append(min(BLOCK, hi - c))
        self.ranges = list(ranges)
        self.end = max((hi for _, hi in ranges), default=0)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.widths = torch.tensor(widths, dtype=torch.int32, device=device)

    def __len__(self) -> int:
        return self.starts.numel()


@functools.cache
def whole_rows(ncols: int, device: torch.device) -> BlockTable:
    return BlockTable([(0, ncols)], device)


def available(t: torch.Tensor) -> bool:
    """Whether the fused kernel can update ``t`` (fp32, CUDA, rows of unit column stride)."""
    return t.is_cuda and t.dtype == torch.float32 and t.stride(-1) == 1 and triton_available()


@torch.no_grad()
def adamw_rows(
    weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    slots: list[int] | torch.Tensor, coef: torch.Tensor, blocks: BlockTable | None = None,
) -> None:
    """Update rows ``slots`` of the [N, P] slot buffers in place; ``coef`` fp32 [D, 8] on the
    device (columns as the constants above). The slots' gradient rows are left zero. ``blocks``:
    only those columns (default the whole row). ``slots`` may be an int32 tensor already on the
    device: several launches of one step then copy nothing from the host (a pageable copy makes
    the host wait for the stream)."""
    bufs = (weight, grad, exp_avg, exp_avg_sq)
    if any(b.shape != weight.shape or b.stride() != weight.stride() for b in bufs):
        raise ValueError("slot buffers must share one [N, P] shape and layout")
    _launch(weight, grad, exp_avg, exp_avg_sq, weight.stride(0), slots, coef, None, blocks)


@torch.no_grad()
def adamw_rows_compact(
    weight: torch.Tensor, grad: torch.Tensor, moments: torch.Tensor, slots: list[int] | torch.Tensor,
    coef: torch.Tensor, keys: torch.Tensor, blocks: BlockTable | None = None,
) -> None:
    """``adamw_rows`` for slots with bf16 moments: ``moments`` bf16 [N, 2P], a slot's exp_avg in
    ``[:, :P]`` and exp_avg_sq in ``[:, P:]`` (SlotBuffers.compact_moments); ``keys`` int32 [D] on
    the device, each slot's rounding key (compact_state.noise_key, as int32)."""
    n, width = weight.shape
    if grad.shape != weight.shape or grad.stride() != weight.stride():
        raise ValueError("slot buffers must share one [N, P] shape and layout")
    if moments.dtype != torch.bfloat16 or moments.shape != (n, 2 * width) or moments.stride(-1) != 1:
        raise ValueError(f"moments must be bf16 [{n}, {2 * width}] with unit column stride, got "
                         f"{tuple(moments.shape)} {moments.dtype}")
    if keys.dtype != torch.int32 or keys.shape != (len(slots),) or keys.device != weight.device:
        raise ValueError(f"keys must be int32 [{len(slots)}] on {weight.device}, got {tuple(keys.shape)} {keys.dtype} "
                         f"on {keys.device}")
    _launch(weight, grad, moments[:, :width], moments[:, width:], moments.stride(0), slots, coef, keys, blocks)


def _launch(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, state_stride: int,
            slots: list[int] | torch.Tensor, coef: torch.Tensor, keys: torch.Tensor | None,
            blocks: BlockTable | None) -> None:
    """Check the slots, factors and blocks, and launch one program per (block, slot); ``keys``
    None: fp32 moments, else the compact kernel."""
    if coef.shape != (len(slots), 8) or coef.dtype != torch.float32:
        raise ValueError(f"coef must be fp32 [{len(slots)}, 8], got {tuple(coef.shape)} {coef.dtype}")
    if not len(slots):
        return
    blocks = blocks if blocks is not None else whole_rows(weight.shape[1], weight.device)
    if blocks.end > weight.shape[1]:
        raise ValueError(f"blocks reach column {blocks.end}; rows have {weight.shape[1]}")
    if not len(blocks):
        return
    ids = slots if isinstance(slots, torch.Tensor) else torch.tensor(slots, dtype=torch.int32, device=weight.device)
    if ids.dtype != torch.int32 or ids.device != weight.device:
        raise ValueError(f"slot ids must be int32 on {weight.device}, got {ids.dtype} on {ids.device}")
    grid = (len(blocks), len(slots))
    _kernel()[grid](weight, grad, m, v, ids, coef.contiguous(), ids if keys is None else keys, blocks.starts,
                    blocks.widths, weight.stride(0), state_stride, BLOCK=BLOCK, COMPACT=keys is not None)
    for b in (weight, grad, m, v):  # written through pointers: tell version-counter caches (fused_lora.ComputeWeights)
        torch.autograd.graph.increment_version(b)
