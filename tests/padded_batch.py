"""The padded counterpart of trainer/base/packing.py's packed stream: the baseline that packing is
tested (tests/unit/test_packing.py, tests/gpu/test_speed_gpu.py) and measured
(benchmarks/bench_packed_step.py) against. The trainer itself only packs.

Rows are in the caller's order, right-padded with ``pad_id``; with a causal mask a right-padded
row's real tokens never see its padding, so no attention mask is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.kernels.chunked_logprobs import IGNORE_TARGET  # target id of positions without a next token


@dataclass
class PaddedBatch:
    tokens: torch.Tensor  # int64 [B, L]
    position_ids: torch.Tensor  # int64 [B, L]
    lengths: tuple[int, ...]
    valid: torch.Tensor  # bool [B, L]: a real token (not padding)

    def next_token_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """targets[b, t] = tokens[b, t + 1] inside row b's real tokens; its last real token and its
        padding get IGNORE_TARGET. Returns (targets int64 [B, L], valid bool [B, L])."""
        targets = torch.full_like(self.tokens, IGNORE_TARGET)
        targets[:, :-1] = self.tokens[:, 1:]
        lens = torch.tensor(self.lengths, device=self.tokens.device)
        cols = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        targets[cols.unsqueeze(0) >= (lens.unsqueeze(1) - 1)] = IGNORE_TARGET
        return targets, targets != IGNORE_TARGET


def pad_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    pad_id: int = 0,
    pad_to_multiple: int = 1,
    device: torch.device | str | None = None,
) -> PaddedBatch:
    """The sequences as rows of one [B, L] batch, L the longest rounded up to ``pad_to_multiple``."""
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("padding needs at least one sequence and no empty sequence")
    length = max(s.numel() for s in seqs)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, : s.numel()] = s
    lens = torch.tensor([s.numel() for s in seqs])
    valid = torch.arange(length).unsqueeze(0) < lens.unsqueeze(1)
    return PaddedBatch(
        tokens=tokens.to(device),
        position_ids=torch.arange(length).expand(len(seqs), length).contiguous().to(device),
        lengths=tuple(int(n) for n in lens),
        valid=valid.to(device),
    )
