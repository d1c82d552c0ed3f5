"""Expert LoRA's rank-R GEMMs as segmented Triton kernels over (expert, slot) groups.

The routed (token, expert) pairs of an MoE layer are sorted once by group
``g = e * S + s`` (expert e, slot s of the span's S slots; moe_lora.py), so every group
is one contiguous row segment (empty ones allowed). Expert LoRA then needs, per group,

    shrink   out[t] = scale[t] * sum_k x[t, k] W_g[k, r]       (h = s x A^T, gh = s g B)
    expand   y[t]  (+)= sum_r h[t, r] W_g[r, n]               (y += h B^T, gx += gh A)
    wgrad    G_g[m, r] += sum_{t in g} wide[t, m] side[t, r]  (dA += gh^T x, dB += g^T h)

as in Punica's SGMV and S-LoRA's segmented kernels (written here from their idea, not
their code): one launch covers every group, whatever their number (no grouped_mm
group-count limit), and a tile never crosses a group, so it reads one group's weights.

* Weights are read in place from the slot-major fp32 parameters (``lora_A [N, E, R, in]``,
  ``lora_B [N, E, out, R]``) through (slot, expert) strides: group g is slot ``lo + g % S``,
  expert ``g // S``. They are cast to the compute dtype in registers, which rounds them as
  a cast copy would, so no expert-major copy is made or read (at 32 slots of rank 16 on
  the Qwen3-30B-A3B shape a copy is 0.8 GiB per layer written and read again).
* ``shrink`` and ``expand`` run one program per row tile (``GroupTiles``: BT rows of one
  group); the per-row scale is applied to the fp32 accumulator before the one rounding.
  ``expand`` adds into ``y`` in place when asked (the fused node adds the delta straight
  into the expert GEMM's output: one read-modify-write instead of a separate delta tensor
  and a sum).
* ``weight_grad_into`` runs one program per (group, block of BM wide columns) over all the
  group's rows and adds its fp32 [BM, R] block into the fp32 gradient with a plain
  load-add-store: every gradient element has one writer, so no atomics, and the
  summation order is fixed (run to run bit-identical).

The tile table is built on the device from the group counts (a few tensor ops, no host
sync, no Python loop over thousands of groups): an upper bound of ``cdiv(M, BT) + G``
tiles is launched (each group has at most one partial tile), and the tiles past the
real ones are empty (``r0 == r1``) and do no loads.

On the CPU the kernels run in Triton's interpreter (tests set ``TRITON_INTERPRET=1``),
so fp32 equality with the grouped_mm path is proven there (tests/unit/test_triton_expert_lora.py).
Whether they run is ``triton_lora.pick(lora_rank_kernels, x, groups)`` (moe_lora.py): with E
experts every MoE micro-batch has E or more groups, so ``auto`` takes them on CUDA, never
the interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

TILE_ROWS = 64  # BT of the shrink and the expand: rows of one group per program
SHRINK_COLS = 128  # BK: wide columns per inner step of the shrink
EXPAND_COLS = 128  # BN: output columns per inner step of the expand
WGRAD_ROWS = 32  # rows per inner step of the weight gradient (32, not 64: at 32 slots a group holds
# about 32 rows, and 64-row steps loaded half masked; H200, benchmarks/bench_expert_kernels.py: the four
# weight gradients of a layer 1.70 -> 1.42 ms at N = 32, 0.52 -> 0.51 at N = 1, equal at N = 8)
WGRAD_COLS = 64  # BM: wide columns per weight-gradient program
# Launch options per kernel (num_warps, num_stages); empty: Triton's defaults. Read at each launch,
# so benchmarks/bench_expert_kernels.py can sweep them (with the block sizes above).
LAUNCH: dict[str, dict[str, int]] = {"shrink": {}, "expand": {}, "wgrad": {}}


@dataclass(frozen=True)
class GroupTiles:
    """The row segments of G groups (``groups_per_expert`` = S slots each expert) of ``rows``
    sorted rows, as device tables: ``tiles`` int32 [n, 3] of (group, first row, end row),
    no tile crossing a group, empty padding tiles at the end; ``ends`` int32 [G + 1], the
    groups' row bounds (group g is rows ends[g] .. ends[g + 1] - 1)."""

    tiles: torch.Tensor
    ends: torch.Tensor
    rows: int
    groups: int
    groups_per_expert: int
    tile_rows: int

    @staticmethod
    def of(counts: torch.Tensor, rows: int, groups_per_expert: int, tile_rows: int | None = None) -> "GroupTiles":
        """``counts``: int [G] rows per group on the rows' device (summing to ``rows``)."""
        groups = counts.numel()
        if groups == 0 or groups % groups_per_expert:
            raise ValueError(f"{groups} groups cannot be split into experts of {groups_per_expert} slots")
        # One tile size for all: a group no longer than a tile reads its weights once per kernel
        # (at 32 slots x 128 experts a group holds about 32 rows; at 1 slot about 1000).
        bt = tile_rows or TILE_ROWS
        counts = counts.to(torch.int64)
        per = (counts + bt - 1) // bt  # tiles of each group
        tile_end = per.cumsum(0)
        row_end = counts.cumsum(0)
        n = -(-rows // bt) + groups  # >= sum(ceil(c / bt)): at most one partial tile per group
        i = torch.arange(n, device=counts.device)
        g = torch.searchsorted(tile_end, i, right=True)  # the group whose tiles hold tile i (G: past the end)
        real = g < groups
        g.clamp_(max=groups - 1)
        r0 = row_end[g] - counts[g] + (i - (tile_end[g] - per[g])) * bt
        r1 = torch.minimum(r0 + bt, row_end[g])
        r0, r1 = torch.where(real, r0, 0), torch.where(real, r1, 0)
        ends = torch.cat([row_end.new_zeros(1), row_end])
        return GroupTiles(torch.stack([g, r0, r1], 1).to(torch.int32), ends.to(torch.int32), rows, groups,
                          groups_per_expert, bt)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Index vectors are int64 (no int32 overflow in the address arithmetic of large operands,
    # and no per-op overflow checks in the interpreter); pointers advance by increments.

    @triton.jit
    def tile_rows(tiles_ptr, R, BT: tl.constexpr, BR: tl.constexpr):
        """This program's tile: rows r0 .. r1 - 1 of group g (slot g % S, expert g // S), as
        (g, r0, r1, row indices [BT], their mask, rank indices [BR], their mask)."""
        t = tl.program_id(0)
        g = tl.load(tiles_ptr + t * 3).to(tl.int64)
        r0 = tl.load(tiles_ptr + t * 3 + 1)
        r1 = tl.load(tiles_ptr + t * 3 + 2)
        rows = r0 + tl.arange(0, BT).to(tl.int64)
        rr = tl.arange(0, BR).to(tl.int64)
        return g, r0, r1, rows, rows < r1, rr, rr < R

    # A jit function calls another through its module's globals (the kernels are made here,
    # lazily, so that importing this module needs no triton).
    global _tile_rows
    _tile_rows = tile_rows

    @triton.jit
    def shrink_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, tiles_ptr, K, R, S,
                      sx_t, sx_k, sw_s, sw_e, sw_k, sw_r, so_t, so_r,
                      BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, HAS_SCALE: tl.constexpr,
                      PREC: tl.constexpr):
        g, r0, r1, rows, row_ok, rr, rank_ok = _tile_rows(tiles_ptr, R, BT, BR)
        ks = tl.arange(0, BK).to(tl.int64)
        x_ptrs = x_ptr + rows[:, None] * sx_t + ks[None, :] * sx_k
        w_ptrs = w_ptr + (g % S) * sw_s + (g // S) * sw_e + ks[:, None] * sw_k + rr[None, :] * sw_r
        acc = tl.zeros((BT, BR), dtype=tl.float32)
        k_end = tl.where(r1 > r0, K, 0)  # an empty padding tile loops zero times
        for k0 in range(0, k_end, BK):
            k_ok = ks < K - k0
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & rank_ok[None, :], other=0.0).to(x_ptr.dtype.element_ty)
            acc += tl.dot(xt, wt, input_precision=PREC)
            x_ptrs += BK * sx_k
            w_ptrs += BK * sw_k
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * so_t + rr[None, :] * so_r, acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & rank_ok[None, :])

    @triton.jit
    def expand_kernel(h_ptr, w_ptr, y_ptr, tiles_ptr, NC, R, S,
                      sh_t, sh_r, sw_s, sw_e, sw_r, sw_n, sy_t, sy_n,
                      BT: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, ACCUMULATE: tl.constexpr,
                      PREC: tl.constexpr):
        g, r0, r1, rows, row_ok, rr, rank_ok = _tile_rows(tiles_ptr, R, BT, BR)
        ns = tl.arange(0, BN).to(tl.int64)
        ht = tl.load(h_ptr + rows[:, None] * sh_t + rr[None, :] * sh_r, mask=row_ok[:, None] & rank_ok[None, :],
                     other=0.0)
        w_ptrs = w_ptr + (g % S) * sw_s + (g // S) * sw_e + rr[:, None] * sw_r + ns[None, :] * sw_n
        y_ptrs = y_ptr + rows[:, None] * sy_t + ns[None, :] * sy_n
        n_end = tl.where(r1 > r0, NC, 0)
        for n0 in range(0, n_end, BN):
            n_ok = ns < NC - n0
            wt = tl.load(w_ptrs, mask=rank_ok[:, None] & n_ok[None, :], other=0.0).to(h_ptr.dtype.element_ty)
            acc = tl.dot(ht, wt, input_precision=PREC)
            ok = row_ok[:, None] & n_ok[None, :]
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
            w_ptrs += BN * sw_n
            y_ptrs += BN * sy_n

    @triton.jit
    def wgrad_kernel(p_ptr, q_ptr, g_ptr, ends_ptr, M, R, S,
                     sp_t, sp_m, sq_t, sq_r, sg_s, sg_e, sg_m, sg_r,
                     BT: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        grp = tl.program_id(0).to(tl.int64)
        r0 = tl.load(ends_ptr + grp)
        r1 = tl.load(ends_ptr + grp + 1)
        ms = tl.program_id(1) * BM + tl.arange(0, BM).to(tl.int64)
        m_ok = ms < M
        rr = tl.arange(0, BR).to(tl.int64)
        rank_ok = rr < R
        ts = tl.arange(0, BT).to(tl.int64)
        p_ptrs = p_ptr + (r0 + ts[:, None]) * sp_t + ms[None, :] * sp_m
        q_ptrs = q_ptr + (r0 + ts[:, None]) * sq_t + rr[None, :] * sq_r
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for t0 in range(r0, r1, BT):
            t_ok = ts < r1 - t0
            pt = tl.load(p_ptrs, mask=t_ok[:, None] & m_ok[None, :], other=0.0)
            qt = tl.load(q_ptrs, mask=t_ok[:, None] & rank_ok[None, :], other=0.0)
            acc += tl.dot(tl.trans(pt), qt, input_precision=PREC)
            p_ptrs += BT * sp_t
            q_ptrs += BT * sq_t
        ptrs = g_ptr + (grp % S) * sg_s + (grp // S) * sg_e + ms[:, None] * sg_m + rr[None, :] * sg_r
        ok = m_ok[:, None] & rank_ok[None, :] & (r1 > r0)  # an empty group's gradient is not touched
        tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + acc, mask=ok)

    return shrink_kernel, expand_kernel, wgrad_kernel


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _rank_block(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # tl.dot needs each dim >= 16


def _check_weights(name: str, w: torch.Tensor, tiles: GroupTiles) -> None:
    if w.dim() != 4 or w.shape[0] * w.shape[1] != tiles.groups or w.shape[0] != tiles.groups_per_expert:
        raise ValueError(f"{name}: weights must be [S={tiles.groups_per_expert}, E, ., .] with S * E = "
                         f"{tiles.groups} groups, got {tuple(w.shape)}")


def shrink(x: torch.Tensor, w: torch.Tensor, tiles: GroupTiles, scale: torch.Tensor | None, *, wide_dim: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = scale[t] * (x[t] @ w_g) over the wide dim, t in group g: x [M, K] -> [M, R].

    ``w`` is the span's slot-major weights [S, E, R, K] (``wide_dim=3``: LoRA A, giving
    x A_g^T) or [S, E, K, R] (``wide_dim=2``: LoRA B, giving g B_g), any strides and float
    dtype (cast to x's in registers). ``scale``: a [M] (or [M, 1]) per-row factor or None.
    Result in x's dtype (into ``out`` when given)."""
    shrink_kernel, _, _ = _kernels()
    _check_weights("shrink", w, tiles)
    rank_dim = 5 - wide_dim
    m, k, r = x.shape[0], x.shape[1], w.shape[rank_dim]
    if w.shape[wide_dim] != k or m != tiles.rows:
        raise ValueError(f"shrink: x [{m}, {k}] against weights {tuple(w.shape)} (wide dim {wide_dim}) over "
                         f"{tiles.rows} rows")
    if out is None:
        out = torch.empty(m, r, dtype=x.dtype, device=x.device)
    n = tiles.tiles.shape[0]
    s = scale.reshape(-1) if scale is not None else x  # any pointer when unused
    shrink_kernel[(n,)](x, w, s, out, tiles.tiles, k, r, tiles.groups_per_expert,
                        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(wide_dim), w.stride(rank_dim),
                        out.stride(0), out.stride(1),
                        BT=tiles.tile_rows, BK=SHRINK_COLS, BR=_rank_block(r), HAS_SCALE=scale is not None,
                        PREC=_prec(x.dtype), **LAUNCH["shrink"])
    return out


def expand_into(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor, tiles: GroupTiles, *, rank_dim: int,
                accumulate: bool = True) -> torch.Tensor:
    """y[t] (+)= h[t] @ w_g over the rank, t in group g, in place: h [M, R], y [M, NC].

    ``w`` is [S, E, NC, R] (``rank_dim=3``: LoRA B, giving h B_g^T) or [S, E, R, NC]
    (``rank_dim=2``: LoRA A, giving gh A_g). ``accumulate=False`` overwrites ``y`` (every
    row is some group's). Returns ``y``."""
    _, expand_kernel, _ = _kernels()
    _check_weights("expand_into", w, tiles)
    out_dim = 5 - rank_dim
    m, r, nc = h.shape[0], h.shape[1], w.shape[out_dim]
    if w.shape[rank_dim] != r or y.shape != (m, nc) or m != tiles.rows:
        raise ValueError(f"expand_into: h [{m}, {r}] into y {tuple(y.shape)} against weights {tuple(w.shape)} "
                         f"(rank dim {rank_dim}) over {tiles.rows} rows")
    n = tiles.tiles.shape[0]
    expand_kernel[(n,)](h, w, y, tiles.tiles, nc, r, tiles.groups_per_expert,
                        h.stride(0), h.stride(1), w.stride(0), w.stride(1), w.stride(rank_dim), w.stride(out_dim),
                        y.stride(0), y.stride(1),
                        BT=tiles.tile_rows, BN=EXPAND_COLS, BR=_rank_block(r), ACCUMULATE=accumulate,
                        PREC=_prec(h.dtype), **LAUNCH["expand"])
    torch.autograd.graph.increment_version(y)  # written through a pointer
    return y


def weight_grad_into(grad: torch.Tensor, wide: torch.Tensor, side: torch.Tensor, tiles: GroupTiles, *,
                     wide_dim: int) -> None:
    """grad_g += wide_g^T side_g (laid out as ``grad``) for every group g, in place.

    ``grad`` is the span's slot-major fp32 gradient, [S, E, R, M] (``wide_dim=3``: LoRA A,
    from gh and x) or [S, E, M, R] (``wide_dim=2``: LoRA B, from g and h); ``wide`` [rows, M],
    ``side`` [rows, R]. Empty groups are not touched."""
    import triton

    _, _, wgrad_kernel = _kernels()
    _check_weights("weight_grad_into", grad, tiles)
    rank_dim = 5 - wide_dim
    m, r = wide.shape[1], side.shape[1]
    if grad.dtype != torch.float32 or grad.shape[wide_dim] != m or grad.shape[rank_dim] != r:
        raise ValueError(f"weight_grad_into: fp32 grad of wide dim {m} and rank {r} expected, got "
                         f"{tuple(grad.shape)} {grad.dtype}")
    if wide.shape[0] != tiles.rows or side.shape[0] != tiles.rows:
        raise ValueError(f"weight_grad_into: {wide.shape[0]} / {side.shape[0]} rows, tiles cover {tiles.rows}")
    grid = (tiles.groups, triton.cdiv(m, WGRAD_COLS))
    wgrad_kernel[grid](wide, side, grad, tiles.ends, m, r, tiles.groups_per_expert,
                       wide.stride(0), wide.stride(1), side.stride(0), side.stride(1),
                       grad.stride(0), grad.stride(1), grad.stride(wide_dim), grad.stride(rank_dim),
                       BT=WGRAD_ROWS, BM=WGRAD_COLS, BR=_rank_block(r), PREC=_prec(wide.dtype), **LAUNCH["wgrad"])
    torch.autograd.graph.increment_version(grad)
