"""Pack a mixed-adapter batch of variable-length sequences into one token stream.

RL batches are very uneven (prompts of a few hundred tokens, responses from 32 to
2048): padding them to the longest wastes most of the compute. Packing puts every
sequence back to back in one stream of T tokens (Megatron's ``thd`` layout, batch
dimension 1) with attention confined to each sequence (document masking, see
``trainer.base.fused_attention``).

Invariants of a ``PackedBatch`` (tests/unit/test_packing.py checks them):
- Sequences are ordered by slot id (ascending), stable within a slot, so the tokens
  of one slot are one contiguous segment of the stream: slot ``s`` owns rows
  ``[slot_offsets[s] - slot_token_counts[s], slot_offsets[s])``. That segment is
  what the multi-LoRA layer's grouped GEMM uses as slot ``s``'s group (``slot_offsets``
  has the layout of ``torch.nn.functional.grouped_mm``'s ``offs``: int32 cumulative
  ends, one per slot, empty slots included).
- ``position_ids`` restart at 0 in every sequence, so RoPE sees each sequence as if
  it were alone.
- ``sample_order[j]`` is the caller's index of the j-th packed sequence; ``unpack``
  and ``to_padded`` invert the permutation, so per-sample results come back in the
  caller's order.
- No padding tokens: T is exactly the sum of the sequence lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from trainer.kernels.chunked_logprobs import IGNORE_TARGET  # target id of positions without a next token


@dataclass
class DocumentLayout:
    """Per-token view of a packed stream that the attention and RoPE code needs.

    Computed once per batch (not per layer). ``flex_block_mask`` is a cache filled
    by ``trainer.base.fused_attention`` the first time the flex backend runs on it.
    """

    cu_seqlens: torch.Tensor  # int32 [n + 1], on the device of the stream
    max_seqlen: int
    position_ids: torch.Tensor  # int64 [T]: position of each token inside its sequence
    document_ids: torch.Tensor  # int32 [T]: packed index of each token's sequence
    lengths: tuple[int, ...]  # host copy of the sequence lengths (no device sync needed)
    flex_block_mask: object | None = field(default=None, repr=False)

    @property
    def total_tokens(self) -> int:
        return int(sum(self.lengths))

    @staticmethod
    def from_lengths(lengths: Sequence[int], device: torch.device | str | None = None) -> "DocumentLayout":
        if len(lengths) == 0:
            raise ValueError("a packed stream needs at least one sequence; got none")
        if any(int(n) <= 0 for n in lengths):
            raise ValueError(f"every sequence needs at least one token; got lengths {list(lengths)}")
        lengths = tuple(int(n) for n in lengths)
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
        doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lens)
        pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(cu[:-1].to(torch.int64), lens)
        return DocumentLayout(
            cu_seqlens=cu.to(device),
            max_seqlen=max(lengths),
            position_ids=pos.to(device),
            document_ids=doc.to(device),
            lengths=lengths,
        )

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> "DocumentLayout":
        """For a plain Megatron ``PackedSeqParams`` that carries no layout (one host sync)."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        layout = DocumentLayout.from_lengths(lengths, device=cu_seqlens.device)
        if max_seqlen is not None and max_seqlen < layout.max_seqlen:
            raise ValueError(f"max_seqlen {max_seqlen} is below the longest sequence {layout.max_seqlen}")
        return layout


