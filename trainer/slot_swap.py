"""Keep-warm eviction of a slot: its whole state out to host memory (or a spill folder) and back, bit-exact.

A slot's state on a trainer rank is exactly one row of each of the four slot-major
buffers (trainer/slot_buffers.py: weight, grad, exp_avg, exp_avg_sq, this rank's
TP shard and DP part) plus its ``SlotState`` (hyper-parameters, rank, scale, step,
pending sample count and loss statistics). Every slot's row has the same column
layout, so a snapshot taken from slot i can come back into any free slot j: four
row copies each way, no gather over TP, no format conversion, so nothing is rounded.

Where a snapshot lives (``SwapStore``), per rank, in the rank's own process:
  * host memory (pinned on CUDA, so the copies are DMA), up to ``host_budget_bytes``;
  * beyond the budget, a file in ``spill_dir`` (torch.save of the rows and the
    state as plain JSON-able values; read back with ``weights_only=True``).

Invariants:
  S1 a slot is cleared only after its snapshot is stored (in memory or on disk): a
     failed spill (disk full, ...) raises ``SwapError`` and leaves the slot resident
     and unchanged, so nothing is lost;
  S2 ``swap_in`` writes back exactly the bytes taken out (rows and counters); the
     restored slot trains on as if it had never left;
  S3 snapshots live in the trainer processes: a trainer restart loses them (the run
     then resumes from its last checkpoint, as after any trainer loss).
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.slot_buffers import BUFFER_KINDS
from trainer.slots import SlotState, SlotTable


class SwapError(RuntimeError):
    """A swap could not be done; the slot (or the stored snapshot) is as it was."""


@dataclass
class SlotSnapshot:
    """One evicted slot on one rank: its buffer rows and its counters (``meta``: JSON-able)."""

    meta: dict
    pending: torch.Tensor  # float64 loss statistics accumulated toward the next step
    rows: dict[str, torch.Tensor] | None  # kind -> row; None while spilled
    spill_path: Path | None = None

    @property
    def nbytes(self) -> int:
        rows = self.rows or {}
        return sum(t.numel() * t.element_size() for t in rows.values())


class SwapStore:
    """This rank's evicted slots by key: host memory first, a spill folder beyond the budget."""

    def __init__(self, host_budget_bytes: int | None = None, spill_dir: str | Path | None = None, rank: int = 0) -> None:
        self.host_budget_bytes = host_budget_bytes  # None: no limit
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.rank = rank
        self._snapshots: dict[str, SlotSnapshot] = {}

    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self._snapshots.values())

    def __contains__(self, key: str) -> bool:
        return key in self._snapshots

    def keys(self) -> list[str]:
        return list(self._snapshots)

    def spilled_keys(self) -> list[str]:
        return [k for k, s in self._snapshots.items() if s.spill_path is not None]

    def put(self, key: str, snap: SlotSnapshot) -> str:
        """Store ``snap``; returns "host" or "disk". Raises SwapError (nothing stored) if it
        does not fit in host memory and cannot be spilled."""
        if key in self._snapshots:
            raise SwapError(f"a snapshot {key!r} is already stored; take or drop it first")
        budget = self.host_budget_bytes
        if budget is None or self.host_bytes() + snap.nbytes <= budget:
            self._snapshots[key] = snap
            return "host"
        self._spill(key, snap)
        self._snapshots[key] = snap
        return "disk"

    def _spill(self, key: str, snap: SlotSnapshot) -> None:
        if self.spill_dir is None:
            raise SwapError(
                f"host-memory budget of {self.host_budget_bytes} bytes is used up ({self.host_bytes()} held) and "
                "no spill folder is configured"
            )
        path = self.spill_dir / f"{key}.rank{self.rank}.pt"
        tmp = path.with_suffix(".tmp")
        # Serialized in memory and written with plain file I/O, so a full disk is an OSError
        # that names itself (torch.save's own writer reports it as an opaque iostream error).
        buf = io.BytesIO()
        torch.save({"meta": snap.meta, "pending": snap.pending, "rows": snap.rows}, buf)
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(buf.getbuffer())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # the folder itself is unusable (e.g. a file in its place): nothing was written
                pass
            raise SwapError(f"spilling slot snapshot {key!r} to {self.spill_dir} failed: {type(e).__name__}: {e}") from e
        snap.rows, snap.spill_path = None, path

    def take(self, key: str) -> SlotSnapshot:
        """Remove and return the snapshot (read back from its spill file if it was spilled).
        On a failed read the snapshot stays stored."""
        try:
            snap = self._snapshots[key]
        except KeyError:
            raise SwapError(f"no evicted slot {key!r} on this trainer (held: {sorted(self._snapshots)})") from None
        if snap.rows is None:
            try:
                saved = torch.load(snap.spill_path, weights_only=True)
            except (OSError, RuntimeError) as e:
                raise SwapError(f"reading spilled snapshot {key!r} from {snap.spill_path}: {type(e).__name__}: {e}") from e
            snap = SlotSnapshot(meta=saved["meta"], pending=saved["pending"], rows=saved["rows"], spill_path=snap.spill_path)
        del self._snapshots[key]
        if snap.spill_path is not None:
            snap.spill_path.unlink(missing_ok=True)
        return snap

    def drop(self, key: str) -> bool:
        snap = self._snapshots.pop(key, None)
        if snap is not None and snap.spill_path is not None:
            snap.spill_path.unlink(missing_ok=True)
        return snap is not None


