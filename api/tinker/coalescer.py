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

All trainer work runs on ONE worker thread (the trainer is not thread-safe and its
collective calls must keep one order); the event loop stays free for HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

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


class Coalescer:
    def __init__(self, forward_backward: Callable[[list[Call]], list[CallResult]], store: FutureStore, window_s: float = 0.02,
                 admit: Callable[[set[str], set[str]], dict[str, str]] | None = None, tick_s: float | None = None):
        """``admit(wanted, busy) -> {model: reason to wait}`` (backend.admit); ``tick_s``: how often
        waiting models are retried and idle models checked with nothing else happening (None: never)."""
        self._fb = forward_backward
        self._admit = admit
        self.tick_s = tick_s
        self._store = store
        self.window_s = window_s
        self._queues: dict[str, deque[Op]] = {}
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-trainer")
        self._task: asyncio.Task | None = None
        self.mixed_steps = 0
        self.forward_backward_calls = 0
        self.largest_step = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="tinker-coalescer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._worker.shutdown(wait=True)

    async def run_now(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the trainer worker (outside any model's queue: model creation)."""
        self.start()
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    # -- submission ----------------------------------------------------------------------------

    def submit(self, op: Op) -> None:
        self.start()  # lazily, on the serving loop (the app may run without lifespan events)
        self._queues.setdefault(op.model_id, deque()).append(op)
        self._wake.set()

    def stats(self) -> dict[str, float]:
        return {
            "mixed_steps": self.mixed_steps,
            "forward_backward_calls": self.forward_backward_calls,
            "coalescing_factor": self.forward_backward_calls / self.mixed_steps if self.mixed_steps else 0.0,
            "largest_step": self.largest_step,
        }

    # -- the loop ---------------------------------------------------------------------------------

    def _cancelled(self, op: Op) -> bool:
        entry = self._store._entries.get(op.request_id)  # noqa: SLF001 - same package
        return entry is None or entry.done.done()

    async def _admit_round(self, loop: asyncio.AbstractEventLoop) -> set[str]:
        """Run the backend's admit on the worker; the models that wait for a slot this round."""
        if self._admit is None:
            return set()
        wanted = {m for m, q in self._queues.items() if q and q[0].needs_slot}
        try:
            waiting = await loop.run_in_executor(self._worker, self._admit, wanted, set(self._queues))
        except Exception:  # noqa: BLE001 - the model's own call then fails with the cause
            log.exception("admitting models to trainer slots failed")
            waiting = {}
        self._store.waiting = dict(waiting)
        return set(waiting)

    def _take_round(self, waiting: set[str] = frozenset()) -> tuple[list[Op], list[Op]]:
        fbs, singles = [], []
        for model_id in list(self._queues):
            if model_id in waiting:
                continue  # E2: its calls stay queued, in order, until it has a slot
            q = self._queues[model_id]
            if q and q[0].call is not None:
                while q and q[0].call is not None:
                    fbs.append(q.popleft())
            elif q:
                singles.append(q.popleft())
            if not q:
                del self._queues[model_id]
        return [op for op in fbs if not self._cancelled(op)], [op for op in singles if not self._cancelled(op)]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:  # a periodic retry of waiting models, not a synchronization
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if not self._queues:
                await self._admit_round(loop)  # idle models may go for runs queued outside
            while self._queues:
                if self.window_s > 0 and any(q and q[0].call is not None for q in self._queues.values()):
                    await asyncio.sleep(self.window_s)  # the coalescing window (not a synchronization)
                fbs, singles = self._take_round(await self._admit_round(loop))
                if not fbs and not singles and all(m in self._store.waiting for m in self._queues):
                    break  # every queued model waits for a slot: retried at the next submit or tick
                if fbs:
                    try:
                        results = await loop.run_in_executor(self._worker, self._fb, [op.call for op in fbs])
                        for op, res in zip(fbs, results):
                            self._store.resolve(op.request_id, op.to_outcome(res))
                        ran = sum(1 for r in results if r.error is None)
                        if ran:
                            self.mixed_steps += 1
                            self.forward_backward_calls += ran
                            self.largest_step = max(self.largest_step, ran)
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
