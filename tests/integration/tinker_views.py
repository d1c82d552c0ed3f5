"""What the Tinker tests read of a TinkerService's models on the trainer side: the scheduler's slot
record (service/scheduling/scheduler.py) and the trainer it drives. Reads only; nothing here changes state."""

from __future__ import annotations

from typing import Any


def scheduler(svc: Any) -> Any:
    return svc.fleet.scheduler


def trainer(svc: Any) -> Any:
    """The trainer handle the scheduler drives (a TrainerGroup, or a TrainWorker over an in-process trainer)."""
    return svc.fleet.scheduler.trainer


def core(svc: Any) -> Any:
    """The in-process trainer itself (trainer.core.MultiLoraTrainer) of a Tinker-only host."""
    return svc.host.trainer


def slot_of(svc: Any, model_id: str) -> int | None:
    """The model's slot, or None while it is evicted (or gone)."""
    return scheduler(svc).slot_of(model_id)


def resident(svc: Any) -> set[str]:
    return {m.key for m in svc.fleet.models() if slot_of(svc, m.key) is not None}


def evicted(svc: Any) -> set[str]:
    """Models swapped out of their slot (their state in the trainer's swap store)."""
    return {m.key for m in svc.fleet.models()} - resident(svc)


def waiting(svc: Any) -> set[str]:
    """Models whose queued calls wait for a slot (their futures answer try_again, paused_capacity)."""
    return {m.key for m in svc.fleet.models() if m.waiting_reason is not None}