class SlotSwap:
    """Evicting a slot of ``slots`` into ``store`` under a key, and bringing it back. Collective:
    every rank stores its own part."""

    def __init__(self, slots: SlotTable, store: SwapStore) -> None:
        self.slots = slots
        self.store = store

    def swap_out(self, slot: int, key: str) -> dict:
        """Evict the slot: its rows and counters go to this rank's swap store under ``key``
        (host memory, or the spill folder beyond the budget), then the slot is cleared.
        Raises SwapError with the slot unchanged when the snapshot cannot be stored (S1)."""
        state = self.slots.state(slot)
        if key in self.store:
            raise SwapError(f"a snapshot {key!r} is already stored on this trainer")
        rows, seconds = timed(lambda: copy_rows_out(self.slots.buffers.by_kind(), slot))
        snap = SlotSnapshot(meta=state.counters(), pending=state.pending.clone(), rows=rows)
        nbytes = snap.nbytes
        where = self.store.put(key, snap)
        self.slots.vacate(slot)
        return {"key": key, "slot": slot, "where": where, "bytes": nbytes, "seconds": seconds, "step": state.step}

    def swap_in(self, slot: int, key: str) -> dict:
        """Bring the snapshot ``key`` back into the free ``slot`` (any slot: every row has the
        same layout), bit-exact (S2)."""
        self.slots.require_free(slot, f"clear or swap it out before swapping {key!r} in")
        t0 = time.perf_counter()
        snap = self.store.take(key)
        try:
            copy_rows_in(self.slots.buffers.by_kind(), slot, snap.rows)
        except BaseException:
            self.slots.buffers.zero_slot(slot)
            self.store.put(key, snap)  # keep it for another try (the slot stays free)
            raise
        state = SlotState.from_counters(snap.meta, snap.pending.clone())
        self.slots.occupy(slot, state)
        return {"key": key, "slot": slot, "seconds": time.perf_counter() - t0, "step": state.step,
                "from": "disk" if snap.spill_path is not None else "host"}

    def drop(self, key: str) -> bool:
        """Forget an evicted slot (its run retired or failed while out)."""
        return self.store.drop(key)

    def swapped(self) -> dict:
        """What this rank holds evicted: keys, host bytes, and which are spilled."""
        return {"keys": self.store.keys(), "host_bytes": self.store.host_bytes(), "spilled": self.store.spilled_keys()}


def copy_rows_out(buffers: dict[str, torch.Tensor], slot: int) -> dict[str, torch.Tensor]:
    """The slot's row of each buffer (``buffers``: SlotBuffers.by_kind()), copied to host memory
    (pinned where CUDA is)."""
    out = {}
    for kind in BUFFER_KINDS:
        row = buffers[kind][slot]
        host = torch.empty(row.shape, dtype=row.dtype, pin_memory=row.is_cuda)
        host.copy_(row, non_blocking=row.is_cuda)
        out[kind] = host
    if any(buffers[k].is_cuda for k in BUFFER_KINDS):
        torch.cuda.synchronize()
    return out


def copy_rows_in(buffers: dict[str, torch.Tensor], slot: int, rows: dict[str, torch.Tensor]) -> None:
    for kind in BUFFER_KINDS:
        dest = buffers[kind][slot]
        if rows[kind].shape != dest.shape or rows[kind].dtype != dest.dtype:
            raise SwapError(
                f"snapshot row {kind} is {tuple(rows[kind].shape)} {rows[kind].dtype}; this trainer's slots are "
                f"{tuple(dest.shape)} {dest.dtype} (a snapshot only comes back into the trainer that took it)"
            )
    with torch.no_grad():
        for kind in BUFFER_KINDS:
            buffers[kind][slot].copy_(rows[kind], non_blocking=rows[kind].is_pinned())
    if any(buffers[k].is_cuda for k in BUFFER_KINDS):
        torch.cuda.synchronize()


def timed(fn):  # noqa: ANN001, ANN201
    """(result, seconds) of fn()."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
