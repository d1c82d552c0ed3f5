"""Coalescing: pending forward_backward calls of different models -> ONE mixed step.

Every model has a FIFO queue of operations (forward_backward, forward, optim_step,
save, load, ...), in the order its requests arrived (the SDK submits a training
client's requests one after another, in seq-id order). The scheduler loop repeats
rounds; in each round every model contributes either the run of forward_backward
calls at the head of its queue (all of them go into the round's mixed step) or its
single head operation. So a model's own operations keep their order (an
optim_step is never overtaken by a later forward_backward, nor runs before an
earlier one), and calls of different models that are pending together share one
mixed pass. Before a round with forward_backward calls the loop waits ``window_s``
so that calls arriving close together join it.

Slots (api/tinker/backend.py E1-E4): before each round the backend's ``admit`` brings
evicted models whose head operation needs their slot back in, and names those that
must wait for one; a waiting model's operations stay queued, in order (its futures
answer "try again", queue paused_capacity, with the reason), and are retried at every
round and every ``tick_s`` until a slot is had. The tick also lets the backend evict
idle models for runs queued outside it.

Joining the service loop's train calls (``join_loop``): the service's training loop
takes the pending forward_backward runs at the heads of the queues
(``take_forward_backward``, from its own thread) into its next train call, ONE mixed
step with the dataset-driven runs' samples, and hands the results back
(``deliver`` / ``fail``). While the loop is training (``loop_active()``), a model's
forward_backward head is left for it for up to ``join_wait_s`` (its other operations
and other models' run as usual); after that, or when the loop is idle, the
coalescer's own rounds run it, so a Tinker call never waits on an idle loop.

Order across both takers: a model whose taken operations are not finished yet is
BUSY; neither taker touches its queue until they are, so its later operations
(an optim_step after the forward_backward that rides in a loop step) wait for them.

Slots and the loop: the loop takes calls of RESIDENT models only (``resident``, the
backend's lock-free check); an evicted model's calls wait for this coalescer's own
round, whose admit swaps it back in first (its head is never left for the loop). The
backend evicts a model only inside ``hold_idle``, which makes it BUSY under ``_mu`` if it
has nothing queued and nothing taken, so neither taker can take a call of a model
while it is being swapped out.

All the coalescer's own trainer work runs on ONE worker thread (the trainer is not
thread-safe and its collective calls must keep one order; the trainer group's lock
orders them with the loop's train calls); the event loop stays free for HTTP. The
queues are shared with the loop's thread under ``_mu``; futures are resolved on the
event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from api.tinker.futures import FutureStore, Outcome, server_error
from trainer.tinker_ops import Call, CallResult

log = logging.getLogger(__name__)


@dataclass
class Op:
    model_id: str
    request_id: str
    call: Call | None = None  # a forward_backward call (coalesced) ...
    to_outcome: Callable[[CallResult], Outcome] | None = None
    run: Callable[[], Outcome] | None = None  # ... or any other operation, run alone on the worker
    needs_slot: bool = True  # False: runs whether or not the model is resident (unload)
    queued_at: float = field(default_factory=time.monotonic)


class Coalescer:
    def __init__(self, forward_backward: Callable[[list[Call]], list[CallResult]], store: FutureStore, window_s: float = 0.02,
                 admit: Callable[[set[str], set[str]], dict[str, str]] | None = None, tick_s: float | None = None,
                 resident: Callable[[str], bool] | None = None):
        """``admit(wanted, busy) -> {model: reason to wait}`` (backend.admit); ``tick_s``: how often
        waiting models are retried and idle models checked with nothing else happening (None: never);
        ``resident(model) -> bool``: whether the model holds its slot now (backend.is_resident; called
        under ``_mu`` from any thread, so it must take no lock). None: every model is resident."""
        self._fb = forward_backward
        self._admit = admit
        self.tick_s = tick_s
        self._resident = resident
        self._admitted: set[str] = set()  # the models the last admit was asked about (_take_round)
        self._store = store
        self.window_s = window_s
        self._queues: dict[str, deque[Op]] = {}
        self._busy: set[str] = set()  # models whose taken operations are not finished (either taker)
        self._mu = threading.Lock()  # _queues and _busy: the loop's thread takes from them too
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-trainer")
        self._task: asyncio.Task | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop_active: Callable[[], bool] | None = None
        self.join_wait_s = 0.0
        self.mixed_steps = 0
        self.forward_backward_calls = 0
        self.largest_step = 0
        self.joined_steps = 0  # loop train calls that carried Tinker calls
        self.joined_calls = 0  # Tinker forward_backward calls that rode in them

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._event_loop = asyncio.get_running_loop()
            self._task = self._event_loop.create_task(self._loop(), name="tinker-coalescer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._event_loop = None
        self._worker.shutdown(wait=True)

    async def run_now(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the trainer worker (outside any model's queue: model creation)."""
        self.start()
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    def join_loop(self, loop_active: Callable[[], bool], join_wait_s: float) -> None:
        """Let the service loop's train calls take pending forward_backward calls: while
        ``loop_active()``, a model's forward_backward head waits up to ``join_wait_s`` for it."""
        if join_wait_s < 0:
            raise ValueError(f"join_wait_s must be >= 0, got {join_wait_s}")
        self._loop_active = loop_active
        self.join_wait_s = join_wait_s

    # -- submission ----------------------------------------------------------------------------

    def submit(self, op: Op) -> None:
        self.start()  # lazily, on the serving loop (the app may run without lifespan events)
        with self._mu:
            self._queues.setdefault(op.model_id, deque()).append(op)
        self._wake.set()

    def stats(self) -> dict[str, float]:
        return {
            "mixed_steps": self.mixed_steps,
            "forward_backward_calls": self.forward_backward_calls,
            "coalescing_factor": self.forward_backward_calls / self.mixed_steps if self.mixed_steps else 0.0,
            "largest_step": self.largest_step,
            "joined_steps": self.joined_steps,
            "joined_calls": self.joined_calls,
        }

    # -- the service loop's side (any thread) -------------------------------------------------------

    def take_forward_backward(self) -> list[Op]:
        """The run of forward_backward calls at the head of every idle resident model's queue
        (never past another operation), taken for the loop's next train call; their models are
        busy until ``deliver`` / ``fail``. Thread-safe; empty before the coalescer has started."""
        if self._event_loop is None:
            return []
        taken: list[Op] = []
        with self._mu:
            for model_id in list(self._queues):
                if model_id in self._busy or not self._is_resident(model_id):
                    continue  # busy: its taken operations first; not resident: this coalescer's admit brings it in
                q = self._queues[model_id]
                run = []
                while q and q[0].call is not None:
                    run.append(q.popleft())
                if not q:
                    del self._queues[model_id]
                run = [op for op in run if not self._cancelled(op)]
                if run:
                    self._busy.add(model_id)
                    taken += run
        return taken

    @contextmanager
    def hold_idle(self, model_id: str) -> Iterator[bool]:
        """For the backend's eviction (any thread): yields True and keeps ``model_id`` BUSY while
        the block runs if it has no queued operation and none taken (either taker), so neither
        taker takes a call of it meanwhile; yields False (holding nothing) otherwise. Operations
        submitted meanwhile stay queued and run after it, through admit if it was swapped out."""
        with self._mu:
            idle = model_id not in self._busy and not self._queues.get(model_id)
            if idle:
                self._busy.add(model_id)
        try:
            yield idle
        finally:
            if idle:
                with self._mu:
                    self._busy.discard(model_id)
                loop = self._event_loop
                if loop is not None:
                    try:
                        loop.call_soon_threadsafe(self._wake.set)  # operations queued meanwhile may run now
                    except RuntimeError:  # the event loop closed: nothing left to wake
                        pass

    def deliver(self, ops: list[Op], results: list[CallResult]) -> None:
        """Results of taken calls (one per op, in order). Thread-safe."""
        self._on_event_loop(self._finish_joined, ops, results, None)

    def fail(self, ops: list[Op], message: str) -> None:
        """The train call that carried the taken calls failed: each gets a server error. Thread-safe."""
        self._on_event_loop(self._finish_joined, ops, None, message)

    def _on_event_loop(self, fn: Callable, *args: object) -> None:
        loop = self._event_loop
        try:
            if loop is None:
                raise RuntimeError("the coalescer has stopped")
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError as err:  # event loop closed: the service is stopping, nobody waits for them
            log.warning("Tinker results of a loop train call dropped: %s", err)

    def _finish_joined(self, ops: list[Op], results: list[CallResult] | None, error: str | None) -> None:
        if results is None:
            for op in ops:
                self._store.resolve(op.request_id, server_error(f"forward_backward failed: {error}"))
        else:
            for op, res in zip(ops, results):
                self._store.resolve(op.request_id, op.to_outcome(res))
            ran = sum(1 for r in results if r.error is None)
            if ran:
                self.joined_steps += 1
                self.joined_calls += ran
                self._count_step(ran)
        self._unbusy(ops)

    # -- the coalescer's own rounds ------------------------------------------------------------------

    def _count_step(self, ran: int) -> None:
        self.mixed_steps += 1
        self.forward_backward_calls += ran
        self.largest_step = max(self.largest_step, ran)

    def _unbusy(self, ops: list[Op]) -> None:
        with self._mu:
            self._busy.difference_update(op.model_id for op in ops)
        self._wake.set()  # their models' next operations may run now

    def _cancelled(self, op: Op) -> bool:
        entry = self._store._entries.get(op.request_id)  # noqa: SLF001 - same package
        return entry is None or entry.done.done()

    def _left_for_loop(self, model_id: str, head: Op, now: float) -> bool:
        """Whether a forward_backward head is left for the loop's next train call (bounded wait).
        Never a non-resident model's: the loop would not take it (only this coalescer's admit
        brings a model back in)."""
        return (self._loop_active is not None and now - head.queued_at < self.join_wait_s
                and self._is_resident(model_id) and self._loop_active())

    def _is_resident(self, model_id: str) -> bool:
        return self._resident is None or self._resident(model_id)

    def _heads(self, waiting: set[str] | dict[str, str]) -> list[Op]:
        """The heads this coalescer's next round would take (caller holds ``_mu``): models not
        busy, not waiting for a slot, and whose head is not left for the loop."""
        now = time.monotonic()
        return [q[0] for m, q in self._queues.items()
                if q and m not in self._busy and m not in waiting
                and not (q[0].call is not None and self._left_for_loop(m, q[0], now))]

    def _ready_fb(self) -> bool:
        """A forward_backward head this coalescer would take now (the window is waited for it)."""
        with self._mu:
            return any(h.call is not None for h in self._heads(self._store.waiting))

    async def _admit_round(self, loop: asyncio.AbstractEventLoop) -> set[str]:
        """Run the backend's admit on the worker; the models that wait for a slot this round.
        ``busy`` (never evicted, E1) = models with queued operations or taken ones (either taker)."""
        with self._mu:
            wanted = {m for m, q in self._queues.items() if q and q[0].needs_slot and m not in self._busy}
            busy = set(self._queues) | self._busy
        try:
            waiting = await loop.run_in_executor(self._worker, self._admit, wanted, busy)
        except Exception:  # noqa: BLE001 - the model's own call then fails with the cause
            log.exception("admitting models to trainer slots failed")
            waiting = {}
        self._admitted = wanted
        self._store.waiting = dict(waiting)
        return set(waiting)

    def _not_admitted(self, model_id: str, head: Op) -> bool:
        """A head that needs a slot, of a model not resident that the last admit was not asked
        about (it came, or its model stopped being busy, while admit ran): the next round's
        admit brings it in first (E2), so it is not taken now."""
        return (self._admit is not None and head.needs_slot and model_id not in self._admitted
                and not self._is_resident(model_id))

    def _take_round(self, waiting: set[str] = frozenset()) -> tuple[list[Op], list[Op]]:
        fbs, singles = [], []
        now = time.monotonic()
        with self._mu:
            for model_id in list(self._queues):
                if model_id in self._busy or model_id in waiting:
                    continue  # busy: its taken operations first; waiting (E2): queued, in order, until it has a slot
                q = self._queues[model_id]
                if q and self._not_admitted(model_id, q[0]):
                    continue
                if q and q[0].call is not None:
                    if self._left_for_loop(model_id, q[0], now):
                        continue
                    while q and q[0].call is not None:
                        fbs.append(q.popleft())
                elif q:
                    singles.append(q.popleft())
                if not q:
                    del self._queues[model_id]
            fbs = [op for op in fbs if not self._cancelled(op)]
            singles = [op for op in singles if not self._cancelled(op)]
            self._busy.update(op.model_id for op in fbs + singles)
        return fbs, singles

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        admit_due = True  # admit before the first round
        next_tick = time.monotonic()
        while True:
            self._wake.clear()  # whatever happens from here on wakes the wait below
            if self.window_s > 0 and self._ready_fb():
                await asyncio.sleep(self.window_s)  # the coalescing window (not a synchronization)
            waiting = set(self._store.waiting)
            if self._admit is not None:
                with self._mu:
                    takeable = bool(self._heads(waiting))
                # Admit before every round that takes something, after every round and wake-up (a
                # slot may have been freed), and every tick_s (waiting models, runs queued outside);
                # not on the polls that only look whether a head left for the loop fell back to us.
                if admit_due or takeable or (self.tick_s is not None and time.monotonic() >= next_tick):
                    waiting = await self._admit_round(loop)
                    next_tick = time.monotonic() + (self.tick_s or 0.0)
            admit_due = False
            fbs, singles = self._take_round(waiting)
            if not fbs and not singles:
                with self._mu:
                    polling = any(m not in waiting for m in self._queues)
                # Something queued but left for the loop (or busy): look again after a window, since
                # a left-for-the-loop head falls back to this coalescer once join_wait_s has passed.
                # Only models waiting for a slot (or nothing) queued: the next wake-up or tick.
                timeout = max(self.window_s, 0.01) if polling else self.tick_s
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                    admit_due = True
                except TimeoutError:
                    pass
                continue
            admit_due = True
            try:
                if fbs:
                    try:
                        results = await loop.run_in_executor(self._worker, self._fb, [op.call for op in fbs])
                        for op, res in zip(fbs, results):
                            self._store.resolve(op.request_id, op.to_outcome(res))
                        ran = sum(1 for r in results if r.error is None)
                        if ran:
                            self._count_step(ran)
                    except Exception as err:  # noqa: BLE001 - every caller gets the failure
                        log.exception("mixed forward_backward failed")
                        for op in fbs:
                            self._store.resolve(op.request_id, server_error(f"forward_backward failed: {err}"))
                for op in singles:
                    try:
                        outcome = await loop.run_in_executor(self._worker, op.run)
                    except Exception as err:  # noqa: BLE001
                        log.exception("tinker operation failed")
                        outcome = server_error(f"{type(err).__name__}: {err}")
                    self._store.resolve(op.request_id, outcome)
            finally:
                self._unbusy(fbs + singles)