@dataclass
class PackedSequenceParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (``thd``) plus the precomputed document layout.

    Everything Megatron and TransformerEngine read is filled in the standard way, so
    the same object serves the TE layer spec; ``trainer.base.fused_attention`` reads
    ``layout`` instead of recomputing positions and document ids in every layer.
    """

    layout: DocumentLayout | None = None


@dataclass
class PackedBatch:
    """One packed stream; see the module docstring for the invariants."""

    tokens: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    layout: DocumentLayout
    sample_order: tuple[int, ...]  # packed sequence j is the caller's sample sample_order[j]
    sample_slots: tuple[int, ...]  # slot id of packed sequence j (non-decreasing)
    num_slots: int
    slot_token_counts: torch.Tensor  # int64 [num_slots]
    slot_offsets: torch.Tensor  # int32 [num_slots], cumulative ends (grouped_mm ``offs``)
    token_slots: torch.Tensor  # int64 [T]: slot id of every token
    token_samples: torch.Tensor  # int64 [T]: caller's sample index of every token

    @property
    def num_tokens(self) -> int:
        return self.layout.total_tokens

    @property
    def num_samples(self) -> int:
        return len(self.sample_order)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.layout.cu_seqlens

    @property
    def packed_seq_params(self) -> PackedSequenceParams:
        """What to pass as ``packed_seq_params`` to ``GPTModel.forward``."""
        cu = self.layout.cu_seqlens
        return PackedSequenceParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=self.layout.max_seqlen,
            max_seqlen_kv=self.layout.max_seqlen,
            layout=self.layout,
        )

    # ---- per-token arrays in and out -------------------------------------------------

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a stream-order array ([T, ...] or [1, T, ...]) into per-sample arrays, caller's order."""
        if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == self.num_tokens:
            values = values[0]
        if values.shape[0] != self.num_tokens:
            raise ValueError(f"expected {self.num_tokens} rows in stream order, got {values.shape[0]}")
        pieces = torch.split(values, list(self.layout.lengths), 0)
        out: list[torch.Tensor | None] = [None] * self.num_samples
        for j, i in enumerate(self.sample_order):
            out[i] = pieces[j]
        return out  # type: ignore[return-value]

    def to_padded(self, values: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
        """Stream-order [T, ...] -> [num_samples, max_len, ...], caller's order, right-padded."""
        pieces = self.unpack(values)
        return torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True, padding_value=pad_value)

    def next_token_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """targets[t] = tokens[t + 1] inside a sequence; the last token of each has IGNORE_TARGET.

        Returns (targets int64 [T], valid bool [T]). The log-prob at stream position t is
        the log-prob of the sequence's token at position_ids[t] + 1.
        """
        toks = self.tokens[0]
        targets = torch.full_like(toks, IGNORE_TARGET)
        targets[:-1] = toks[1:]
        last = self.layout.cu_seqlens[1:].to(torch.int64) - 1
        targets[last] = IGNORE_TARGET
        return targets, targets != IGNORE_TARGET


def pack_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    slot_ids: Sequence[int],
    num_slots: int,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack ``sequences`` (token ids, one per sample) whose adapters are ``slot_ids``.

    ``num_slots`` is the number of resident slots N: ``slot_offsets`` has one entry per
    slot, zero-length for slots without samples, so it can go to the grouped GEMM as is.
    """
    if len(sequences) != len(slot_ids):
        raise ValueError(f"got {len(sequences)} sequences but {len(slot_ids)} slot ids; one slot id per sequence")
    if len(sequences) == 0:
        raise ValueError("cannot pack an empty batch; pass at least one sequence")
    for i, s in enumerate(slot_ids):
        if not 0 <= int(s) < num_slots:
            raise ValueError(f"slot id {s} of sample {i} is outside 0..{num_slots - 1} (num_slots={num_slots})")
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
    for i, s in enumerate(seqs):
        if s.numel() == 0:
            raise ValueError(f"sample {i} has no tokens; every sequence needs at least one")

    # Stable sort by slot: each slot's samples stay in the caller's order.
    order = sorted(range(len(seqs)), key=lambda i: int(slot_ids[i]))
    lengths = [seqs[i].numel() for i in order]
    slots = [int(slot_ids[i]) for i in order]
    layout = DocumentLayout.from_lengths(lengths, device=device)
    tokens = torch.cat([seqs[i] for i in order]).to(device).unsqueeze(0)

    lens = torch.tensor(lengths, dtype=torch.int64)
    counts = torch.zeros(num_slots, dtype=torch.int64)
    counts.index_add_(0, torch.tensor(slots, dtype=torch.int64), lens)
    return PackedBatch(
        tokens=tokens,
        position_ids=layout.position_ids.unsqueeze(0),
        layout=layout,
        sample_order=tuple(order),
        sample_slots=tuple(slots),
        num_slots=num_slots,
        slot_token_counts=counts.to(device),
        slot_offsets=torch.cumsum(counts, 0).to(torch.int32).to(device),
        token_slots=torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), lens).to(device),
        token_samples=torch.repeat_interleave(torch.tensor(order, dtype=torch.int64), lens).to(device),
    )


def split_by_token_budget(
    lengths: Sequence[int], slot_ids: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """Micro-batches of sample indices, each at most ``max_tokens`` tokens when packed.

    Samples are taken in slot order (stable), so a slot's samples stay contiguous
    inside each micro-batch and spread over as few micro-batches as possible. A sample
    longer than ``max_tokens`` gets a micro-batch of its own.
    """
    if len(lengths) != len(slot_ids):
        raise ValueError(f"got {len(lengths)} lengths but {len(slot_ids)} slot ids")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: int(slot_ids[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if current and used + n > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches
