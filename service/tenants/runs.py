"""The dataset-driven tenants: `RlRun` and `SftRun` (registered over REST or by a job file).

Each is the one object that holds a prepared run's coordinator-side state (the registry
holds what outlives the process): its step, samples trained, newest weight version, the
data it has taken but not yet trained on, and its residency counters. What differs by
objective lives in the kind:
  * an RL run generates through the rollout worker, which owns its data source; groups it
    pops wait in `staged` until a whole step (prompts_per_step groups) is there, so the
    trainer only ever gets whole steps;
  * an SFT run reads its own `SftSource` here (no rollout).

Invariants (FleetRuntime's I2-I4, now the kinds'):
  R1 an offer holds exactly one whole step, stamped with the run's registration id (the
     trainer drops any sample of another tenant of the slot);
  R2 data counts as trained only after the round that used it returned: SFT rows are
     committed at settle and given back when the round failed; RL groups are dropped from
     `staged` at settle and stay staged when it failed;
  R3 a checkpoint's data cursor lists every row not yet trained on (the rollout's pending
     rows plus the staged groups' rows), so a resume redoes nothing and skips nothing.
  R4 an evicted run keeps its staged groups / SFT cursor here; an evicted RL run keeps
     generating (its weights do not change while out, so its groups stay fresh) until the
     rollout worker's per-adapter buffer is full; a whole step staged is its signal that it
     wants a slot.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from rollout.data import DataCursor
from rollout.groups import RolloutGroup
from rollout.messages import AdapterStats
from service.tenants.batches import RunFailed, StepPlan, SteppedRun, rl_step
from service.config.adapter import AdapterConfig
from service.tenants.sft_source import SftSource
from service.scheduling.tenant import Offer, RoundContext, TenantKind, now

log = logging.getLogger(__name__)

FAIL_AFTER_BAD_STEPS = 3  # consecutive non-finite steps, or steps whose every reward failed -> FAILED


@dataclass
class DatasetRun:
    """What RL and SFT runs share: identity, progress, and how a trained step is settled."""

    name: str
    key: str  # the registration id
    config: AdapterConfig
    total_steps: int | None
    step: int  # optimizer steps the trainer slot has taken
    samples_trained: int
    weight_version: int
    owner: str | None = None
    bad_steps: int = 0
    publish_failures: int = 0  # failed publishes in a row
    last_metrics: dict[str, float] = field(default_factory=dict)
    steps_in: int = 0  # steps since it last came into a slot (turns)
    last_active: float = field(default_factory=now)
    waiting_reason: str | None = None  # while evicted and wanting a slot: why it waits (the scheduler's)

    kind = TenantKind.SFT

    @property
    def registration_id(self) -> str:
        return self.key

    @property
    def is_rl(self) -> bool:
        return self.kind == TenantKind.RL

    def expects_work(self) -> bool:
        return True

    def waiting_for_slot(self, reason: str) -> None:
        self.waiting_reason = reason

    def on_evicting(self, slot: int) -> None:
        pass  # its checkpoints are the publishes' and the retirement's (the swap store keeps its state)

    def on_evicted(self) -> None:
        pass  # its state stays here as it is (R4); the registry's queue orders it among the waiters

    def on_restored(self) -> None:
        self.waiting_reason = None
        self.steps_in, self.last_active = 0, now()

    def restore_from(self) -> None:
        """A run is swapped back in (its state in the swap store) or prepared anew by the controller."""
        return None

    def durable(self) -> bool:
        return False  # its state since its last checkpoint lives in its slot: saved at stop

    def budget_used(self) -> bool:
        return self.config.num_step is not None and self.step >= self.config.num_step

    def settle(self, offer: Offer, result: Any, slot: int, ctx: RoundContext) -> SteppedRun | RunFailed | None:
        """The round trained this run's step (R2): its progress and what the loop commits."""
        plan: StepPlan = offer.context
        self._consume()
        train = result.train
        metrics = train.slots.get(slot) if train is not None else None
        reports = metrics.steps if metrics is not None else []
        if train is None or slot in train.skipped_nonfinite or not reports:
            self.bad_steps += 1
            if self.bad_steps >= FAIL_AFTER_BAD_STEPS:
                return RunFailed(self.key, f"{self.bad_steps} consecutive steps with a non-finite loss or gradient "
                                           f"(last at step {self.step + 1})")
            return None
        failure = None  # a step whose every reward failed was still trained (each advantage 0): it counts
        if self.is_rl and plan.reward_failures == plan.samples:
            self.bad_steps += 1
            if self.bad_steps >= FAIL_AFTER_BAD_STEPS:
                failure = f"the reward failed on every sample of {self.bad_steps} consecutive steps"
        else:
            self.bad_steps = 0
        report = reports[-1]
        self.step = report.step
        self.steps_in += 1
        self.last_active = now()
        self.samples_trained += plan.samples
        # The API shows these keys by name (last reward / loss, the metrics series) and /metrics
        # exports them; any other float-valued key is stored and shown too.
        m = {"loss": report.loss, "learning_rate": report.lr, "grad_norm": report.grad_norm, "train_seconds": ctx.seconds,
             "tokens": float(metrics.loss_tokens)}  # this call's loss tokens of the slot (dashboard: tokens / s)
        m.update(self._kind_metrics(metrics, ctx))
        if plan.reward_mean is not None:
            m["reward_mean"] = plan.reward_mean
        if plan.staleness_mean is not None:
            m["staleness_mean"] = plan.staleness_mean
        if plan.version_min is not None:
            m["sample_version_min"] = plan.version_min
        m.update(plan.metrics)  # the kind's own per-step metrics (RL: turns_mean, env_token_share)
        # Samples of another tenant of the slot: dropped by the trainer / refused here (both must stay 0).
        m["foreign_samples_dropped"] = train.dropped_foreign.get(slot, 0) + self.foreign_groups()
        self.last_metrics = m
        interval = self.config.checkpoint_interval
        return SteppedRun(self.key, self.name, self.step, plan.samples, m, exhausted=failure is None and self.exhausted(ctx),
                          due_checkpoint=interval > 0 and self.step % interval == 0, failure=failure)

    def finite_metrics(self) -> dict[str, float]:
        return {k: v for k, v in self.last_metrics.items() if math.isfinite(v)}

    # the kind's part ---------------------------------------------------------------------------------

    def _consume(self) -> None:
        raise NotImplementedError

    def _kind_metrics(self, metrics: Any, ctx: RoundContext) -> dict[str, float]:
        raise NotImplementedError

    def foreign_groups(self) -> int:
        return 0

    def exhausted(self, ctx: RoundContext | None = None) -> bool:
        raise NotImplementedError


