"""One micro-batch of a train call: how a phase's samples (and riders) are cut into micro-batches,
their tensors for the losses, and the forward/backward over them.

Invariants (trainer/core.py states the step's):
* every micro-batch is sorted by slot (each slot one contiguous segment), riders included;
* the backward sums per-sample loss numerators of all slots (plus the riders' losses); the base is
  frozen and samples never interact, so each slot's gradient rows receive exactly the sum over
  its own samples; autograd accumulates into the slot buffers in place (checked);
* the loop samples' statistics go to their slots' pending sums and to the call's statistics;
  riders add no statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.batch import PlannedSample, RiderSequence, TrainSample, pack_micro_batches
from trainer.config import SlotHyperParams, TrainerConfig
from trainer.step.lora_passes import LoraPasses
from trainer.losses.rows import RowLoss, TokenLossInputs, sample_loss_numerators
from trainer.base.packing import split_by_token_budget
from trainer.lora.slots import SlotTable


def micro_batches(local: list[PlannedSample], lengths: list[int], riders: list[RiderSequence],
                  config: TrainerConfig) -> list[tuple[list[PlannedSample], list[RiderSequence]]]:
    """This rank's samples of a phase (and the riders joining it) cut into micro-batches:
    (samples sorted by slot, riders in their order) each.

    Packed: at most ``micro_batch_tokens`` real tokens each, loop samples and riders filled
    together in slot order, so a slot's sequences share as few micro-batches as possible.
    Padded (no riders there): at most that many (samples x longest) tokens each, longest
    first (less padding)."""
    budget = config.micro_batch_tokens
    if not config.packed:
        return [(mb, []) for mb in pack_micro_batches(local, lengths, budget)]
    n = len(local)
    groups = split_by_token_budget([lengths[p.index] for p in local] + [len(r.tokens) for r in riders],
                                   [p.slot for p in local] + [r.slot for r in riders], budget)
    return [(sorted((local[i] for i in g if i < n), key=lambda p: (p.slot, p.index)),
             [riders[i - n] for i in sorted(g) if i >= n]) for g in groups]


def forward_backward(passes: LoraPasses, slots: SlotTable, mb: list[TrainSample], call_stats: torch.Tensor,
                     riders: list[RiderSequence]) -> None:
    """One micro-batch (loop samples sorted by slot, plus riders): KL reference pass if any,
    ONE policy forward over all of it, the summed per-sample loss numerators and riders'
    losses backward, the loop samples' statistics into their slots' pending sums."""
    dev = passes.device
    t = MicroBatchTensors.build(mb, [slots[x.slot].hyper for x in mb], dev) if mb else None
    ref_sub = None
    if t is not None and t.kl_rows:  # reference policy = the base with LoRA off, for the KL term only
        with torch.no_grad():
            ref_sub = passes.logprobs([mb[j] for j in t.kl_rows], t.ids[t.kl_rows], t.labels[t.kl_rows], lora=False)
    try:
        rider_lp: list[torch.Tensor] = []
        if riders:
            logp, rider_lp = passes.mixed_logprobs(mb, t.ids.shape if t is not None else (0, 0), riders)
        else:
            logp = passes.logprobs(mb, t.ids, t.labels, lora=True)
        total = logp.new_zeros(())
        if t is not None:
            ref = None
            if ref_sub is not None:
                ref = logp.detach().clone()
                ref[t.kl_rows] = ref_sub
            # Unknown rollout logprobs (or masked positions): on-policy, ratio exactly 1.
            rollout_lp = torch.where(t.has_rollout & t.mask, t.rollout, logp.detach())
            inputs = TokenLossInputs(
                logprobs=logp, mask=t.mask, losses=t.losses, advantage=t.advantage, rollout_logprobs=rollout_lp,
                kl_coef=t.kl_coef, ref_logprobs=ref, per_token_weight=t.weight,
            )
            numerators, st = sample_loss_numerators(inputs)
            total = total + numerators.sum()
        for r, lp in zip(riders, rider_lp):
            total = total + r.loss(lp)
        total.backward()
        slots.buffers.check_grads_in_place()
    finally:
        passes.routing.disable()  # kept set through backward: recomputation runs the LoRA layers again
    if t is None:
        return
    b = len(mb)
    rows = torch.stack(
        [st.numerator, torch.ones(b, device=dev), st.tokens, st.clipped, st.ratio_sum, st.kl_sum,
         st.tokens * t.is_rl], dim=1,
    ).to(torch.float64).cpu()
    call_stats.index_add_(0, t.slot_ids, rows)
    for j, x in enumerate(mb):
        slots[x.slot].pending += rows[j]


@dataclass
class MicroBatchTensors:
    """A micro-batch laid out [b, s] (one row per sample, right-padded) for the losses.

    Token t's entries describe the prediction of token t + 1: ``labels[j, t]`` is that
    token, ``mask`` its loss mask, ``rollout`` its rollout log-prob. Per-sample columns
    carry each sample's adapter hyper-parameters, ``losses`` each row's entry of the one loss
    table (its slot's loss: trainer/losses/rows.py). On the device, except ``slot_ids``.
    """

    ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    rollout: torch.Tensor
    has_rollout: torch.Tensor
    slot_ids: torch.Tensor  # CPU, for the statistics
    is_rl: torch.Tensor  # rows whose loss is of the rl kind
    losses: list[RowLoss]
    kl_coef: torch.Tensor
    kl_rows: list[int]  # rows with a KL term (need the reference pass)
    weight: torch.Tensor  # per-sample token weight (1/n for sequence_mean)
    advantage: torch.Tensor

    @staticmethod
    def build(mb: list[TrainSample], hypers: list[SlotHyperParams], dev: torch.device) -> "MicroBatchTensors":
        b, s = len(mb), max(len(x.tokens) for x in mb)
        ids = torch.zeros(b, s, dtype=torch.long)
        labels = torch.zeros(b, s, dtype=torch.long)
        mask = torch.zeros(b, s, dtype=torch.bool)
        rollout = torch.zeros(b, s, dtype=torch.float32)
        has_rollout = torch.zeros(b, s, dtype=torch.bool)
        for j, x in enumerate(mb):
            n = len(x.tokens)
            ids[j, :n] = torch.tensor(x.tokens)
            labels[j, : n - 1] = ids[j, 1:n]
            mask[j, : n - 1] = torch.tensor(x.loss_mask[1:], dtype=torch.bool)
            if x.rollout_logprobs is not None:
                rollout[j, : n - 1] = torch.tensor(x.rollout_logprobs[1:], dtype=torch.float32)
                has_rollout[j, : n - 1] = True
        losses = [RowLoss.of(*h.loss_choice) for h in hypers]
        is_rl = torch.tensor([row.kind == "rl" for row in losses])
        kl_coef = torch.tensor([h.kl_coef if row.kind == "rl" else 0.0 for h, row in zip(hypers, losses)])
        n_tok = mask.sum(dim=1).clamp(min=1).to(torch.float32)
        seq_mean = torch.tensor([h.loss_normalization == "sequence_mean" for h in hypers])
        weight = torch.where(seq_mean, 1.0 / n_tok, torch.ones(b))
        return MicroBatchTensors(
            ids=ids.to(dev), labels=labels.to(dev), mask=mask.to(dev), rollout=rollout.to(dev),
            has_rollout=has_rollout.to(dev), slot_ids=torch.tensor([x.slot for x in mb]), is_rl=is_rl.to(dev), losses=losses,
            kl_coef=kl_coef.to(dev), kl_rows=(kl_coef > 0).nonzero().flatten().tolist(), weight=weight.to(dev),
            advantage=torch.tensor([x.advantage for x in mb], dtype=torch.float32, device=dev),
        )
