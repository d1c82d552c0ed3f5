"""The trainer's forward passes through the frozen base with each sample's slot LoRA on (or off):
per-token log-probabilities for the losses.

* ``logprobs``: one micro-batch of loop samples, laid out [b, s] like its padded ids;
* ``stream_logprobs``: ONE packed stream of sequences (the one home of the packed LoRA pass:
  the loop's micro-batches, the mixed micro-batches with riders, the Tinker forward);
* ``mixed_logprobs``: loop samples and riders (trainer/batch.py RiderSequence) in one stream.

Routing invariant: with LoRA on, a pass leaves ``routing`` set for the caller's backward
(activation recomputation runs the LoRA layers again there); the caller disables it. A pass
that raises disables it itself.
"""

from __future__ import annotations

import torch

from trainer.base.base_model import FrozenBase, packed_token_logprobs, token_logprobs
from trainer.batch import RiderSequence, TrainSample
from trainer.kernels.chunked_logprobs import IGNORE_TARGET
from trainer.config import TrainerConfig
from trainer.platform.distributed import tp_group
from trainer.lora.multi_lora import SlotRouting, SlotScales
from trainer.base.packing import PackedBatch, pack_sequences


class LoraPasses:
    def __init__(self, base: FrozenBase, routing: SlotRouting, scales: SlotScales, config: TrainerConfig) -> None:
        self.base = base
        self.routing = routing
        self.scales = scales  # per-slot LoRA scales by target group (trainer/lora/slots.py SlotTable.scales), read at each pass
        self.config = config
        self.device = base.device

    def _chunk_and_group(self):  # noqa: ANN202
        cfg = self.config
        return (cfg.logprob_chunk_tokens if cfg.chunked_logprobs else None), (tp_group() if cfg.tp > 1 else None)

    def logprobs(self, mb: list[TrainSample], ids: torch.Tensor, labels: torch.Tensor, lora: bool,
                 input_grad: bool = False) -> torch.Tensor:
        """log p(labels) [b, s] fp32 on the device for the micro-batch ``mb`` (sorted by slot),
        laid out like the padded ``ids``/``labels``; LoRA on (each sample's slot) or off.

        Packed: the samples go through the model as one stream and the per-token values
        are scattered back to [b, s] (positions past a sample's end stay 0, masked anyway)."""
        chunk, tpg = self._chunk_and_group()
        slot_ids = [x.slot for x in mb]
        self.routing.disable()
        try:
            if not self.config.packed:
                if lora:
                    self.routing.set(torch.tensor(slot_ids), ids.shape[1], self.scales)
                return token_logprobs(self.base, ids, labels, chunk_tokens=chunk, tp_group=tpg, input_grad=input_grad)
            lp, packed = self.stream_logprobs([x.tokens for x in mb], slot_ids, None, lora=lora, input_grad=input_grad)
            layout = packed.layout
            return lp.new_zeros(ids.shape).index_put((layout.document_ids.long(), layout.position_ids), lp)
        except BaseException:
            self.routing.disable()
            raise

    def stream_logprobs(self, sequences: list[list[int]], slot_ids: list[int], targets: torch.Tensor | None,
                        *, lora: bool, input_grad: bool = False) -> tuple[torch.Tensor, PackedBatch]:
        """(log-probs [T] fp32, PackedBatch) of ONE packed stream of ``sequences`` (already in slot
        order: the stream keeps the given order). ``targets`` [T]: what each position predicts;
        None = the next token (IGNORE_TARGET, log-prob 0, at each sequence's last token). With
        ``lora`` the routing is set for the stream and left set."""
        chunk, tpg = self._chunk_and_group()
        packed = pack_sequences(sequences, slot_ids, self.config.num_slots, device=self.device)
        if packed.sample_order != tuple(range(len(sequences))):  # callers' scatters rely on it
            raise RuntimeError(f"packed stream not sorted by slot: slots {slot_ids}")
        if targets is None:
            targets, _ = packed.next_token_targets()
        if lora:
            self.routing.set_packed(packed, self.scales)
        lp = packed_token_logprobs(self.base, packed, targets, chunk_tokens=chunk, tp_group=tpg, input_grad=input_grad)
        return lp, packed

    def mixed_logprobs(self, mb: list[TrainSample], shape: torch.Size,
                       riders: list[RiderSequence]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loop samples ``mb`` and the ``riders`` of one micro-batch in ONE packed stream with
        every sequence's own slot LoRA on: (the loop samples' log-probs laid out like ``logprobs``
        [b, s], one [len(tokens)] log-prob segment per rider). Routing left set."""
        items = [(x.slot, x.tokens, None, j) for j, x in enumerate(mb)]
        items += [(r.slot, r.tokens, r.targets, -1 - k) for k, r in enumerate(riders)]
        items.sort(key=lambda it: it[0])  # stable: the loop's (slot, index) order and the riders' order kept
        flat: list[int] = []
        for _, tokens, targets, _ in items:
            flat += list(tokens[1:]) + [IGNORE_TARGET] if targets is None else list(targets)
        lp, _ = self.stream_logprobs([it[1] for it in items], [it[0] for it in items],
                                     torch.tensor(flat, dtype=torch.long, device=self.device), lora=True)
        rows, cols, where, rider_lp = [], [], [], [None] * len(riders)
        start = 0
        for _, tokens, _, who in items:
            n = len(tokens)
            if who >= 0:
                rows.append(torch.full((n,), who, dtype=torch.long))
                cols.append(torch.arange(n))
                where.append(torch.arange(start, start + n))
            else:
                rider_lp[-1 - who] = lp[start : start + n]
            start += n
        loop_lp = lp.new_zeros(shape)
        if rows:
            idx = torch.cat(where).to(lp.device)
            loop_lp = loop_lp.index_put((torch.cat(rows).to(lp.device), torch.cat(cols).to(lp.device)), lp[idx])
        return loop_lp, rider_lp
