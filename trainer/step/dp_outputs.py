"""The Tinker datums' outputs across the data-parallel ranks: every rank is given the whole round,
runs the losses of its share of the datums (trainer/batch.py ``rider_share``) and answers for all
of them. ``gather_datum_outputs`` brings the other ranks' shares over the DP group.

Invariants:
* every rank knows every rank's share (``rider_share`` is a function of the riders' slots), and
  the size of every datum's outputs (its fields times its length, plus its loss sum), so one
  ``all_gather`` of one padded float64 vector per rank carries them all, no pickling;
* the values arrive exactly: the fp32 per-position outputs and the loss sum (a Python float) are
  exact in float64, so the gathered answer is what the computing rank saw, bit for bit, on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.batch import RiderSequence, rider_share
from trainer.platform.distributed import ParallelLayout, dp_group

# One datum's outputs: (per-position vectors by name, each [len(tokens)] fp32; the datum's loss sum).
DatumOutputs = tuple[dict[str, torch.Tensor], float]


def gather_datum_outputs(mine: dict[int, DatumOutputs], riders: list[RiderSequence], fields: list[tuple[str, ...]],
                         layout: ParallelLayout, device: torch.device) -> list[DatumOutputs]:
    """Every rider's outputs, in rider order, on every DP rank. ``mine``: this rank's share's (rider
    position -> outputs); ``fields[k]``: the names of rider k's per-position outputs, in the order
    they travel. Collective over DP (every rank calls it with the same riders and fields)."""
    sizes = [len(names) * len(r.tokens) + 1 for names, r in zip(fields, riders, strict=True)]
    shares = [rider_share([r.slot for r in riders], q, layout.dp_size) for q in range(layout.dp_size)]
    missing = [k for k in shares[layout.dp_rank] if k not in mine]
    if missing:
        raise ValueError(f"riders {missing} of this rank's share ran no loss (their outputs are missing)")
    width = max(sum(sizes[k] for k in share) for share in shares)
    flat = torch.zeros(width, dtype=torch.float64)
    start = 0
    for k in shares[layout.dp_rank]:
        out, loss = mine[k]
        vec = torch.cat([out[name].reshape(-1).double() for name in fields[k]] + [torch.tensor([loss], dtype=torch.float64)])
        flat[start : start + sizes[k]] = vec
        start += sizes[k]
    parts = [torch.empty(width, dtype=torch.float64, device=device) for _ in range(layout.dp_size)]
    dist.all_gather(parts, flat.to(device), group=dp_group())
    got: list[DatumOutputs | None] = [None] * len(riders)
    for part, share in zip(parts, shares):
        part = part.cpu()
        start = 0
        for k in share:
            n = len(riders[k].tokens)
            vec = part[start : start + sizes[k]]
            got[k] = ({name: vec[j * n : (j + 1) * n].float() for j, name in enumerate(fields[k])}, float(vec[-1]))
            start += sizes[k]
    return got  # type: ignore[return-value] - the shares cover every position
