"""Device->host snapshot copies issued a few at a time, from a thread of their own: `CopyFeeder`.

Why (issue 28, measured 2026-12-02 on one H200, 8B x 64 slots, rounds back to back): issuing a
round's 64 snapshot copies (5.6 GB) at once on the copy stream made the NEXT train call wait about
100 ms: the gathers alone cost the round 16 ms, gathers plus copies 110 ms, although the copies run
on their own stream. The train call's own small device->host copies (its metrics) go to the same
copy engine, behind 5.6 GB of queued snapshot copies, so the step stalled until they had all run.
The feeder keeps at most `window` snapshot copies queued on the copy stream: a copy of the step's
waits behind at most that many (one 87 MB body: about 1.6 ms), and the snapshots still move at the
engine's rate between the step's own copies.

Invariants:
* One thread issues every copy, jobs first come first served, rows in order: the copies run in
  call order on the one copy stream (trainer/export/peft_export.py's invariant for reused arena ranges).
* A job's first copy waits for the event recorded on the caller's stream after its gather, so it
  reads the gathered bodies, never the buffer before them.
* A body tensor is dropped only after every copy that reads it ended (the feeder waits for each
  copy's event), so its memory is never reused under a copy.
* Each row's `CopyDone` is set once its copy ended (or failed: `synchronize` raises the error).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

import torch


class CopyDone:
    """One row's device->host copy: `synchronize()` returns once it ended (raises its error)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._done.is_set()

    def _set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()


class CopyFeeder:
    def __init__(self, stream: Any, window: int = 2) -> None:
        self.stream = stream  # a torch.cuda.Stream (None: CPU tensors, copied in the thread)
        self.window = max(1, window)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, bodies: torch.Tensor, hosts: list[torch.Tensor], after: Any = None) -> list[CopyDone]:
        """Copy each row of `bodies` into `hosts[i]` after `after` (an event on the caller's stream,
        recorded after the gather); returns at once with one CopyDone per row."""
        done = [CopyDone() for _ in hosts]
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lorafleet-export-copies", daemon=True)
                self._thread.start()
        self._jobs.put((bodies, hosts, after, done))
        return done

    def _run(self) -> None:
        while True:
            bodies, hosts, after, done = self._jobs.get()
            try:
                self._copy(bodies, hosts, after, done)
            except BaseException as e:  # noqa: BLE001 - every waiter of the job hears it
                for d in done:
                    if not d.query():
                        d._set(e)
            del bodies, hosts, after, done

    def _copy(self, bodies: torch.Tensor, hosts: list[torch.Tensor], after: Any, done: list[CopyDone]) -> None:
        if self.stream is None:
            for i, host in enumerate(hosts):
                host.copy_(bodies[i])
                done[i]._set()
            return
        in_flight: deque[tuple[CopyDone, Any]] = deque()

        def finish_oldest() -> None:
            row_done, event = in_flight.popleft()
            event.synchronize()  # releases the GIL while it waits
            row_done._set()

        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for i, host in enumerate(hosts):
                if len(in_flight) >= self.window:
                    finish_oldest()
                host.copy_(bodies[i], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                in_flight.append((done[i], event))
            while in_flight:
                finish_oldest()
