"""What of a Tinker model survives what (issue 40): the snapshot policy, its snapshots, and the plan of
a model's restore after the service or the trainer was lost.

The policy (`tinker_durability`, environment LORAFLEET_TINKER_DURABILITY):
  * ``step``: an optim_step is acknowledged only after the model's whole slot state (weights, Adam
    moments, step) is committed in the store and recorded (service/registry/tinker_records.py D2);
    every operation's request is recorded before its id is answered, so the operations after the
    last snapshot (forward_backward included) are a write-ahead log: a restore replays them, and the
    gradient pending at a crash comes back. No acknowledged step is ever lost.
  * ``interval:<seconds>`` (default ``interval:300``): a resident model whose state changed is
    snapshotted when its last snapshot is that old; requests are recorded only while they wait (and
    at a graceful stop). After a crash a model resumes from its last snapshot; if operations ran
    after it, they are lost, and its calls are answered with an error that names the step it was
    restored to. These snapshots are written in the background (``ModelJournal.snapshot``): the
    trainer takes the state between rounds and writes it while the next rounds run; it is recorded
    once written, and until then the record names the previous snapshot, which stays whole.
A graceful stop snapshots every model (pending gradient included) whatever the policy: a restart is
then invisible.

Snapshots live in the store under the model's prefix (trainer/storage/layouts.py ``tinker_snapshot``),
one per covered operation; the previous one is deleted once the new one is recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from service.config.durability import Durability  # noqa: F401 - the policy; its home is the config
from service.tenants.tinker_ops import CHANGES_STATE
from trainer.interface import PendingWrite
from trainer.storage import layouts

log = logging.getLogger(__name__)


def snapshot_key(tenant: str, model_id: str, seq: int) -> str:
    return layouts.tinker_snapshot(tenant, model_id, seq)


@dataclass(frozen=True)
class RestorePlan:
    """What a model's restore does: the operations to replay (done before the loss: their effect is
    rebuilt, their answers stand) and those to run (never answered); or why it cannot continue."""

    replay: list  # FutureRow, in order
    run: list  # FutureRow, in order
    diverged: str | None = None


def restore_plan(model_id: str, after: list, restored_step: int, snapshot_at: float) -> RestorePlan:
    """`after`: the model's operations after its snapshot (FutureRow, in seq order; `kind` names the
    operation). Done ones are replayed when their requests were logged (policy step); a done one that
    changed the state (CHANGES_STATE) and was not logged means the model diverged: the snapshot lacks
    its effect and nothing can rebuild it. Done ones that changed nothing need no replay."""
    done = [f for f in after if f.state == "done" and (f.request is not None or f.kind in CHANGES_STATE)]
    pending = [f for f in after if f.state != "done"]
    lost = [f for f in done if f.request is None]
    if lost:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snapshot_at))
        return RestorePlan([], pending, diverged=(
            f"model {model_id} was restored to step {restored_step}, its last durable state (saved {when}), after the service "
            f"stopped unexpectedly: the {len(lost)} call(s) it answered after that are lost. Continue from a checkpoint "
            "(load_state / create_training_client_from_state), or run the service with tinker_durability: step, under which "
            "no acknowledged step is ever lost"))
    return RestorePlan(done, pending)


@dataclass
class SnapshotCounts:
    """Every model's snapshots since start (TinkerModels owns one; /metrics): how many were taken, how
    many recorded and failed, the loop's time taking them (what a snapshot holds up: the whole write
    for a waiting one, the state's gathering for a background one), and the time from taking to
    recording a background one."""

    taken: int = 0
    recorded: int = 0
    failed: int = 0
    loop_seconds: float = 0.0
    background_seconds: float = 0.0


@dataclass
class Writing:
    """A snapshot the trainer is writing in the background: recorded once `pending` is done."""

    pending: PendingWrite
    url: str
    covers: int
    step: int
    taken_at: float  # when its state was taken (the policy's clock counts from then)


class ModelJournal:
    """One model's durability companion: its operations' order and requests in the records, its
    snapshots in the store (module doc). Called on the scheduler's thread, except `log` (any thread)."""

    def __init__(self, records, store, durability: Durability, tenant: str, model_id: str,  # noqa: ANN001 - TinkerRecords, CheckpointStore
                 snapshot: str | None = None, snapshot_at: float | None = None, counts: SnapshotCounts | None = None) -> None:
        self.records = records
        self.store = store
        self.durability = durability
        self.tenant = tenant
        self.model_id = model_id
        self.snapshot_ref = snapshot  # the store reference of the last snapshot (None: the seeded init)
        self.snapshot_at = time.time() if snapshot_at is None else snapshot_at
        self.writing: Writing | None = None  # a snapshot the trainer writes in the background (snapshot)
        self.counts = counts if counts is not None else SnapshotCounts()

    @property
    def snapshot_prefix(self) -> str:
        """The model's own prefix in the store (its snapshots and scratch folders)."""
        return layouts.tinker_run(self.tenant, self.model_id)

    def next_seq(self) -> int:
        return self.records.next_seq()

    def log(self, op) -> None:  # noqa: ANN001 - a TinkerOp
        """The operation's place and name, and under policy step its request (before its id is
        answered: the face waits for the records), recorded."""
        if op.request_id is None:
            return
        self.records.set_order(op.request_id, op.seq, op.name)
        if self.durability.logs_requests:
            request = op.request()
            if request is not None:
                self.records.set_request(op.request_id, op.seq, request)

    def persist(self, ops: list) -> None:
        """Requests of operations still waiting (a graceful stop: they run after the restart)."""
        for op in ops:
            request = op.request() if op.request_id is not None else None
            if request is not None:
                self.records.set_request(op.request_id, op.seq, request)

    def snapshot(self, trainer, slot: int, covers: int, step: int, *, background: bool = False) -> str:  # noqa: ANN001 - TrainerInterface
        """The slot's whole state committed in the store, then recorded (D2); the previous snapshot goes.
        `background` (the interval policy's periodic snapshot): the trainer takes the state now and
        writes it while the rounds go on (`writing`); it is recorded, and the previous one deleted,
        when `settle` finds it written. Until then the record names the previous snapshot, which
        stays whole, so a crash meanwhile restores from it as if this one had not begun.
        A snapshot that waits (a graceful stop's, policy step's) first settles one being written."""
        self.settle(block=True)
        t0 = time.perf_counter()
        key = snapshot_key(self.tenant, self.model_id, covers)
        url = self.store.url(key)
        self.store.delete(key)  # a snapshot of the same operation cut short before
        self.counts.taken += 1
        try:
            if background:
                self.writing = Writing(trainer.begin_save_slot_state(slot, url), url, covers, step, time.time())
                return url
            taken_at = time.time()
            trainer.save_slot_state(slot, url)
            self._record(url, covers, step, taken_at)
            return url
        finally:
            self.counts.loop_seconds += time.perf_counter() - t0

    def settle(self, block: bool = False) -> bool | None:
        """The snapshot being written, if it has ended (or `block`: once it ends): True when it was
        committed and is now recorded; False when it failed (logged; the previous one stands, and
        the model is dirty again); None when there is none or it is still being written."""
        w = self.writing
        if w is None or not (block or w.pending.done()):
            return None
        self.writing = None
        try:
            w.pending.result()
        except Exception as e:  # noqa: BLE001 - the trainer's write failed, or the trainer was lost
            log.warning("Tinker model %s: its snapshot %s failed (%s: %s); the previous one stands", self.model_id,
                        w.url, type(e).__name__, e)
            self.counts.failed += 1
            return False
        self._record(w.url, w.covers, w.step, w.taken_at)
        self.counts.background_seconds += time.time() - w.taken_at
        return True

    def forget_writing(self) -> None:
        """The trainer was lost, or the model ended: a snapshot being written is never recorded."""
        self.writing = None

    def _record(self, url: str, covers: int, step: int, taken_at: float) -> None:
        self.records.set_snapshot(self.model_id, url, covers, step).wait()
        self.counts.recorded += 1
        old, self.snapshot_ref, self.snapshot_at = self.snapshot_ref, url, taken_at
        if old is not None and old != url:
            self.store.delete(self.store.key_of(old))

    def due(self, now: float) -> bool:
        """A snapshot is due (the policy), and none is being written."""
        return self.writing is None and self.durability.due(self.snapshot_at, now)

    def end(self) -> None:
        self.forget_writing()
        self.records.end_model(self.model_id)
        self.records.flush()
