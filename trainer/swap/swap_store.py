"""Where one trainer rank keeps its evicted slots, by key: two bounded tiers below the device.

  host   host memory (pinned on CUDA, so copies to the device are DMA), up to host_budget_bytes;
  disk   beyond that, one file per snapshot in ``spill_dir`` (trainer/swap/spill_file.py: written
         atomically, checksummed), up to disk_budget_bytes.
A snapshot spilled to disk can be *prefetched*: read (and verified) into host memory by a
background thread, so the swap-in that follows is only the host->device copy. A prefetch takes
room in the host budget like any host snapshot; with no room it is not started (the swap-in
then reads the file itself).

Invariants:
  T1 what the store holds never passes either budget: a snapshot that fits neither tier is
     refused with SwapError and nothing is stored (the caller's slot stays resident);
  T2 a snapshot leaves the store only by ``drop`` (after a swap-in, or when its tenant ends):
     its file is removed then; a failed read leaves it stored;
  T3 a dropped key's prefetch, finished or not, is discarded; prefetching a key twice, or one
     that is in host memory or absent, starts nothing;
  T4 the spill folder belongs to one trainer: each rank locks it, and at start removes the
     files a previous process left there (this rank's, and rank 0 also those of ranks beyond
     the world size); files of other names are never touched.

Why the spill folder is a local folder and never the storage (service.storage, also when it is
object storage; issue 44): a spill file is one rank's transient state, dropped with the trainer
(a restarted trainer starts empty, T4, and the service prepares its runs again from their
checkpoints), so object storage would make nothing more durable; it would only make each turn of
an evicted tenant slower. Measured (docs/BENCHMARKS.md, "Storage": a Qwen3-8B-shape rank-16 slot,
558 MiB): a turn (swap-out + swap-in) through SeaweedFS on loopback 5.0 + 1.4 = 6.4 s, through the
local disk 0.98 + 0.80 s on the same machine, in host memory 21.4 ms (the H200 host's disk tier:
0.49 + 0.37 s). With object storage, give each trainer node a local disk folder
(trainer.swap_spill_dir; the default <state_dir>/swap is then a folder of that node).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.swap.spill_file import SpillFileError, encode_spill, read_spill_file, write_spill_file

log = logging.getLogger(__name__)

_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
# Names this store writes: <key>.rank<r>.swap (whole) and <key>.rank<r>.tmp (being written);
# .pt is the name of the format before checksums. Only these are ever removed.
_OURS = re.compile(r".+\.rank(\d+)\.(swap|tmp|pt)")
FOLDER_LOCK_WAIT_S = 60.0  # how long a new trainer waits for the folder's previous holder to exit


class SwapError(RuntimeError):
    """A swap could not be done; the slot (or the stored snapshot) is as it was."""


@dataclass
class SlotSnapshot:
    """One evicted slot on one rank: its buffer rows and its counters (``meta``: JSON-able)."""

    meta: dict
    pending: torch.Tensor  # float64 loss statistics accumulated toward the next step
    rows: dict[str, torch.Tensor] | None  # kind -> row in host memory; None while only on disk
    spill_path: Path | None = None
    file_bytes: int = 0
    row_bytes: int = 0  # what its rows take in host memory
    prefetch: Future | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Host memory its rows take (when loaded)."""
        if self.rows is None:
            return self.row_bytes
        return sum(t.numel() * t.element_size() for t in self.rows.values())


