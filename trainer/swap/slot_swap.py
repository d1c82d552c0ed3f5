"""Keep-warm eviction of a slot: its whole state out of the device into this rank's swap store
(trainer/swap/swap_store.py: host memory, then a spill folder) and back into any free slot, bit-exact.

A slot's state on a trainer rank is exactly one row of each of the four slot-major
buffers (trainer/lora/slot_buffers.py: weight, grad, exp_avg, exp_avg_sq, this rank's
TP shard and DP part; a slot with bfloat16 moments has both in its exp_avg row and an unused,
zero exp_avg_sq row, which is not copied: ``row_kinds``, 12 bytes per parameter instead of 16)
plus its ``SlotState`` (hyper-parameters, rank, scale, step,
pending sample count and loss statistics). Every slot's row has the same column
layout, so a snapshot taken from slot i can come back into any free slot j: four
row copies each way, no gather over TP, no format conversion, so nothing is rounded.
The trainer draws no random numbers after init_slot (trainer/swap/slot_checkpoint.py), so there
is no generator state to carry.

Invariants:
  S1 a slot is cleared only after its snapshot is stored (in memory or on disk): a failed
     spill (disk full, the spill budget reached, ...) raises ``SwapError`` and leaves the
     slot resident and unchanged, so nothing is lost;
  S2 ``swap_in`` writes back exactly the bytes taken out (rows and counters) from whichever
     tier holds them, or fails (a corrupt spill file) leaving the slot free and the snapshot
     stored; the restored slot trains on as if it had never left;
  S3 snapshots live in the trainer processes (and their spill files): a trainer restart loses
     them (the run then resumes from its last checkpoint, as after any trainer loss), and the
     restarted trainer removes the files.
"""

from __future__ import annotations

import time

import torch

from trainer.lora.slot_buffers import BUFFER_KINDS, row_kinds
from trainer.lora.slots import SlotState, SlotTable
from trainer.swap.swap_store import SlotSnapshot, SwapError, SwapStore

__all__ = ["SlotSwap", "SwapError", "copy_rows_in", "copy_rows_out"]


class SlotSwap:
    """Evicting a slot of ``slots`` into ``store`` under a key, and bringing it back. Collective:
    every rank stores its own part."""

    def __init__(self, slots: SlotTable, store: SwapStore) -> None:
        self.slots = slots
        self.store = store

    def swap_out(self, slot: int, key: str) -> dict:
        """Evict the slot: its rows and counters go to this rank's swap store under ``key``
        (host memory, or the spill folder beyond the host budget), then the slot is cleared.
        Raises SwapError with the slot unchanged when the snapshot cannot be stored (S1)."""
        state = self.slots.state(slot)
        if key in self.store:
            raise SwapError(f"a snapshot {key!r} is already stored on this trainer")
        t0 = time.perf_counter()
        rows = copy_rows_out(self.slots.buffers.by_kind(), slot, row_kinds(state.hyper.state_dtype))
        snap = SlotSnapshot(meta=state.counters(), pending=state.pending.clone(), rows=rows)
        where = self.store.put(key, snap)
        self.slots.vacate(slot)
        return {"key": key, "slot": slot, "where": where, "bytes": snap.nbytes, "seconds": time.perf_counter() - t0,
                "step": state.step}

    def swap_in(self, slot: int, key: str) -> dict:
        """Bring the snapshot ``key`` back into the free ``slot`` (any slot: every row has the
        same layout), bit-exact (S2); then the store forgets it."""
        self.slots.require_free(slot, f"clear or swap it out before swapping {key!r} in")
        t0 = time.perf_counter()
        tier = "disk" if self.store.spill_path(key) is not None else "host"
        snap, how = self.store.load(key)
        state = SlotState.from_counters(snap.meta, snap.pending.clone())
        try:
            copy_rows_in(self.slots.buffers.by_kind(), slot, snap.rows, row_kinds(state.hyper.state_dtype))
        except BaseException:
            self.slots.buffers.zero_slot(slot)  # the slot stays free; the snapshot stays stored
            raise
        self.slots.occupy(slot, state)
        self.store.drop(key)
        return {"key": key, "slot": slot, "seconds": time.perf_counter() - t0, "step": state.step,
                "from": tier, "prefetched": how == "prefetched"}

    def prefetch(self, key: str) -> str:
        """Read a spilled snapshot into host memory in the background, so its swap-in is only a
        copy to the device (swap_store.py T3: safe to repeat, or for a dropped key)."""
        return self.store.prefetch(key)

    def drop(self, key: str) -> bool:
        """Forget an evicted slot and remove its file (its run retired or failed while out)."""
        return self.store.drop(key)

    def swapped(self) -> dict:
        """What this rank holds evicted: keys, host bytes (prefetches included), and which are spilled."""
        return {"keys": self.store.keys(), "host_bytes": self.store.host_bytes(), "spilled": self.store.spilled_keys()}

    def tiers(self) -> dict:
        """Per tier (host, disk, prefetched): snapshots, bytes and budget."""
        return self.store.usage()


def copy_rows_out(buffers: dict[str, torch.Tensor], slot: int,
                  kinds: tuple[str, ...] = BUFFER_KINDS) -> dict[str, torch.Tensor]:
    """The slot's row of each buffer of ``kinds`` (``buffers``: SlotBuffers.by_kind()), copied
    to host memory (pinned where CUDA is)."""
    out = {}
    for kind in kinds:
        row = buffers[kind][slot]
        host = torch.empty(row.shape, dtype=row.dtype, pin_memory=row.is_cuda)
        host.copy_(row, non_blocking=row.is_cuda)
        out[kind] = host
    _wait_for_copies(buffers)
    return out


def copy_rows_in(buffers: dict[str, torch.Tensor], slot: int, rows: dict[str, torch.Tensor],
                 kinds: tuple[str, ...] = BUFFER_KINDS) -> None:
    """Write ``rows`` (exactly the buffers ``kinds``) into the free ``slot``; the rows of the other
    buffers stay as a free slot's are: zero."""
    if sorted(rows) != sorted(kinds):
        raise SwapError(f"snapshot has rows {sorted(rows)}; its slot's state needs exactly {sorted(kinds)}")
    for kind in kinds:
        dest = buffers[kind][slot]
        if rows[kind].shape != dest.shape or rows[kind].dtype != dest.dtype:
            raise SwapError(
                f"snapshot row {kind} is {tuple(rows[kind].shape)} {rows[kind].dtype}; this trainer's slots are "
                f"{tuple(dest.shape)} {dest.dtype} (a snapshot only comes back into the trainer that took it)"
            )
    with torch.no_grad():
        for kind in kinds:
            buffers[kind][slot].copy_(rows[kind], non_blocking=rows[kind].is_pinned())
    _wait_for_copies(buffers)


def _wait_for_copies(buffers: dict[str, torch.Tensor]) -> None:
    """Wait for the row copies just issued: they run on the current stream, so that stream is
    what is waited for, not the whole device (a device-wide sync also waited for the publish
    snapshots' device->host copies on the export copy stream, trainer/export/peft_export.py: up to 5.6 GB
    at N = 64 at 8B, about 100 ms, at every turn)."""
    cuda = next((buffers[k] for k in BUFFER_KINDS if buffers[k].is_cuda), None)
    if cuda is not None:
        torch.cuda.current_stream(cuda.device).synchronize()
