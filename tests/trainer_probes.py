"""What tests look at or hold inside a trainer, kept out of the production classes.

* ``forward_logits(trainer, ids, slot)``: full-vocab logits with one slot's LoRA on;
* ``slot_state_tensors_all_ranks(group, slot)``: every rank's gathered slot tensors
  (trainer/swap/slot_checkpoint.py ``slot_state_tensors``, run on each TrainWorker);
* ``hold_export_writes(group, held)``: the named fault injection of the export tests: while held,
  rank 0's writer starts no folder (the snapshots queue); ``hold_writer(writer, held)`` does it to
  one trainer/export/export_writer.py ``ExportWriter`` in this process;
* ``swapped(group)``: rank 0's evicted slots (keys, host bytes, spilled keys);
* ``slot_status(trainer, slot)``: a slot's status dict (active, rank, step, pending samples, ...);
* ``use_export_writer(exporter, kind, threads)``: a trainer's background exports switched to another
  writer kind on the same build (tests and benchmarks compare them).

On a Ray actor they run as functions of the test: ``worker.__ray_call__.remote(fn, ...)`` calls
``fn(worker, ...)`` on the actor; the fault hold runs in the actor's FAULT_GROUP thread, so it
reaches the rank while the default group is busy and while wait_export waits in EXPORT_GROUP.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def forward_logits(trainer, input_ids: torch.Tensor, slot: int | None) -> torch.Tensor:  # noqa: ANN001
    """Full-vocab logits [b, s, V] of the base with ``slot``'s LoRA on (None = base only)."""
    from trainer.base.base_model import attention_mask

    ids = input_ids.to(trainer.device)
    b, s = ids.shape
    if slot is not None:
        trainer.slots.state(slot)
        trainer.routing.set(torch.full((b,), slot), s, trainer.slots.scales)
    try:
        pos = torch.arange(s, device=trainer.device).unsqueeze(0).expand(b, s)
        return trainer.base.model(ids, pos, attention_mask(trainer.base, s, trainer.device), runtime_gather_output=True).float()
    finally:
        trainer.routing.disable()


def _worker_slot_state_tensors(worker, slot: int):  # noqa: ANN001, ANN202 - runs on a TrainWorker actor
    from trainer.swap.slot_checkpoint import slot_state_tensors

    return slot_state_tensors(worker.trainer, slot)


def slot_state_tensors_all_ranks(group, slot: int) -> list:  # noqa: ANN001 - a service.fleet.trainer_group.TrainerGroup
    """Every rank's optimizer and weight tensors of ``slot`` (tests compare DP ranks)."""
    import ray

    return ray.get([w.__ray_call__.remote(_worker_slot_state_tensors, slot) for w in group.workers],
                   timeout=group.call_timeout_s)


def _worker_swapped(worker) -> dict:  # noqa: ANN001 - runs on a TrainWorker actor
    return worker.trainer.swap.swapped()


def swapped(group) -> dict:  # noqa: ANN001 - a service.fleet.trainer_group.TrainerGroup
    """Rank 0's swap store (trainer/swap/slot_swap.py ``SlotSwap.swapped``): keys, host bytes, spilled keys."""
    import ray

    return ray.get(group.workers[0].__ray_call__.remote(_worker_swapped), timeout=group.call_timeout_s)


def slot_status(trainer, slot: int) -> dict:  # noqa: ANN001 - a trainer.core.MultiLoraTrainer
    """``{"slot", "active"}``, and for an occupied slot its rank, scale, step, pending_samples and
    registration (trainer/lora/slots.py ``SlotTable.status``)."""
    return trainer.slots.status(slot)


def hold_writer(writer, held: bool) -> None:  # noqa: ANN001 - a trainer.export.export_writer.ExportWriter
    """Fault injection: while held the writer's threads start no new folder (queued jobs stay queued,
    so a newer one of their key still supersedes them); released, they take the queue in order."""
    with writer._cond:  # noqa: SLF001 - the writer's one lock; its threads wait on it for `_held`
        writer._held = held  # noqa: SLF001
        writer._cond.notify_all()  # noqa: SLF001


def use_export_writer(exporter, kind: str, threads: int | None = None, *,  # noqa: ANN001 - a SlotExporter
                      max_pending_bytes: int | None = None) -> None:
    """Write the trainer's background exports with writer ``kind`` ('thread' or 'process') and
    ``threads`` (default: the config's) from now on, over the same host arena and copy stream, under a
    bound of ``max_pending_bytes`` queued bytes (default: the writer's default; tests make it small so
    that the arena is what ``size_for`` plans). Only while no export is queued or being written."""
    from trainer.export.peft_export import BackgroundExports

    threads = threads or exporter.config.export_writer_threads
    bound = {} if max_pending_bytes is None else {"max_pending_bytes": max_pending_bytes}
    with exporter._background_lock:  # noqa: SLF001 - the exporter's one lock over its background writing
        current = exporter._background  # noqa: SLF001
        exporter._background = (BackgroundExports(device=exporter.device, threads=threads, kind=kind, **bound)  # noqa: SLF001
                                if current is None else current.with_writer(kind, threads, **bound))


def _worker_hold_export_writes(worker, held: bool) -> None:  # noqa: ANN001 - runs on a TrainWorker actor
    hold_writer(worker.trainer.export.writer(), held)


def hold_export_writes(group, held: bool) -> None:  # noqa: ANN001 - a service.fleet.trainer_group.TrainerGroup
    """While held, rank 0's export writer starts no folder. Runs in the actor's FAULT_GROUP."""
    import ray

    from trainer.actor import FAULT_GROUP

    ray.get(group.workers[0].__ray_call__.options(concurrency_group=FAULT_GROUP).remote(_worker_hold_export_writes, held),
            timeout=60)


def train_batch(trainer, batch):  # noqa: ANN001, ANN201 - a TrainerGroup or TrainWorker; -> trainer.optim.slot_steps.TrainResult
    """A dataset batch alone through the trainer's one interface (a round with no Tinker work):
    what a `train(batch)` of the group or the actor was before the interface kept only rounds."""
    from trainer.rounds import RoundWork

    result = trainer.run_round(RoundWork(batch=batch))
    if result.refused is not None:
        raise ValueError(result.refused)
    return result.train
