"""Tenants: everything that holds a trainer slot, behind one interface.

Kinds (``TenantKind``): an RL run and an SFT run (dataset-driven, registered over REST or
by a job file: service/tenants/runs.py) and a Tinker model (tenant-driven, created over the
Tinker wire protocol: service/tenants/tinker_model.py). The scheduler (service/scheduling/scheduler.py) knows
tenants only through this interface; what differs by kind lives in the kind.

A tenant, each round it holds a slot:
  * ``ready()``: whether it has work for the next round now (RL: a whole step of groups
    staged; SFT: a step of rows; Tinker: a queued operation). Never blocks.
  * ``offer(slot)``: its part of the round (an ``Offer``): dataset samples stamped with the
    slot and its registration id, Tinker forward/forward_backward calls, an optimizer step,
    or one operation that runs alone (save, load, unload).
  * ``settle(offer, result, slot, ctx)``: the round's answer for it; ``give_back(offer,
    error)`` when the round failed before it ran (nothing it offered is lost: rows and
    groups go back, calls get the error).
And across rounds: ``idle_s`` / ``last_active`` / ``steps_in`` for the residency policy
(service/scheduling/residency.py), ``wants_slot()`` while it is evicted, ``on_evicting(slot)`` /
``on_evicted()`` / ``on_restored()`` around a swap, and ``release()`` when it ends.

Invariants the scheduler keeps for every tenant (docs/design.md "The scheduler"):
  T1 a tenant is offered a round only while it holds a slot, and its offer names that slot;
  T2 nothing a tenant offered counts as done before the round that carried it returned;
  T3 a tenant's own work runs in the order it became ready (a Tinker model's operations in
     the order they were sent).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Protocol, runtime_checkable

from trainer.batch import TrainSample
from trainer.rounds import AdamStep, Call


class TenantKind(StrEnum):
    RL = "rl"
    SFT = "sft"
    TINKER = "tinker"


@dataclass
class SlotOp:
    """An operation of one tenant that runs alone, after the round's trainer call:
    ``run(slot)`` with the tenant's slot (None when it needs none, e.g. unloading an
    evicted model); its result or exception goes to ``done``."""

    run: Callable[[int | None], Any]
    needs_slot: bool = True


@dataclass
class Offer:
    """One tenant's part of a round. ``context`` is the tenant's own (what it settles against)."""

    samples: list[TrainSample] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)  # forward_backward (gradients accumulate)
    forwards: list[Call] = field(default_factory=list)  # forward only
    optim: AdamStep | None = None  # after the pass (Tinker); at most one per tenant per round
    single: SlotOp | None = None  # runs alone after the trainer call; then nothing else of this tenant
    context: Any = None

    @property
    def trains(self) -> bool:
        """Whether it puts anything in the round's one trainer call."""
        return bool(self.samples or self.calls or self.forwards or self.optim is not None)


class RoundContext(Protocol):
    """What settling may need that is cheaper fetched once per round for every tenant."""

    def rollout_stats(self, name: str) -> Any: ...


@runtime_checkable
class Tenant(Protocol):
    key: str  # registration id (runs) or model id (Tinker): its trainer slot's registration, its swap key
    name: str
    kind: TenantKind
    owner: str | None  # the tenant (API key) it belongs to; None = the admin
    steps_in: int  # optimizer steps since it last came into a slot (turns)
    last_active: float  # monotonic time of its last work or arrival in a slot (LRU)

    def expects_work(self) -> bool:
        """Whether a round should wait (up to its bound) for this tenant's next step: a dataset
        run's steps come steadily; a Tinker model's calls come when its client sends them."""

    def ready(self) -> bool: ...

    def wants_slot(self) -> bool:
        """While evicted: whether it has work waiting for a slot."""

    def slot_wait(self) -> float | None:
        """A Tinker model, while evicted: since when (time.time()) it wants a slot, None when it wants
        none; orders it among the waiting runs of the registry's queue (queued_at), one FIFO across
        kinds. (A run's place is its queue entry.)"""

    def waiting_for_slot(self, reason: str) -> None:
        """It waits for a slot (placement found none): why, for its callers."""

    def offer(self, slot: int) -> Offer | None: ...

    def settle(self, offer: Offer, result: Any, slot: int, ctx: RoundContext) -> Any:
        """``result``: trainer.rounds.RoundResult. Returns what the loop commits (dataset runs:
        a service.tenants.batches.SteppedRun, or None), or None."""

    def give_back(self, offer: Offer, error: str, retry: bool = False) -> None:
        """The round failed before it ran: nothing it offered counts (T2). `retry`: the trainer was
        lost and is restarted; what it offered runs again once it is back (no error to its callers)."""

    def settle_single(self, offer: Offer, value: Any, error: BaseException | None) -> None:
        """The outcome of the operation its offer ran alone (`Offer.single`; Tinker models)."""

    def on_evicting(self, slot: int) -> None:
        """Its last look at `slot` before the swap-out takes its state (a Tinker model: its policy's
        snapshot when due); it raises nothing (what fails here is tried again later)."""

    def on_evicted(self) -> None: ...

    def on_restored(self) -> None: ...

    def restore_from(self) -> Callable[[int], Any] | None:
        """How to fill its slot when its state is not in the trainer's swap store (a Tinker model revived
        from its durable snapshot, or created: its seeded init); None: swap it in."""

    def durable(self) -> bool:
        """Whether its state needs no save at stop (it is in durable storage as it is)."""

    def release(self, reason: str | None = None) -> None:
        """It ends (retired, failed, unloaded, or lost with the trainer: ``reason`` says which)."""


def now() -> float:
    return time.monotonic()