class SwapStore:
    def __init__(self, host_budget_bytes: int, spill_dir: str | Path | None = None, disk_budget_bytes: int = 0,
                 *, rank: int = 0, world_size: int = 1, pin: bool = False) -> None:
        self.host_budget_bytes = host_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes if spill_dir is not None else 0
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.rank = rank
        self.pin = pin  # read spilled files into pinned memory (CUDA)
        self._snapshots: dict[str, SlotSnapshot] = {}
        # tier -> [snapshots, bytes], kept by `_account` at every change of what is held: a swap asks
        # for the host budget's use at each put, and summing every snapshot's rows then cost a placement
        # about 3 ms per call with 1,000 tenants evicted (issue 26: per-round cost grew with tenants)
        self._held: dict[str, list[int]] = {"host": [0, 0], "disk": [0, 0], "prefetched": [0, 0]}
        self._lock = threading.Lock()  # the snapshot table: the rank's calls and the prefetch thread
        self._reader: ThreadPoolExecutor | None = None
        self._folder_lock = None
        if self.spill_dir is not None:
            self._claim_folder(world_size)

    # -- the folder ---------------------------------------------------------------------------

    def _claim_folder(self, world_size: int) -> None:
        """T4: lock the folder for this rank, then remove what a previous process left."""
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            self._folder_lock = open(self.spill_dir / f".lock.rank{self.rank}", "a")  # noqa: SIM115 - held for life
        except OSError as e:
            raise SwapError(f"spill folder {self.spill_dir} is unusable: {type(e).__name__}: {e}") from e
        deadline = time.monotonic() + FOLDER_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._folder_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._folder_lock.close()
                    raise SwapError(f"spill folder {self.spill_dir} is in use by another trainer (rank {self.rank}) "
                                    f"for {FOLDER_LOCK_WAIT_S:.0f} s: give each trainer its own swap_spill_dir") from None
                time.sleep(0.1)  # a killed predecessor (trainer restart) releases it when its process ends
        removed = 0
        for path in self.spill_dir.iterdir():
            m = _OURS.fullmatch(path.name)
            if m and (int(m.group(1)) == self.rank or (self.rank == 0 and int(m.group(1)) >= world_size)):
                path.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("swap: removed %d spill file(s) a previous trainer left in %s", removed, self.spill_dir)

    def _path(self, key: str) -> Path:
        name = key if _SAFE_KEY.fullmatch(key) else (
            re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80] + "-" + hashlib.sha1(key.encode()).hexdigest()[:12])
        return self.spill_dir / f"{name}.rank{self.rank}.swap"

    # -- what is held -------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._snapshots

    def keys(self) -> list[str]:
        return list(self._snapshots)

    def spilled_keys(self) -> list[str]:
        return [k for k, s in self._snapshots.items() if s.spill_path is not None]

    def spill_path(self, key: str) -> Path | None:
        """The file of a spilled snapshot (None: in host memory, or no such key)."""
        snap = self._snapshots.get(key)
        return snap.spill_path if snap is not None else None

    def host_bytes(self) -> int:
        """Host memory held: host snapshots and prefetches (done or under way)."""
        return self._held["host"][1] + self._held["prefetched"][1]

    def disk_bytes(self) -> int:
        return self._held["disk"][1]

    def usage(self) -> dict:
        """Per tier: snapshots, bytes and budget (the service's gauges). A disk snapshot being or
        having been prefetched counts in "disk" and in "prefetched" (its rows take host memory)."""
        (nh, bh), (nd, bd), (nf, bf) = (self._held[t] for t in ("host", "disk", "prefetched"))
        return {"host": {"count": nh, "bytes": bh, "budget_bytes": self.host_budget_bytes},
                "disk": {"count": nd, "bytes": bd, "budget_bytes": self.disk_budget_bytes},
                "prefetched": {"count": nf, "bytes": bf}}

    def _account(self, snap: SlotSnapshot, sign: int) -> None:
        """Add (+1) or take away (-1) what ``snap`` holds, by its state now: called under the lock
        just after a snapshot comes into the table and just before it leaves or changes tier state
        (a prefetch started or forgotten), so `_held` is always the sum over the table."""
        if snap.spill_path is None:
            parts = [("host", snap.nbytes)]
        else:
            parts = [("disk", snap.file_bytes)] + ([("prefetched", snap.row_bytes)] if snap.prefetch is not None else [])
        for tier, nbytes in parts:
            self._held[tier][0] += sign
            self._held[tier][1] += sign * nbytes

    def _set_prefetch(self, snap: SlotSnapshot, prefetch: Future | None) -> None:
        """A stored snapshot's prefetch started (a future) or forgotten (None), its totals moved with
        it (caller holds the lock)."""
        self._account(snap, -1)
        snap.prefetch = prefetch
        self._account(snap, +1)

    # -- in and out -------------------------------------------------------------------------

    def put(self, key: str, snap: SlotSnapshot) -> str:
        """Store ``snap`` (rows in host memory); returns "host" or "disk". SwapError, nothing
        stored, when it fits neither tier or the spill write fails (T1)."""
        with self._lock:
            if key in self._snapshots:
                raise SwapError(f"a snapshot {key!r} is already stored; drop it first")
            need = snap.nbytes
            if self.host_bytes() + need <= self.host_budget_bytes:
                self._snapshots[key] = snap
                self._account(snap, +1)
                return "host"
            if self.spill_dir is None:
                raise SwapError(f"host-memory budget of {self.host_budget_bytes} bytes is used up ({self.host_bytes()} held, "
                                f"{need} more needed) and no spill folder is configured (trainer.swap_spill_dir)")
        spill = encode_spill(key, snap.meta, snap.pending, snap.rows)
        held = self.disk_bytes()
        if held + spill.size > self.disk_budget_bytes:
            raise SwapError(f"spill folder {self.spill_dir} is at its budget: {held} of {self.disk_budget_bytes} bytes "
                            f"held, {spill.size} more needed (raise trainer.swap_disk_budget_mb, or evict less)")
        path = self._path(key)
        try:
            write_spill_file(path, spill)
        except OSError as e:
            raise SwapError(f"spilling slot snapshot {key!r} to {self.spill_dir} failed: {type(e).__name__}: {e}") from e
        with self._lock:
            stored = SlotSnapshot(meta=snap.meta, pending=snap.pending.clone(), rows=None, spill_path=path,
                                  file_bytes=spill.size, row_bytes=need)
            self._snapshots[key] = stored
            self._account(stored, +1)
        return "disk"

    def load(self, key: str) -> tuple[SlotSnapshot, str]:
        """The snapshot with its rows in host memory, and how they got there ("host", "prefetched"
        or "disk": read now). It stays stored (T2): ``drop`` it once it is swapped in. SwapError
        when the key is unknown or its file cannot be read or verified."""
        with self._lock:
            snap = self._snapshots.get(key)
            if snap is None:
                raise SwapError(f"no evicted slot {key!r} on this trainer (held: {sorted(self._snapshots)})")
            if snap.spill_path is None:
                return snap, "host"
            pending = snap.prefetch
        if pending is not None:
            try:
                return pending.result(), "prefetched"
            except (OSError, SpillFileError) as e:
                with self._lock:
                    if snap.prefetch is pending and self._snapshots.get(key) is snap:
                        self._set_prefetch(snap, None)  # a later swap-in reads the file again
                raise SwapError(f"reading spilled snapshot {key!r} from {snap.spill_path}: {type(e).__name__}: {e}") from e
        try:
            return self._read(key, snap), "disk"
        except (OSError, SpillFileError) as e:
            raise SwapError(f"reading spilled snapshot {key!r} from {snap.spill_path}: {type(e).__name__}: {e}") from e

    def _read(self, key: str, snap: SlotSnapshot) -> SlotSnapshot:
        meta, pending, rows = read_spill_file(snap.spill_path, key, pin=self.pin)
        return SlotSnapshot(meta=meta, pending=pending.clone(), rows=rows, spill_path=snap.spill_path,
                            file_bytes=snap.file_bytes, row_bytes=snap.row_bytes)

    def prefetch(self, key: str) -> str:
        """Start reading a spilled snapshot into host memory in the background (T3). Returns
        "started", or why nothing started: "prefetching" / "prefetched" (already: under way /
        read), "host" (in memory), "absent" (no such key), "no room" (the host budget is used up)."""
        with self._lock:
            snap = self._snapshots.get(key)
            if snap is None:
                return "absent"
            if snap.spill_path is None:
                return "host"
            if snap.prefetch is not None:
                return "prefetched" if snap.prefetch.done() else "prefetching"
            if self.host_bytes() + snap.row_bytes > self.host_budget_bytes:
                return "no room"
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"swap-prefetch-rank{self.rank}")
            self._set_prefetch(snap, self._reader.submit(self._read, key, snap))
        return "started"

    def drop(self, key: str) -> bool:
        """Forget the snapshot and remove its file (T2, T3). False when there was none."""
        with self._lock:
            snap = self._snapshots.pop(key, None)
            if snap is not None:
                self._account(snap, -1)
        if snap is not None and snap.spill_path is not None:
            snap.spill_path.unlink(missing_ok=True)  # a prefetch still reading keeps its open file
        return snap is not None
