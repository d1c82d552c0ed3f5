"""A trainer rank's background writer of PEFT folders (issue 18: the export write off the
critical path; issue 28: latest-wins, and the writer off the GIL's path).

An export has two halves (trainer/export/slot_export.py): the *snapshot* (the TP gather and the copy of the
slot's live blocks to host memory) runs on the actor's main thread in call order, so it holds
exactly the weights after the train call before it, already laid out as the safetensors
file's data; the *write* (the header and that data in one call, adapter_config.json, the rename
into place) runs here, on the rank's writer threads (TrainerConfig.export_writer_threads), while
the next train call runs. With `TrainerConfig.export_writer: process` each thread hands its
writes to a writer process of its own (trainer/export/export_process.py), which reads the data from
the shared host arena the snapshot was copied into (trainer/export/host_arena.py): the thread only
waits on a pipe, so the file writes take no GIL from the main thread.

Invariants:
* Folders are started in submission order; with more than one thread several are written at
  once and may finish out of order (each publish waits for its own folder). A folder is written
  under a temporary sibling name and renamed into place, so a reader never sees a half-written
  folder.
* `wait(folder)` returns only once that folder is fully written (the folder), or once it is
  superseded (a `Superseded`: it is never written), and raises the write's (or the snapshot's,
  see `fail`) error. It may be called before the folder is submitted (the awaiting call runs in
  another Ray concurrency group than the snapshot: trainer/actor.py): it waits for the submission.
* Latest-wins (issue 28): a submission with a `key` (the service's publishes: one key per
  adapter registration) supersedes every *queued* job of the same key, which is then never
  written: its waiters get `Superseded`, not an error, and its host memory is released at once.
  A job being written is never superseded, and a job without a key never is (synchronous use,
  checkpoints, tests that queue several versions on purpose). So of an adapter's publishes at
  most one waits in the queue, and what the writer writes is always that adapter's newest
  snapshot: the write rate bounds how fresh the served weights are, never the step.
* Host memory of snapshots waiting to be written is bounded: `submit` blocks (the actor's main
  thread, hence the next train call: back-pressure) while the queued bytes plus the new
  snapshot's would exceed `max_pending_bytes`; a snapshot larger than the bound alone is still
  admitted when the queue is empty (else it could never be written). Superseding a job frees
  its bytes before the new snapshot is counted.
* A job's `release` (its host memory: an arena block) runs exactly once, after its write ended
  (written or failed) or when it is superseded; never while a write may still read it.
* A rank that dies loses its queued writes; their `wait` calls fail with the actor's death and the
  service's publish-failure path republishes (service/fleet/fleet_runtime.py settle_publishes).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.storage.folder_io import remove_partial_writes, replace_folder_atomically  # noqa: F401 - their home; re-exported
from trainer.export.safetensors_stream import PackedHeader, packed_header

# Default bound of queued snapshot bytes per rank: 4 GiB of host memory is about 23 Qwen3-8B
# rank-16 adapters in fp32 (174 MB) or 46 in bf16, enough that a round's exports queue without
# stalling the next train call as long as the writer keeps up on average, and small next to a
# GPU node's host memory. Beyond it the snapshot waits for room (the next train call with it).
DEFAULT_MAX_PENDING_BYTES = 4 << 30


# Dtypes an export can be written in (rollout.config.PublishDtype lists the same, plus auto). The
# trainer's LoRA weights are float32; a publish folder for engines that serve in bf16 is cast to
# it in the snapshot (on the device, before the copy to host: half the bytes copied and written).
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(name: str) -> torch.dtype:
    """The torch dtype of an export dtype name; ValueError naming the allowed ones otherwise."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"unknown export dtype {name!r}; allowed: {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


@dataclass
class ExportLayout:
    """A PEFT file's tensors for slots of one LoRA rank: names and shapes in file order, and
    `index`: per element of the file's data, its position in a snapshot's row (trainer/export/slot_export.py
    export_layout), on the trainer's device; with the PEFT config's module lists."""

    entries: list[tuple[str, tuple[int, ...]]]
    index: torch.Tensor
    target_modules: list[str]  # the PEFT config's (HF short names of the dense LoRA modules)
    target_parameters: list[str]  # and its expert parameters ([] for an attention-only adapter)
    headers: dict = field(default_factory=dict)  # dtype -> the file's PackedHeader (header())

    def header(self, dtype: torch.dtype) -> PackedHeader:
        """The safetensors header of a file in ``dtype``, built once (a few ms of Python per file
        otherwise, GIL held: time the writer threads would take from the main thread)."""
        if dtype not in self.headers:
            self.headers[dtype] = packed_header(self.entries, dtype, metadata={"format": "pt"})
        return self.headers[dtype]


@dataclass
class PeftSnapshot:
    """A slot's LoRA weights at one point of the call order (trainer/export/slot_export.py snapshot_peft): the
    data of its PEFT safetensors file (`body`: every tensor of `entries` back to back, in file
    order) in the export's dtype, on host memory or on its way there (`copied`: the CUDA event
    after the non-blocking device->host copy, pinned_host_copy), with the PEFT config. `body` is
    None on a rank that writes nothing."""

    config: dict
    entries: list[tuple[str, tuple[int, ...]]]
    body: torch.Tensor | None
    header: PackedHeader | None = None  # the file's header (ExportLayout.header); None where body is None
    copied: Any = None  # torch.cuda.Event, or None when the body is a host tensor already
    block: Any = None  # the trainer.export.host_arena.ArenaBlock that `body` lies in (a writer process reads it there), or None

    def ready(self) -> None:
        """Wait for the device->host copy (the export's one synchronization, off the main thread)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    @property
    def nbytes(self) -> int:
        return 0 if self.body is None else self.body.numel() * self.body.element_size()

    def release(self) -> None:
        """Give the body's host memory back (its arena block, once; a private tensor is freed when
        the last reference goes). Called by the writer after the write or when superseded."""
        block, self.block, self.body = self.block, None, None
        if block is not None:
            block.release()


@dataclass(frozen=True)
class Superseded:
    """What `ExportWriter.wait` returns for an export that a newer one of the same key replaced
    while it was queued: it is never written (the folder does not exist). Not an error."""

    folder: str
    by: str  # the folder of the export that superseded it


def pinned_host_copy(t: torch.Tensor, stream: Any) -> tuple[torch.Tensor, Any]:
    """A copy of CUDA tensor `t` in a fresh pinned host tensor, non-blocking, on `stream` (a side
    stream: the copy engine works while the next train call's kernels run), and the CUDA event
    after it (the copy is complete once it fired). `stream` first waits for the current stream
    (`t` is complete); `t` is marked used by `stream` so the allocator does not reuse its memory
    before the copy read it. `t` must be fresh (a cast, gather or clone): nothing else writes it,
    so no later kernel can race the copy. Pinned blocks come from torch's caching host allocator:
    a snapshot of the same size as one already written reuses its block (no new page pinning)."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return host, done


@dataclass
class _Job:
    folder: str
    payload: Any  # what `write(folder, payload)` writes (a PeftSnapshot)
    nbytes: int
    key: str | None  # latest-wins key (None: never superseded)
    release: Callable[[], None] | None  # runs once: after the write, or when superseded


class ExportWriter:
    """Background threads (``threads`` of them) writing folders submitted by the actor's main thread.
    More than one pays because a write is mostly memory copies and system calls that release the
    GIL (trainer/export/safetensors_stream.py), or, with writer processes, waits on a pipe."""

    def __init__(self, write: Callable[[str, Any], None], *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 threads: int = 1, name: str = "peft-export-writer") -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._write = write
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._pending_bytes = 0  # bytes of queued jobs and of those being written
        self._writing = 0  # jobs being written now
        self.room_waiters = 0  # submits waiting for room under the bound (tests observe it)
        self.room_wait_seconds = 0.0  # time submits spent waiting for room (back-pressure on the caller)
        self.written = 0  # folders written (or failed) so far, and the seconds their writes took
        self.write_seconds = 0.0
        self.superseded = 0  # queued folders superseded by a newer one of their key (never written)
        self._outcome: dict[str, BaseException | Superseded | None] = {}  # folder -> None (written), Superseded or error
        # Fault injection: while held the writer takes no job. Only the tests set it (under `_cond`,
        # then notify: tests/trainer_probes.py hold_writer); production never holds the writer.
        self._held = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, folder: str, payload: Any, nbytes: int, *, key: str | None = None,
               release: Callable[[], None] | None = None) -> None:
        """Queue `payload` to be written as `folder`; blocks while the bound is exceeded. With a
        `key`, every queued job of that key is superseded first (module docstring). `release`
        runs once the job is done with its payload (written, failed or superseded)."""
        folder = str(folder)
        with self._cond:
            if folder in self._outcome or any(j.folder == folder for j in self._queue):
                raise ValueError(f"an export to {folder} is already queued or unclaimed; each export needs its own folder")
            dropped = self._supersede_locked(key, folder)
            room = lambda: self._pending_bytes == 0 or self._pending_bytes + nbytes <= self.max_pending_bytes  # noqa: E731
            if not room():  # counted only when it waits (a submit with room costs no wait)
                self.room_waiters += 1
                t0 = time.perf_counter()
                try:
                    self._cond.wait_for(room)
                finally:
                    self.room_waiters -= 1
                    self.room_wait_seconds += time.perf_counter() - t0
            self._queue.append(_Job(folder, payload, nbytes, key, release))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        _release_all(dropped)

    def supersede(self, key: str, by: str) -> list[str]:
        """Supersede every queued job of `key` now (their waiters get `Superseded(folder, by)`);
        returns their folders. The snapshot calls it before it takes host memory for the newer
        export, so the queued one's memory is free for it."""
        with self._cond:
            dropped = self._supersede_locked(key, str(by))
        _release_all(dropped)
        return [j.folder for j in dropped]

    def _supersede_locked(self, key: str | None, by: str) -> list[_Job]:
        if key is None:
            return []
        dropped = [j for j in self._queue if j.key == key]
        if dropped:
            self._queue = deque(j for j in self._queue if j.key != key)
            for j in dropped:
                self._pending_bytes -= j.nbytes
                self._outcome[j.folder] = Superseded(j.folder, by)
            self.superseded += len(dropped)
            self._cond.notify_all()
        return dropped

    def fail(self, folder: str, error: BaseException) -> None:
        """Record that the export to `folder` failed before it was queued (its snapshot raised), so
        its `wait` raises instead of waiting for a submission that never comes."""
        with self._cond:
            self._outcome[str(folder)] = error
            self._cond.notify_all()

    def wait(self, folder: str) -> str | Superseded:
        """Block until `folder` is written (returns it) or superseded (returns `Superseded`), or its
        export failed (raises that error). Forgets it."""
        folder = str(folder)
        with self._cond:
            self._cond.wait_for(lambda: folder in self._outcome)
            outcome = self._outcome.pop(folder)
        if isinstance(outcome, BaseException):
            raise outcome
        return folder if outcome is None else outcome

    def pending(self) -> int:
        """Folders queued or being written."""
        with self._cond:
            return len(self._queue) + self._writing

    def load(self) -> tuple[int, int, int]:
        """(jobs queued, their bytes, jobs being written) now: what holds the host memory of snapshots."""
        with self._cond:
            return len(self._queue), sum(j.nbytes for j in self._queue), self._writing

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue and not self._held)
                job = self._queue.popleft()
                self._writing += 1
            error: BaseException | None = None
            t0 = time.perf_counter()
            try:
                self._write(job.folder, job.payload)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, which raises it
                error = e
            seconds = time.perf_counter() - t0
            job.payload = None
            _release_all([job])  # free the snapshot before making room for the next
            with self._cond:
                self._pending_bytes -= job.nbytes
                self._writing -= 1
                self.written += 1
                self.write_seconds += seconds
                self._outcome[job.folder] = error
                self._cond.notify_all()


def _release_all(jobs: list[_Job]) -> None:
    for job in jobs:
        release, job.release = job.release, None
        job.payload = None
        if release is not None:
            release()


