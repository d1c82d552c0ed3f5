"""What a Tinker model has done, for the views of it (the dashboard, the `lorafleet tinker` tables,
GET /v1/tinker/models, GET /metrics): `ModelStats`, one per model (service/tenants/tinker_model.py).

Written by the model as its operations settle (the scheduler's thread) and by the Tinker face when a
sampling session of one of its sampler checkpoints samples (the serving loop); read from any thread.
Every field is a number or a tuple replaced whole, so a reader sees a consistent value, at worst one
operation old. In memory only: a restarted service counts again from the restart (the step is the
model's own, from its record).

  * `tokens_trained`: the datum positions of its forward_backward calls that ran (what the scheduler's
    token ledger counts for a call: service/scheduling/round_parts.py `offer_tokens`);
  * `last_loss`: `loss:sum` of its last forward_backward call; `curve`: (step, loss) of its newest
    `CURVE_POINTS` optimizer steps, the loss of a step being the sum of `loss:sum` over the
    forward_backward calls it applied;
  * `sample_calls`, `sampled_sequences`: sample requests (and the sequences they asked for) of the
    sampling sessions opened on its sampler checkpoints;
  * `admissions`: how often it came into a slot; `waited_grants`: slot grants to Tinker models (its
    own included) between its creation and its first slot (`SlotGrants`, one counter per scheduler).
    With first come, first served, a model that found W models waiting ahead of it waits at most
    W + 1 grants: the fairness bound of docs/concepts.md "Fair turns" counted in grants
    (ceil((W + 1) / S) turns of S slots).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

CURVE_POINTS = 64
_numbers = itertools.count(1)  # creation order in this process (the list's order and its cursor)


@dataclass
class SlotGrants:
    """Slots given to Tinker models since start (one per TinkerModels, i.e. per scheduler)."""

    count: int = 0


@dataclass
class ModelStats:
    grants: SlotGrants = field(default_factory=SlotGrants)
    number: int = field(default_factory=lambda: next(_numbers))
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    tokens_trained: int = 0
    forward_backward_calls: int = 0
    last_loss: float | None = None
    curve: tuple[tuple[int, float], ...] = ()
    sample_calls: int = 0
    sampled_sequences: int = 0
    admissions: int = 0
    first_slot_at: float | None = None
    waited_grants: int | None = None
    _grants_at_start: int = -1
    _step_loss: float = 0.0
    _step_calls: int = 0  # forward_backward calls with a loss since the last optimizer step

    def __post_init__(self) -> None:
        self._grants_at_start = self.grants.count

    def placed(self) -> None:
        """It came into a slot (on_restored: its first fill, or a swap back in)."""
        self.grants.count += 1
        self.admissions += 1
        if self.first_slot_at is None:
            self.first_slot_at = time.time()
            self.waited_grants = self.grants.count - self._grants_at_start
        self.updated_at = time.time()

    def trained(self, data: list[Any], metrics: dict[str, float]) -> None:
        """A forward_backward call of it ran (`data`: its datums; `metrics`: the call's)."""
        self.forward_backward_calls += 1
        self.tokens_trained += sum(len(d.tokens) for d in data)
        loss = metrics.get("loss:sum")
        if loss is not None and math.isfinite(loss):
            self.last_loss = float(loss)
            self._step_loss += float(loss)
            self._step_calls += 1
        self.updated_at = time.time()

    def stepped(self, step: int) -> None:
        """An optimizer step of it applied: the loss of the calls since the last one joins the curve (a
        step without such a call adds no point)."""
        if self._step_calls:
            self.curve = (*self.curve[-(CURVE_POINTS - 1):], (step, self._step_loss))
        self._step_loss, self._step_calls = 0.0, 0
        self.updated_at = time.time()

    def sampled(self, sequences: int) -> None:
        self.sample_calls += 1
        self.sampled_sequences += sequences
        self.updated_at = time.time()
