"""Publish exports of a round's stepped slots, batched (issue 28: a cheaper snapshot).

The snapshot of a slot is the data section of its PEFT safetensors file, gathered on the device
from the slot's one buffer row by the export layout's index (trainer/export/slot_export.py export_layout).
`gather_bodies` does that for several slots of one layout at once:

* each slot's row is cast to the publish dtype into one [n, row] device buffer (one cast per
  slot; under TP its split columns go straight into their place in the buffer by one
  all-gather per slot, so no concatenation follows);
* ONE index_select by the layout's index makes every slot's file data, [n, F];
* `BackgroundExports.to_host` then records ONE event after the gather and hands the batch to the
  rank's copy feeder (trainer/export/copy_feeder.py), which gives each slot ONE non-blocking
  device->host copy on the rank's copy stream, a few at a time, into a block of the shared host
  arena (trainer/export/host_arena.py, registered with CUDA once: no pinned allocation per snapshot).

Nothing on this path synchronizes the main thread with the device: the writer thread waits for
its snapshot's copy (PeftSnapshot.ready: the row's CopyDone) before it writes. Slots are taken in chunks of at most
CHUNK_BYTES of device memory, so a round of 64 8B adapters does not need 11 GB of temporaries.

`BackgroundExports` is rank 0's writing side: the ExportWriter (threads), the arena, the copy
stream, and the write itself, in the thread (`export_writer: thread`) or in a writer process per
thread (`process`, trainer/export/export_process.py), which reads the data from the arena.

Invariants:
* A batch's snapshots hold the weights as they are when the call runs (call order): the casts
  are queued on the current stream before anything later can change the rows, and every copy
  reads a fresh gather, never a view of the live weights.
* Every device->host copy into the arena runs on the one copy stream, in call order (so a range
  released by a superseded snapshot is overwritten only after that snapshot's copy ended:
  host_arena.py); a copy stream waits for the current stream before its copies.
* A snapshot too large for the whole arena gets private pinned memory and is written in its
  writer thread (a writer process can only read the arena).
* Sizing (`size_for`, before the arena's first use): the arena holds `slots + threads` blocks of
  the planned size, or the writer's bound when that is larger. The planned size is that of the
  largest file any slot can have (SlotExporter.largest_file_elems: the trainer's max rank, every
  target), not of a buffer row: the file is larger than the row it is gathered from (q/k/v and
  gate/up each carry a copy of their fused linear's one A; 8B: 87.3 MB against a 78.1 MB row).
  Every block of a planned snapshot takes exactly the planned size (`reserve`), whatever the
  slot's rank and targets, so free ranges stay multiples of it: no mix of layouts fragments the
  arena. With latest-wins keys (the service keys by run, so at most one key per slot) a slot
  has at most one queued export (a newer one supersedes it before taking memory) and each
  writer thread writes one, so a round's publishes never wait for room; only keyless exports
  can (back-pressure, bounded). The writer's byte bound is never below the arena's size (a
  bound below it would make the round wait in `submit` instead).
  Measured why (2026-12-01/02, H200, 8B, 64 slots): a 4 GiB arena held 46 of a round's 64 bf16
  snapshots (87 MB each), and the other 18 waited 174 ms for the writers to make room; planned
  per row (68 x 78.1 MB) it held 60, and the last 4 waited 57 ms for the writers' first folders.
* `room_report` says what holds the arena: recorded for every allocation that found no room
  (`room_waits`), so a run that waits explains itself.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from trainer.export.copy_feeder import CopyFeeder
from trainer.export.export_process import WriterProcess
from trainer.export.export_writer import DEFAULT_MAX_PENDING_BYTES, ExportWriter, PeftSnapshot
from trainer.storage.folder_io import replace_folder_atomically
from trainer.export.host_arena import ArenaBlock, HostArena, block_bytes
from trainer.export.peft_io import peft_config_text, write_peft_folder_packed

WriterKind = Literal["thread", "process"]

CHUNK_BYTES = 1 << 30  # device temporaries per gather (the cast rows and the gathered bodies)
ROOM_REPORTS = 64  # room_report()s kept of allocations that waited (the latest)


@dataclass(frozen=True)
class ExportRequest:
    """One background export: the slot, its folder, and its latest-wins key (None: never
    superseded; the service passes the adapter registration's id)."""

    slot: int
    folder: str
    key: str | None = None


def chunks(n: int, row_elems: int, file_elems: int, itemsize: int) -> list[range]:
    """Ranges of at most CHUNK_BYTES of temporaries (n rows of row_elems + file_elems), at least one slot each."""
    per = max(1, CHUNK_BYTES // max(1, (row_elems + file_elems) * itemsize))
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


def gather_bodies(weight: torch.Tensor, slots: list[int], index: torch.Tensor, dtype: torch.dtype, *,
                  tp: int = 1, split: int = 0, group: Any = None, gather_only: bool = False) -> torch.Tensor | None:
    """The file data of `slots` (rows of the fp32 slot buffer `weight` [S, W]) in `dtype`: [n, F],
    F = index.numel(), on weight's device. Collective over TP (`tp` > 1: the first `split` columns
    of a row are this rank's TP shard, `group` the TP group). `gather_only`: a rank that writes
    nothing takes part in the all-gathers and returns None."""
    n, width = len(slots), weight.shape[1]
    full = torch.empty(n, tp * split + width - split, dtype=dtype, device=weight.device)
    if tp > 1:
        mine = torch.empty(n, split, dtype=dtype, device=weight.device)
        for i, slot in enumerate(slots):
            mine[i].copy_(weight[slot, :split])  # cast
            dist.all_gather(list(full[i, : tp * split].view(tp, split)), mine[i], group=group)
        if gather_only:
            return None
        for i, slot in enumerate(slots):
            full[i, tp * split :].copy_(weight[slot, split:])
    else:
        if gather_only:
            return None
        lo = slots[0]
        if slots == list(range(lo, lo + n)):  # consecutive slots (a full round): one cast for all
            full.copy_(weight[lo : lo + n])
        else:
            for i, slot in enumerate(slots):
                full[i].copy_(weight[slot])
    return full.index_select(1, index)


class BackgroundExports:
    """Rank 0's background writing (module docstring): started on first use, one per trainer rank."""

    def __init__(self, *, device: torch.device, threads: int, kind: WriterKind = "thread",
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        if kind not in ("thread", "process"):
            raise ValueError(f"export writer must be 'thread' or 'process', got {kind!r}")
        self.device = device
        self.kind = kind
        self.threads = threads
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._writer: ExportWriter | None = None
        self._arena: HostArena | None = None
        self._copy_stream = None
        self._feeder: CopyFeeder | None = None
        self._procs = threading.local()  # each writer thread's WriterProcess
        self.processes: list[WriterProcess] = []
        self._wanted = 0  # arena bytes asked for by size_for (a round's snapshots)
        self.planned_block = 0  # arena bytes every planned snapshot's block takes (size_for; 0: none planned)
        self.room_wait_count = 0  # allocations that found no room in the arena (each waited)
        self.room_waits: deque[dict] = deque(maxlen=ROOM_REPORTS)  # their room_report()s, the latest kept

    @property
    def copy_stream(self):  # noqa: ANN201 - torch.cuda.Stream
        """The rank's one stream for device->host snapshot copies (CUDA only)."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    @property
    def copy_feeder(self) -> CopyFeeder:
        """The rank's one issuer of snapshot copies onto the copy stream (CUDA only)."""
        with self._lock:
            if self._feeder is None:
                self._feeder = CopyFeeder(self.copy_stream)
            return self._feeder

    @property
    def writer(self) -> ExportWriter:
        with self._lock:
            if self._writer is None:
                self._writer = ExportWriter(self._write, threads=self.threads, max_pending_bytes=self._bound())
            return self._writer

    @property
    def arena(self) -> HostArena:
        """The shared host arena (registered with CUDA at first use), as large as the bound: the
        writer's max_pending_bytes or what `size_for` asked, whichever is larger."""
        with self._lock:
            if self._arena is None:
                self._arena = HostArena(self._bound(), register=self.device.type == "cuda")
            return self._arena

    def size_for(self, snapshot_bytes: int, slots: int) -> None:
        """Before the arena's first use: make room for one snapshot of at most `snapshot_bytes` (the
        largest any slot can have, in the first call's dtype: a publish job has one) per slot plus
        one per writer thread (module docstring); no effect once the arena exists."""
        with self._lock:
            if self._arena is None:
                self.planned_block = max(self.planned_block, block_bytes(snapshot_bytes))
                self._wanted = max(self._wanted, (slots + self.threads) * self.planned_block)
                if self._writer is not None:
                    self._writer.max_pending_bytes = max(self._writer.max_pending_bytes, self._bound())

    def _bound(self) -> int:
        """The writer's bound and the arena's size: never below what the arena holds."""
        return max(self.max_pending_bytes, self._wanted, 0 if self._arena is None else self._arena.nbytes)

    def with_writer(self, kind: WriterKind, threads: int, *, max_pending_bytes: int | None = None) -> "BackgroundExports":
        """Background writing with writer `kind` and `threads` over this one's arena and copy stream
        (registered once per rank); this one's writer processes stop. Only while nothing is queued
        or being written (benchmarks compare writers on one build)."""
        if self._writer is not None and self._writer.pending():
            raise RuntimeError("exports are still queued or being written; switch writers when idle")
        bound = self.max_pending_bytes if max_pending_bytes is None else max_pending_bytes
        new = BackgroundExports(device=self.device, threads=threads, kind=kind, max_pending_bytes=bound)
        new._arena, new._copy_stream, new._feeder = self._arena, self._copy_stream, self._feeder
        new._wanted, new.planned_block = self._wanted, self.planned_block  # the plan the shared arena was sized by
        self.close()
        return new

    def to_host(self, bodies: torch.Tensor) -> tuple[list[torch.Tensor], list[ArenaBlock | None], Any]:
        """One host copy per row of `bodies` [n, F] (module docstring): the host tensors, their
        arena blocks (None: private memory), and one entry per row for its copy: a CopyDone on CUDA
        (the copies are the feeder's), None on the CPU (they are done when this returns)."""
        n, f = bodies.shape
        nbytes = f * bodies.element_size()
        arena, reserve = self.arena, self.planned_block
        blocks: list[ArenaBlock | None] = []
        for _ in range(n):
            if not arena.fits(nbytes, reserve=reserve):
                blocks.append(None)
                continue
            if not arena.room_for(nbytes, reserve=reserve):  # it will wait: say what holds the arena
                self.room_wait_count += 1
                self.room_waits.append(self.room_report(nbytes, taken_by_this_call=len(blocks)) | {"seq": self.room_wait_count})
            blocks.append(arena.alloc(nbytes, reserve=reserve))
        hosts = [None if b is None else b.tensor.view(bodies.dtype) for b in blocks]
        if bodies.is_cuda:
            for i in range(n):
                if hosts[i] is None:
                    hosts[i] = torch.empty(f, dtype=bodies.dtype, pin_memory=True)
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(bodies.device))
            # the copies are fed to the copy stream a few at a time (trainer/export/copy_feeder.py: at once,
            # they held up the next train call's own device->host copies for about 100 ms)
            return hosts, blocks, self.copy_feeder.submit(bodies, hosts, gathered)
        for i in range(n):
            if hosts[i] is None:
                hosts[i] = bodies[i]  # a row of a fresh gather: nothing else writes it
            else:
                hosts[i].copy_(bodies[i])
        return hosts, blocks, [None] * n

    @property
    def room_waiters(self) -> int:
        """Calls waiting for room now, in the arena or under the writer's bound (creates neither:
        an arena made before `size_for` would be too small)."""
        with self._lock:
            arena, writer = self._arena, self._writer
        return (0 if arena is None else arena.waiters) + (0 if writer is None else writer.room_waiters)

    def room_report(self, snapshot_bytes: int = 0, *, taken_by_this_call: int = 0) -> dict:
        """What holds the arena now: its blocks in use, of them the writer's queued jobs and those
        being written (one per busy writer thread) and the blocks this call took so far; the block
        a snapshot of `snapshot_bytes` takes against the planned one, and how many such the arena
        holds. {} before the arena exists (it is not made here)."""
        arena = self._arena
        if arena is None:
            return {}
        queued, queued_bytes, writing = (0, 0, 0) if self._writer is None else self._writer.load()
        block = block_bytes(max(snapshot_bytes, self.planned_block))
        return {"arena_bytes": arena.nbytes, "blocks_in_use": arena.blocks, "used_bytes": arena.used,
                "largest_free_bytes": arena.largest_free(), "queued": queued, "queued_bytes": queued_bytes,
                "writing": writing, "taken_by_this_call": taken_by_this_call,
                "held_otherwise": arena.blocks - queued - writing - taken_by_this_call,
                "snapshot_bytes": snapshot_bytes, "block_bytes": block, "planned_block_bytes": self.planned_block,
                "arena_holds_blocks": arena.nbytes // block, "threads": self.threads}

    def submit(self, requests: list[ExportRequest], snaps: list[PeftSnapshot]) -> None:
        """Queue the snapshots' writes (after `supersede_all` and the snapshot)."""
        writer = self.writer
        for req, snap in zip(requests, snaps):
            writer.submit(req.folder, snap, snap.nbytes, key=req.key, release=snap.release)

    def supersede_all(self, requests: list[ExportRequest]) -> None:
        """Latest-wins before the snapshot takes host memory: a queued export of the same key is
        superseded now, so its arena block is free for the newer one."""
        writer = self.writer
        for req in requests:
            if req.key is not None:
                writer.supersede(req.key, by=req.folder)

    def fail_all(self, requests: list[ExportRequest], error: BaseException) -> None:
        for req in requests:
            self.writer.fail(req.folder, error)

    # -- the write, on a writer thread ----------------------------------------------------------

    def _write(self, folder: str, snap: PeftSnapshot) -> None:
        snap.ready()  # the device->host copy (the export's one synchronization, off the main thread)
        if self.kind == "process" and snap.block is not None:
            self._process().write(folder, snap.header.raw, peft_config_text(snap.config), snap.block.offset, snap.nbytes)
            return
        write_snapshot(folder, snap)

    def _process(self) -> WriterProcess:
        proc = getattr(self._procs, "proc", None)
        if proc is None:
            arena = self.arena
            proc = self._procs.proc = WriterProcess(arena.fd, arena.nbytes)
            with self._lock:
                self.processes.append(proc)
        return proc

    def close(self) -> None:
        """Stop the writer processes (threads are daemons; the arena goes with the process)."""
        with self._lock:
            procs, self.processes = self.processes, []
        for proc in procs:
            proc.close()


def write_peft_snapshot(out_dir: str | Path, snap: PeftSnapshot) -> None:
    """The snapshot's folder in this process: its header and packed data in one write, and the config."""
    snap.ready()
    write_peft_folder_packed(out_dir, snap.config, snap.header, snap.body)


def write_snapshot(folder: str, snap: PeftSnapshot) -> None:
    """The snapshot's folder in this process, whole or not at all (a background write)."""
    replace_folder_atomically(lambda tmp: write_peft_snapshot(tmp, snap), folder)


def make_snapshots(hosts: list[torch.Tensor], blocks: list[ArenaBlock | None], done: list,
                   configs: list[dict], entries: list, header: Any) -> list[PeftSnapshot]:
    """`hosts`, `blocks`, `done`: what to_host returned (one entry per row each)."""
    return [PeftSnapshot(config=cfg, entries=entries, body=h, header=header, copied=d, block=b)
            for h, b, cfg, d in zip(hosts, blocks, configs, done)]

