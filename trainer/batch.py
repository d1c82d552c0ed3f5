"""The train batch wire type, the riders that join it, and how a batch is cut into phases and micro-batches.

Token alignment (one convention everywhere): ``tokens`` is prompt + response;
``loss_mask[t] = 1`` means token t is learned (predicted from tokens[:t]), so
``loss_mask[0]`` must be 0; ``rollout_logprobs[t]`` is the rollout policy's
log-probability of token t (any value where the mask is 0).

Phases: a slot steps when it has accumulated ``samples_per_step`` samples. When a
batch holds more samples of a slot than it still needs, the extra ones belong to
the slot's *next* step and must not be back-propagated before the current step
is taken. Sample k of slot i in this batch (i having ``pending_i`` samples
accumulated from earlier calls) belongs to phase ``(pending_i + k) //
samples_per_step_i``; phases run in order and the slots that complete a step in
a phase step right after it. In the usual case (each call brings at most the
samples a slot still needs) there is one phase.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slot: int = Field(ge=0, description="Slot (adapter) this sample trains.")
    tokens: list[int] = Field(min_length=2, description="Prompt + response token ids.")
    loss_mask: list[int] = Field(description="1 where the token is learned (same length as tokens; first must be 0).")
    advantage: float = Field(0.0, description="RL: group-normalized advantage of this sample (ignored for SFT).")
    rollout_logprobs: list[float] | None = Field(
        None, description="RL: rollout policy log-prob of each token (same length); None = on-policy (ratio 1)."
    )
    registration: str | None = Field(
        None, description="Registration id of the tenant the sample was made for; a mismatch with the slot drops it."
    )

    @model_validator(mode="after")
    def _check(self) -> "TrainSample":
        n = len(self.tokens)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries but tokens has {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        if self.loss_mask[0] != 0:
            raise ValueError("loss_mask[0] must be 0: the first token has no context to be predicted from")
        if any(t < 0 for t in self.tokens):
            raise ValueError("token ids must be >= 0")
        if not math.isfinite(self.advantage):
            raise ValueError(f"advantage must be finite, got {self.advantage}")
        if self.rollout_logprobs is not None:
            if len(self.rollout_logprobs) != n:
                raise ValueError(f"rollout_logprobs has {len(self.rollout_logprobs)} entries but tokens has {n}")
            bad = [t for t, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_logprobs)) if m and not (math.isfinite(lp) and lp <= 0)]
            if bad:
                raise ValueError(f"rollout_logprobs must be finite and <= 0 on learned tokens; bad positions {bad[:5]}")
        return self


class TrainBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples: list[TrainSample] = Field(min_length=1)


@dataclass
class RiderSequence:
    """A tenant-driven sequence that rides in a train call beside the loop's samples (the
    Tinker API's datums, trainer/step/round_runner.py), in the same packed micro-batches.

    It brings its own per-position targets and loss; its gradient ACCUMULATES in its slot's
    gradient rows. Its slot must not be trained by the call's batch, and it never steps in
    the call: no statistics, no normalization, no optimizer (the tenant's optim_step does).
    Under DP every rank is given every rider and trains its share (``rider_share``): its slot's
    gradient rows hold that rank's part until the optim_step sums the parts."""

    slot: int
    tokens: list[int]
    targets: list[int]  # targets[t]: the token position t predicts (one per token)
    loss: Callable[[Any], Any]  # its [len(tokens)] log-probs (a differentiable torch tensor) -> scalar


@dataclass(frozen=True)
class PlannedSample:
    index: int  # position in the batch
    slot: int
    phase: int


def assign_phases(slots: list[int], pending: dict[int, int], samples_per_step: dict[int, int]) -> list[PlannedSample]:
    """Phase of every sample (see module doc); ``pending``/``samples_per_step`` per slot."""
    seen: dict[int, int] = {}
    out = []
    for index, slot in enumerate(slots):
        k = seen.get(slot, 0)
        seen[slot] = k + 1
        out.append(PlannedSample(index, slot, (pending.get(slot, 0) + k) // samples_per_step[slot]))
    return out


def dp_shard(planned: list[PlannedSample], dp_rank: int, dp_size: int) -> list[PlannedSample]:
    """This DP rank's share of one phase: every dp_size-th sample in (slot, index) order,
    so each slot's samples are spread over the ranks. Same answer on every rank."""
    ordered = sorted(planned, key=lambda p: (p.slot, p.index))
    return ordered[dp_rank::dp_size]


def rider_share(slots: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """Positions of this DP rank's riders among riders of these ``slots``, ascending: every
    dp_size-th in (slot, position) order, as ``dp_shard`` spreads samples, so each slot's datums
    are spread over the ranks. The ranks' shares partition the positions; the same answer on
    every rank (each rank knows every rank's share: trainer/step/dp_outputs.py gathers by it);
    every position at dp_size 1."""
    ordered = sorted(range(len(slots)), key=lambda k: (slots[k], k))
    return sorted(ordered[dp_rank::dp_size])


def pack_micro_batches(planned: list[PlannedSample], lengths: list[int], token_budget: int) -> list[list[PlannedSample]]:
    """Group samples so that (samples x longest) <= token_budget (a longer sample goes alone).

    Longest first keeps padding low; each micro-batch is then sorted by slot so
    every slot is one contiguous segment of it.
    """
    order = sorted(planned, key=lambda p: (-lengths[p.index], p.slot, p.index))
    batches: list[list[PlannedSample]] = []
    current: list[PlannedSample] = []
    longest = 0
    for p in order:
        n = lengths[p.index]
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(p)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [sorted(b, key=lambda p: (p.slot, p.index)) for b in batches]
