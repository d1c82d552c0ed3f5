"""A Tinker model as a tenant: `TinkerModel`, its operations queued in the order its client sent them.

The Tinker face (api/tinker/) turns each request into one operation on the model's queue
(`forward_backward`, `forward`, `optim_step`, `save_state`, `save_sampler_weights`,
`load_state`, `unload`) with a `done(value, error)` callback, and returns the future's id;
the scheduler (service/scheduling/scheduler.py) runs the operations in rounds on the loop's thread and
calls `done` there. Nothing here knows HTTP.

What a model offers a round (`offer`), from the head of its queue:
  * a snapshot, when its durability policy says one is due (service/tenants/tinker_durability.py;
    one due when it is evicted is taken then: M7);
  * the run of forward_backward / forward calls at the head (all go into the round's ONE
    mixed step: calls of different models pending together share it), then at most one
    optim_step after them (applied after the pass, so the calls before it see the weights
    before it, and the calls after it wait for the next round); or
  * one operation that runs alone (save, load, unload), when that is the head.
So a model's operations run in the order it sent them (T3): an optim_step is never overtaken
by a later forward_backward, nor runs before an earlier one.

Invariants:
  M1 losses are sums and gradients accumulate across forward_backward calls until optim_step
     (trainer/step/round_runner.py); bad input fails only its own call and changes nothing;
  M2 a cancelled operation (its future answered "cancelled" meanwhile) is dropped unrun;
  M3 while the model is evicted its operations wait in its queue, in order, and `waiting_reason`
     says why (the future answers try_again with it); `unload` never waits for a slot;
  M4 a failed load_state leaves the model as it was (its state is saved before and restored);
  M5 every operation takes a sequence number in queue order; `applied_seq` is the last one whose
     effect is in the slot, and a snapshot covers exactly that (its journal records both);
  M6 a model whose slot state was lost (the service or its trainer) comes back from its last
     snapshot, replaying the operations its journal logged after it; when some cannot be replayed
     it has diverged, and every call is answered with why and from which step it could continue;
  M7 a snapshot its policy makes due is taken as it leaves its slot (`on_evicting`) or, while it
     stays resident, as its next offer; either way it covers what ran before it (M5). While other
     tenants wait for a slot (its residency ends at its turn's end) the offer leaves it to the
     eviction, unless its oldest change not in a snapshot is older than the policy's interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from service.errors import ServiceStopping
from service.scheduling.tenant import Offer, RoundContext, SlotOp, TenantKind
from service.tenants.tinker_durability import ModelJournal, restore_plan
from service.tenants.tinker_lora import LoraSpec, checkpoint_lora
from service.tenants.tinker_ops import Done, OpKind, TinkerOp, _no_answer, data_request, decode_adam, decode_data, optim_request
from service.tenants.tinker_stats import ModelStats
from trainer.config import SlotHyperParams
from trainer.interface import TrainerInterface
from trainer.rounds import AdamStep, Call, Datum
from trainer.storage.locations import readable_folder
from trainer.storage.slot_state_format import META

log = logging.getLogger(__name__)

__all__ = ["OpKind", "TinkerModel", "TinkerOp"]


RESTORE_TRIES = 3  # placements that may fail to read a model's durable state before its calls are told (M6)


class TinkerModel:
    kind = TenantKind.TINKER

    def __init__(self, model_id: str, owner: str, lora: LoraSpec, *, trainer: TrainerInterface, clock: Callable[[], float],
                 wake: Callable[[], None], end: Callable[[str], None], hyper: SlotHyperParams, journal: ModelJournal,
                 stats: ModelStats | None = None, contended: Callable[[], bool] = lambda: False) -> None:
        """`trainer`: the scheduler's trainer; `wake()`: the scheduler's notify; `end(key)`: the
        scheduler's release (unload); `hyper`: its slot's hyper-parameters (init and restore);
        `journal`: its durability (its records and snapshots); `stats`: what it did, for the views;
        `contended()`: whether other tenants wait for a slot (the scheduler's last placement; M7)."""
        self.key = self.name = model_id
        self.owner = owner
        self.lora = lora
        self.hyper = hyper
        self.journal = journal
        self._trainer = trainer
        self._clock = clock
        self._wake = wake
        self._end = end
        self._contended = contended
        self._queue: deque[TinkerOp] = deque()
        self._mu = threading.Lock()  # the API's threads append, the loop's thread takes
        self.steps_in = 0
        self.last_active = clock()
        self.waiting_reason: str | None = None  # M3
        self.ended = False
        self.end_reason = f"model {model_id} is unloaded"  # what a call sent after its end is told
        self.applied_seq = 0  # M5
        self.step = 0  # optimizer steps applied (what a snapshot records)
        self._dirty_since: float | None = None  # time.time() of its first change since its last snapshot (`dirty`)
        self.diverged: str | None = None  # M6
        self._restore: Callable[[int], Any] | None = None  # fills its slot when its state is not in the swap store
        self.closing = False  # the service saves its state for a restart: nothing more is queued
        self.stats = stats or ModelStats()  # service/tenants/tinker_stats.py
        self._evicted_at = 0.0  # time.time() of its last eviction: it began to wait then (slot_wait)
        self._touch: Callable[[str], None] = lambda key: None  # the scheduler's wait index (watch)

    @property
    def dirty(self) -> bool:  # changed since its last snapshot
        return self._dirty_since is not None

    @dirty.setter
    def dirty(self, value: bool) -> None:  # keeps the time of its first change
        self._dirty_since = (self._dirty_since or time.time()) if value else None

    def watch(self, touch: Callable[[str], None]) -> None:
        """`touch(key)` at each change of its queue and at its eviction (service/scheduling/wait_index.py W1)."""
        self._touch = touch
        touch(self.key)

    def changed(self) -> None:
        """Any thread: its queue changed (a call queued, taken, given back or cancelled): W1."""
        self._touch(self.key)

    # --- what the Tinker face calls (any thread) ------------------------------------------------

    def submit(self, op: TinkerOp) -> None:
        """Queue `op` (M5). ServiceStopping when the service is saving its state for a restart: the
        caller answers a retryable refusal, and the client's retry reaches the restarted service."""
        if self.closing:
            raise ServiceStopping("the service is restarting; send the request again (it is served after the restart)")
        if self.ended or self.diverged is not None:
            op.done(None, ValueError(self.diverged or self.end_reason))
            return
        with self._mu:
            op.seq = self.journal.next_seq()
            self._queue.append(op)
            self.journal.log(op)  # M5; under the lock: requests are recorded in queue order
        self.changed()
        self._wake()

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, done: Done,
                         custom_loss: dict | None = None, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.FORWARD_BACKWARD, done, data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                             custom_loss=custom_loss,
                             request=lambda: data_request(OpKind.FORWARD_BACKWARD, data, loss_fn, loss_fn_config, custom_loss), **kw))

    def forward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, done: Done,
                custom_loss: dict | None = None, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.FORWARD, done, data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                             custom_loss=custom_loss,
                             request=lambda: data_request(OpKind.FORWARD, data, loss_fn, loss_fn_config, custom_loss), **kw))

    def optim_step(self, adam: AdamStep, done: Done, **kw: Any) -> None:
        adam.check()  # refused now (ValueError), before it is queued
        self.submit(TinkerOp(OpKind.OPTIM, done, adam=adam, request=lambda: optim_request(adam), **kw))

    def save_state(self, folder: str, done: Done, *, answer: dict | None = None, **kw: Any) -> None:
        """`folder`: a store reference (trainer/storage/layouts.py tinker_checkpoint)."""
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._trainer.save_slot_state(slot, self._new_folder(folder)),
                             request=lambda: {"kind": "save_state", "folder": folder, "answer": answer}, **kw))

    def save_sampler_weights(self, folder: str, done: Done, *, answer: dict | None = None, durable: bool = True, **kw: Any) -> None:
        # durable=False: the SDK's ephemeral weights, committed without waiting for the disk (trainer/storage/store.py S5)
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._trainer.export_peft(slot, self._new_folder(folder), durable=durable),
                             request=lambda: {"kind": "save_sampler_weights", "folder": folder, "answer": answer, "durable": durable}, **kw))

    def export_with(self, write: Callable[[Callable[[str], str]], Any], done: Done, **kw: Any) -> None:
        """`write(export)` on the scheduler's thread, where `export(to)` writes the model's PEFT folder
        to the store reference `to` (the Tinker face's external weights). Not replayed after a restart
        (its request is not recorded: the face's encryption key is not kept)."""
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: write(lambda to: self._trainer.export_peft(slot, str(to))), **kw))

    def load_state(self, folder: str, optimizer: bool, done: Done, *, answer: dict | None = None, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._load(slot, folder, optimizer),
                             request=lambda: {"kind": "load_state", "folder": folder, "optimizer": optimizer, "answer": answer},
                             **kw))

    def unload(self, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._end(self.key), needs_slot=False,
                             request=lambda: {"kind": "unload"}, **kw))

    # --- the tenant interface (the scheduler, on the loop's thread) ------------------------------

    def expects_work(self) -> bool:
        return False  # its calls come when its client sends them: a round never waits for them

    def _head(self) -> TinkerOp | None:
        """The first operation not cancelled (M2: cancelled ones are answered already; dropped)."""
        with self._mu:
            while self._queue and self._queue[0].cancelled():
                self._queue.popleft()
            return self._queue[0] if self._queue else None

    def _snapshot_due(self) -> bool:
        return self.dirty and self.journal.due(time.time())

    def _snapshot_now(self) -> bool:
        """M7: a due snapshot as its next offer, or left to its eviction at its turn's end."""
        return self._snapshot_due() and (not self._contended() or time.time() - self._dirty_since >= self.journal.durability.interval_s)

    def ready(self) -> bool:
        self._settle_snapshot()  # a resident with no calls is asked this, not offer, while it idles
        return self._head() is not None or self._snapshot_now()

    def wants_slot(self) -> bool:
        return self.slot_wait() is not None

    def slot_wait(self) -> float | None:
        """When its head call needs a slot: that call's arrival, or its eviction when later (an evicted
        model joins the end of the queue, docs/concepts.md "Fair turns", behind those that began to
        wait while it held its slot); else None. One look at its head (the placement asks this of
        every evicted model, so once each: service/scheduling/slot_moves.py)."""
        head = self._head()
        return max(head.queued_at, self._evicted_at) if head is not None and head.needs_slot else None

    def waiting_for_slot(self, reason: str) -> None:
        self.waiting_reason = reason

    def offer(self, slot: int) -> Offer | None:
        self._settle_snapshot()
        if self._snapshot_now():  # its policy's snapshot first: it covers what ran before (M5); written
            return Offer(single=SlotOp(lambda s: self.snapshot(s, background=True)), context=[])  # while rounds go on
        taken: list[TinkerOp] = []
        with self._mu:
            while self._queue and self._queue[0].kind in (OpKind.FORWARD_BACKWARD, OpKind.FORWARD):
                op = self._queue.popleft()
                if not op.cancelled():
                    taken.append(op)
            if self._queue and self._queue[0].kind == OpKind.OPTIM:
                taken.append(self._queue.popleft())
            elif not taken and self._queue and self._queue[0].kind == OpKind.ALONE:
                op = self._queue.popleft()
                return Offer(single=SlotOp(op.run, op.needs_slot), context=[op])
        if not taken:
            return None
        try:
            calls = [Call(slot, op.data, op.loss_fn, op.loss_fn_config, op.custom_loss) for op in taken
                     if op.kind == OpKind.FORWARD_BACKWARD]
            forwards = [Call(slot, op.data, op.loss_fn, op.loss_fn_config, op.custom_loss) for op in taken if op.kind == OpKind.FORWARD]
        except Exception as e:  # taken off the queue: answered (a fault here must not leave a client waiting)
            for op in taken:
                self._answer(op, None, RuntimeError(f"the service could not run this call: {type(e).__name__}: {e}"))
            raise
        optim = next((op.adam for op in taken if op.kind == OpKind.OPTIM), None)
        return Offer(calls=calls, forwards=forwards, optim=optim, context=taken)

    def offer_unplaced(self) -> Offer | None:
        """While evicted: the head operation if it needs no slot (unload), taken. The loop asks the
        evicted models that changed since its last look (service/scheduling/wait_index.py W3), so a model
        whose head needs a slot (or that has none) answers from a look without the lock (reading a
        deque's first item is atomic). A look that raced a change only answers None: the change touches
        it after it is made, and the unload runs a round later; what is taken is decided under the lock."""
        self._settle_snapshot()
        try:
            if self._queue[0].needs_slot:
                return None
        except IndexError:  # empty
            return None
        with self._mu:
            if self._queue and self._queue[0].kind == OpKind.ALONE and not self._queue[0].needs_slot:
                op = self._queue.popleft()
                self.changed()  # what follows it may need a slot
                return Offer(single=SlotOp(op.run, needs_slot=False), context=[op])
        return None

    @property
    def writing_snapshot(self) -> bool:  # recorded when `_settle_snapshot` finds it written
        return self.journal.writing is not None

    def settle(self, offer: Offer, part: Any, slot: int, ctx: RoundContext) -> None:
        calls, forwards = iter(part.calls), iter(part.forwards)
        answers: list[tuple[TinkerOp, Any, BaseException | None]] = []  # given once its step is durable (below)
        for op in offer.context:
            self.applied_seq = op.seq
            if op.kind == OpKind.FORWARD_BACKWARD:
                result = next(calls)
                self.dirty = self.dirty or result.error is None
                if result.error is None and not op.replay:
                    self.stats.trained(op.data, result.metrics)
                answers.append((op, result, None))
            elif op.kind == OpKind.FORWARD:
                answers.append((op, next(forwards), None))
            elif op.kind == OpKind.OPTIM:
                if isinstance(part.optim, dict):
                    self.steps_in += 1
                    self.step += 1
                    self.dirty = True
                    self.stats.stepped(self.step)
                    if self.journal.durability.mode == "step":  # acknowledged only once durable: a snapshot
                        self.snapshot(slot)  # cut short by the trainer's loss answers nothing (give_back, retry)
                    answers.append((op, part.optim, None))
                else:
                    answers.append((op, None, ValueError(str(part.optim))))
        for op, value, error in answers:
            self._answer(op, value, error)
        self._worked()
        return None

    def settle_single(self, offer: Offer, value: Any, error: BaseException | None) -> None:
        self._worked()
        if not offer.context:  # its own snapshot: nothing to answer
            return
        op = offer.context[0]
        self.applied_seq = op.seq
        if error is None and op.request_id is not None and op.kind == OpKind.ALONE and op.needs_slot:
            self.dirty = True  # a load changed it (a save did not, but a snapshot after it costs little)
        self._answer(op, value, error)

    def give_back(self, offer: Offer, error: str, retry: bool = False) -> None:
        """The round failed before its work ran (or, `retry`, before its step was durable): every
        operation taken gets the error; `retry` (the trainer was lost, service/scheduling/scheduler.py):
        they go back to the head of its queue, in order, and run once it is restored (M6), unanswered
        till then."""
        if retry:  # replays left out: lost() rebuilds them from the journal (they would run twice)
            with self._mu:
                self._queue.extendleft(reversed([op for op in offer.context if not op.replay]))
            self.changed()
            return
        for op in offer.context:
            self._answer(op, None, RuntimeError(error))

    @staticmethod
    def _answer(op: TinkerOp, value: Any, error: BaseException | None) -> None:
        if not op.replay:  # a replay's answer was given before the restart and stands
            op.done(value, error)

    def _worked(self) -> None:
        self.last_active = self._clock()
        self.waiting_reason = None

    def on_evicting(self, slot: int) -> None:
        """M7: its policy's snapshot, when due, is taken as it leaves its slot (and written in the
        background), not as its next turn begins: with a thousand models through 8 slots a model waits
        minutes between turns, so nearly every turn used to begin with one (issue 41). Its last turn is
        then durable while it waits, and its next turn begins with its calls. A snapshot that cannot
        begin leaves it dirty: its next turn takes it, as before."""
        self._settle_snapshot()
        if not self._snapshot_due():
            return
        try:
            self.snapshot(slot, background=True)
        except Exception as e:  # noqa: BLE001 - the trainer may be lost: the swap-out says so next
            log.warning("Tinker model %s: its snapshot at eviction did not begin (%s: %s); its next turn takes it",
                        self.key, type(e).__name__, e)

    def on_evicted(self) -> None:
        self._evicted_at = time.time()
        self.changed()

    def on_restored(self) -> None:
        self.steps_in, self.last_active, self.waiting_reason = 0, self._clock(), None
        self.stats.placed()
        self._restore = None  # back in a slot: its state lives there (and in the swap store once evicted)

    def restore_from(self) -> Callable[[int], Any] | None:
        """How to fill its slot when its state is not in the trainer's swap store (M6): its last
        snapshot, or its seeded init; None: swap it in as usual."""
        return self._restore

    def restore_durable(self, snapshot: str | None, replay: list[TinkerOp], diverged: str | None = None) -> None:
        """M6: its slot state is gone; it comes back from `snapshot` (None: its seeded init) when it
        next has work, the `replay` operations first (their answers stand), then what it has queued."""
        failures = [0]

        def fill(slot: int) -> dict:
            try:
                if snapshot is None:
                    return self._trainer.init_slot(slot, self.hyper, self.lora.seed, registration=self.key)
                return self._trainer.load_slot_state(slot, snapshot, registration=self.key)
            except Exception as e:  # the scheduler gives the slot back and tries again at a later placement
                failures[0] += 1
                if failures[0] >= RESTORE_TRIES:  # a durable state that cannot be read: say so, never wait forever
                    self._give_up(f"model {self.key}'s durable state could not be restored ({type(e).__name__}: {e}); "
                                  "load a saved state into a new model (create_training_client_from_state)")
                raise

        self._restore = fill
        self.dirty = False
        with self._mu:
            self._queue.extendleft(reversed(replay))
        self.changed()
        if diverged is not None:
            self._give_up(diverged)
        self._wake()

    def _give_up(self, why: str) -> None:
        """It cannot continue (M6): what it has queued, and every later call, is answered with `why`."""
        self.diverged = why
        with self._mu:
            left = list(self._queue)
            self._queue.clear()
        for op in left:
            self._answer(op, None, ValueError(why))

    def lost(self) -> None:
        """Its slot state was lost with the trainer (a dead rank, a lost node): back from its last
        snapshot, the operations it ran since replayed from its journal (M6); what it has queued stays."""
        self.journal.forget_writing()  # written by the lost trainer, or not: the recorded snapshot stands
        records = self.journal.records
        row = next((r for r in records.live_models() if r.model_id == self.key), None)
        if row is None:
            return
        done = [f for f in records.futures_after(self.key, row.snapshot_seq) if f.state == "done"]
        plan = restore_plan(self.key, done, row.snapshot_step, row.snapshot_at)
        self.applied_seq, self.step = row.snapshot_seq, row.snapshot_step
        replay = [op for op in (self.rebuild(f, _no_answer, replay=True) for f in plan.replay) if op is not None]
        self.restore_durable(row.snapshot, replay, plan.diverged)

    def rebuild(self, f: Any, done: Done, *, replay: bool = False) -> TinkerOp | None:
        """The operation a recorded future's request describes (service/tenants/tinker_ops.py), with
        `done`; None when it cannot run again (its request was not recorded), `done` told why."""
        r = f.request or {}
        kind = r.get("kind")
        kw = dict(seq=f.seq, request_id=f.request_id, request=lambda r=r: r, replay=replay)
        if kind in (OpKind.FORWARD_BACKWARD, OpKind.FORWARD):
            return TinkerOp(OpKind(kind), done, data=decode_data(r), loss_fn=r["loss_fn"], loss_fn_config=r["loss_fn_config"],
                            custom_loss=r.get("custom_loss"), **kw)
        if kind == OpKind.OPTIM:
            return TinkerOp(OpKind.OPTIM, done, adam=decode_adam(r), **kw)
        t = self._trainer
        runs = {  # a replayed save is not written again: its checkpoint was committed before the loss
            "create": lambda slot: None,
            "save_state": lambda slot: None if replay else t.save_slot_state(slot, self._new_folder(r["folder"])),
            "save_sampler_weights": lambda slot: None if replay else t.export_peft(slot, self._new_folder(r["folder"]), durable=r.get("durable", True)),
            "load_state": lambda slot: self._load(slot, r["folder"], r["optimizer"]),
            "unload": lambda slot: self._end(self.key),
        }
        if kind not in runs:
            done(None, RuntimeError("the service restarted before this call ran and cannot run it again: send it again"))
            return None
        return TinkerOp(OpKind.ALONE, done, run=runs[kind], needs_slot=kind != "unload", **kw)

    def durable(self) -> bool:
        """Its state is its durable snapshot (revived, not back in a slot since): nothing to save at stop."""
        return self._restore is not None and not self.dirty

    def snapshot(self, slot: int | None = None, background: bool = False) -> str:
        """Its whole slot state committed in the store and recorded, covering `applied_seq` (M5);
        `background`: taken now, recorded once the trainer has written it (ModelJournal.snapshot)."""
        url = self.journal.snapshot(self._trainer, slot, self.applied_seq, self.step, background=background)
        self.dirty = False
        return url

    def _settle_snapshot(self) -> None:
        """A background snapshot that ended is recorded; one that failed leaves it dirty, so the
        policy takes another (its last recorded snapshot is as old as before). The loop's thread
        asks each resident every round (ready / offer), and an evicted one at each look while it is
        being written (offer_unplaced; Scheduler.run_unplaced): one attribute read when none is written."""
        if self.journal.writing is not None and self.journal.settle() is False:
            self.dirty = True

    def persist_queue(self) -> None:
        """A graceful stop: the requests of what waits are recorded, so it runs after the restart."""
        with self._mu:
            waiting = [op for op in self._queue if not op.cancelled()]
        self.journal.persist(waiting)

    def release(self, reason: str | None = None, error: type[Exception] = RuntimeError) -> None:
        """It ends; operations still queued get `reason` as `error` (ValueError: the caller's, e.g.
        the model was refused a slot; RuntimeError: the service's, e.g. lost with the trainer)."""
        self.ended = True
        if reason:
            self.end_reason = reason
        with self._mu:
            left, self._queue = list(self._queue), deque()
        for op in left:
            self._answer(op, None, error(self.end_reason))
        self.journal.end()

    # --- slot operations ----------------------------------------------------------------------

    def _new_folder(self, folder: str) -> str:
        """A checkpoint is written once: an existing one is refused (ValueError), never overwritten."""
        store = self.journal.store
        if store.exists(store.key_of(folder)):
            raise ValueError(f"checkpoint folder {Path(folder).name!r} exists; choose another name")
        return folder

    def _load(self, slot: int, folder: str, optimizer: bool) -> None:
        """M4: the slot's state is saved first and restored if the load fails."""
        lora = checkpoint_lora(readable_folder(self.journal.store, folder, legacy_marker=META))
        if lora.rank != self.lora.rank:
            raise ValueError(f"checkpoint has LoRA rank {lora.rank}, the model has rank {self.lora.rank}")
        if lora.targets != self.lora.targets:
            raise ValueError(f"checkpoint trains {list(lora.targets)}, the model trains {list(self.lora.targets)} "
                             "(train_attn / train_mlp / train_unembed must match)")
        store = self.journal.store
        backup = f"{self.journal.snapshot_prefix}/load-backup"
        t = self._trainer
        t.save_slot_state(slot, store.url(backup))
        try:
            t.clear_slot(slot)
            try:
                t.load_slot_state(slot, folder, registration=self.key)
            except Exception:
                t.clear_slot(slot)  # whatever the failed load left (clearing an empty slot is fine)
                t.load_slot_state(slot, store.url(backup), registration=self.key)
                raise
            if not optimizer:
                t.reset_optimizer(slot)
        finally:
            store.delete(backup)