@dataclass
class SftRun(DatasetRun):
    sft: SftSource | None = None
    in_flight: list | None = None  # rows of the round in progress (committed or given back after it, R2)
    _ready: tuple[list, list] | None = None  # a step taken from the source, not yet offered

    kind = TenantKind.SFT

    def ready(self) -> bool:
        if self._ready is None and not self.budget_used():
            self._ready = self.sft.take_step()
        return self._ready is not None

    def wants_slot(self) -> bool:
        return not self.sft.exhausted and not self.budget_used()

    def offer(self, slot: int) -> Offer | None:
        if not self.ready():
            return None
        rows, samples = self._ready
        self._ready = None
        self.in_flight = rows
        samples = [s if s.slot == slot else s.model_copy(update={"slot": slot}) for s in samples]
        return Offer(samples=samples, context=StepPlan(self.key, len(samples), None, None, 0))

    def give_back(self, offer: Offer, error: str, retry: bool = False) -> None:
        if self.in_flight is not None:
            self.sft.give_back(self.in_flight)
            self.in_flight = None

    def release(self, reason: str | None = None) -> None:
        if self._ready is not None:  # taken, never offered: back to the source before it closes
            self.sft.give_back(self._ready[0])
            self._ready = None
        self.sft.source.close()

    def _consume(self) -> None:
        if self.in_flight is not None:
            self.sft.commit(self.in_flight)
            self.in_flight = None

    def _kind_metrics(self, metrics: Any, ctx: RoundContext) -> dict[str, float]:
        return self.sft.skip_metrics()

    def exhausted(self, ctx: RoundContext | None = None) -> bool:
        return self.budget_used() or self.sft.exhausted

    def fatal_reason(self) -> str | None:
        return self.sft.failure_reason

    def cursor(self) -> DataCursor:
        if self._ready is not None:  # taken for a round that has not run: not trained (R3)
            self.sft.give_back(self._ready[0])
            self._ready = None
        return self.sft.cursor()


