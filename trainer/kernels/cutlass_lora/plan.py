"""The row-tile table of the LoRA-in-the-GEMM kernels, and the kernel's contract in torch.

The kernel (lora_mainloop.hpp) computes, for every output row tile t of ``tile_m`` rows,

    out[t] = a[t] B  +  sum_j  hblk[tiles[t, j].block]  F[tiles[t, j].slot]          (one fp32 sum)

``TilePlan.of`` builds that table from a micro-batch's segment token counts (segment g owns rows
[start_g, start_g + counts[g])): one (slot, block) pair per segment a tile touches, every tile padded
to the same count with an all-zero block (the kernel's K is uniform). ``hblk`` holds, per pair, the
tile's rows of h with every row outside that pair's segment set to exactly 0, so a row only ever
meets its own slot's factor. When every tile lies inside one segment (token counts multiples of
``tile_m``: the dense benchmarks) hblk is h itself, no copy (``identity``).

``emulate`` is that contract in plain torch (fp32), tile by tile: the CPU proves the tables against
the definition with it, and the GPU tests compare the CUDA kernel with it as well as with the
definition.

Caveat stated, not hidden: a tile holding rows of two segments multiplies the zeroed rows by the
other slot's factor (0 x F), which is exactly 0 only for a finite F. The trainer's slot weights are
finite (a non-finite gradient skips the step: trainer/optim/slot_steps.py); a non-finite factor
would reach the rows of the other segments of its tiles, where today's grouped path keeps it in its
own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TilePlan:
    """The kernel's table for one micro-batch and tile height (see the module docstring).

    tiles: int32 [m_tiles, pairs_per_tile, 2] of (segment index, hblk block) on the device.
    blocks: rows of hblk / tile_m (the last one all zeros unless ``identity``).
    gather_rows / drop: hblk = h[gather_rows] with the rows where ``drop`` is true set to 0
    (None when ``identity``)."""

    tile_m: int
    rows: int
    pairs_per_tile: int
    identity: bool
    blocks: int
    tiles: torch.Tensor
    gather_rows: torch.Tensor | None
    drop: torch.Tensor | None

    @staticmethod
    def of(counts: list[int], tile_m: int, device: torch.device | str = "cpu") -> "TilePlan":
        """The plan for segments of ``counts`` tokens (empty ones allowed) in ``tile_m``-row tiles."""
        if tile_m <= 0 or any(n < 0 for n in counts):
            raise ValueError(f"tile_m must be positive and counts non-negative, got {tile_m}, {counts}")
        rows = sum(counts)
        if rows == 0:
            raise ValueError("a LoRA GEMM plan needs at least one token")
        m_tiles = -(-rows // tile_m)
        starts, start = [], 0
        for n in counts:
            starts.append(start)
            start += n
        # the (segment, first row, end row) of every non-empty segment, in row order
        segments = [(g, s, s + n) for g, (s, n) in enumerate(zip(starts, counts)) if n]
        per_tile: list[list[tuple[int, int, int]]] = [[] for _ in range(m_tiles)]
        for g, s, e in segments:
            for t in range(s // tile_m, (e - 1) // tile_m + 1):
                per_tile[t].append((g, s, e))
        pairs = max(len(p) for p in per_tile)
        identity = pairs == 1
        rows_t = drop_t = None
        if identity:
            table = [[(g, t)] for t, [(g, _, _)] in enumerate(per_tile)]
            blocks = m_tiles
        else:
            flat = [(t, g, s, e) for t, tile_pairs in enumerate(per_tile) for g, s, e in tile_pairs]
            zero_block = len(flat)
            table, block = [], 0
            for tile_pairs in per_tile:
                entry = [(g, block + j) for j, (g, _, _) in enumerate(tile_pairs)]
                block += len(tile_pairs)
                # padded with the all-zero block, against the tile's first slot (0 x F = 0)
                table.append(entry + [(entry[0][0], zero_block)] * (pairs - len(entry)))
            blocks = zero_block + 1
            t, _, s, e = (torch.tensor(c, dtype=torch.int64) for c in zip(*flat))
            r = t[:, None] * tile_m + torch.arange(tile_m)  # [pairs, tile_m]: the tile's rows
            inside = (r >= s[:, None]) & (r < e[:, None])
            rows_t = torch.cat([torch.where(inside, r, 0).reshape(-1), torch.zeros(tile_m, dtype=torch.int64)])
            drop_t = torch.cat([~inside.reshape(-1), torch.ones(tile_m, dtype=torch.bool)]).unsqueeze(1)
            rows_t, drop_t = rows_t.to(device, non_blocking=True), drop_t.to(device, non_blocking=True)
        as_int32 = torch.tensor(table, dtype=torch.int32).to(device, non_blocking=True)
        return TilePlan(tile_m, rows, pairs, identity, blocks, as_int32, rows_t, drop_t)

    def hblk(self, h: torch.Tensor) -> torch.Tensor:
        """The kernel's hblk for h [rows, R]: h itself for an identity plan, else the masked gather
        [blocks * tile_m, R] (two kernel launches on a rank-R tensor)."""
        if h.shape[0] != self.rows:
            raise ValueError(f"h has {h.shape[0]} rows, the plan {self.rows}")
        if self.identity:
            return h
        return h.index_select(0, self.gather_rows).masked_fill_(self.drop, 0)


def emulate(a: torch.Tensor, b_kn: torch.Tensor, hblk: torch.Tensor, factor_rn: torch.Tensor,
            plan: TilePlan) -> torch.Tensor:
    """What the kernel computes, in fp32 torch, tile by tile from the plan: a [M, K] @ b_kn [K, N]
    plus, for every (slot, block) of each row tile, hblk's block [tile_m, R] @ factor_rn[slot]
    [R, N]. ``b_kn`` and ``factor_rn`` are logical views (forward: W.t() and B.transpose(1, 2);
    input gradient: W and A). Blocks read past hblk's end are zeros, as TMA reads them."""
    m, tm = a.shape[0], plan.tile_m
    out = a.float() @ b_kn.float()
    r = factor_rn.shape[1]
    padded = torch.zeros(plan.blocks * tm, r, dtype=torch.float32, device=a.device)
    padded[: min(hblk.shape[0], padded.shape[0])] = hblk[: padded.shape[0]].float()
    tiles = plan.tiles.cpu().tolist()
    for t in range(len(tiles)):
        lo, hi = t * tm, min((t + 1) * tm, m)
        for slot, block in tiles[t]:
            rows = padded[block * tm : block * tm + (hi - lo)]
            out[lo:hi] += rows @ factor_rn[slot].float()
    return out