@dataclass
class RlRun(DatasetRun):
    rollout: Any = None  # service.fleet.rollout_client.RolloutClient
    staged: list[RolloutGroup] = field(default_factory=list)  # popped, waiting for a whole step (R4)
    foreign: int = 0  # groups of another registration seen at collection (must stay 0)

    kind = TenantKind.RL

    @property
    def groups_per_step(self) -> int:
        return self.config.prompts_per_step

    def _stage(self) -> None:
        need = self.groups_per_step - len(self.staged)
        if need > 0:
            for g in self.rollout.pop_groups(self.name, need):
                if g.registration_id == self.key:
                    self.staged.append(g)
                else:  # the rollout buffer refuses these already; a second line of defence
                    self.foreign += 1

    def ready(self) -> bool:
        if self.budget_used():
            return False
        self._stage()
        return len(self.staged) >= self.groups_per_step

    def wants_slot(self) -> bool:
        return self.ready()

    def offer(self, slot: int) -> Offer | None:
        if not self.ready():
            return None
        samples, plan = rl_step(slot, self.key, self.staged[: self.groups_per_step])
        return Offer(samples=samples, context=plan)

    def give_back(self, offer: Offer, error: str, retry: bool = False) -> None:
        """The groups stay staged (R2): the next round offers them again."""

    def release(self, reason: str | None = None) -> None:
        self.staged.clear()

    def _consume(self) -> None:
        del self.staged[: self.groups_per_step]

    def foreign_groups(self) -> int:
        return self.foreign

    def _stats(self, ctx: RoundContext | None) -> AdapterStats | None:
        stats = ctx.rollout_stats(self.name) if ctx is not None else None
        if stats is None or stats.registration_id != self.key:
            stats = self.rollout.stats(self.name)
        return stats if stats.registration_id == self.key else None

    def _kind_metrics(self, metrics: Any, ctx: RoundContext) -> dict[str, float]:
        out = {"kl_mean": metrics.kl_mean}
        stats = ctx.rollout_stats(self.name)
        if stats is not None and stats.registration_id == self.key:
            out.update(stats.step_metrics())
        return out

    def data_done(self, ctx: RoundContext | None = None) -> bool:
        """Its rollout has nothing left to give: data used up, nothing buffered or generating."""
        s = self._stats(ctx)
        return s is not None and s.data.exhausted and s.buffered_groups == 0 and s.inflight_groups == 0

    def exhausted(self, ctx: RoundContext | None = None) -> bool:
        if self.budget_used():
            return True
        return not self.staged and self.data_done(ctx)

    def drop_tail(self) -> bool:
        """Data used up with fewer groups staged than a step needs: that tail is dropped (SFT does
        the same in SftSource.take_step), so the run ends at its planned total. True if dropped."""
        if self.staged and not self.budget_used() and len(self.staged) < self.groups_per_step and self.data_done():
            log.info("%s: data used up; dropping a tail of %d group(s), less than a step", self.name, len(self.staged))
            self.staged.clear()
            return True
        return False

    def cursor(self) -> DataCursor:
        cursor: DataCursor = self.rollout.data_cursor(self.name)
        staged = [(g.prompt_index, g.epoch) for g in self.staged]  # popped (consumed) but not trained: R3
        return cursor.model_copy(update={"pending": staged + list(cursor.pending), "consumed": cursor.consumed - len(staged)})
