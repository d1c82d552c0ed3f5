"""Shared host memory for export snapshots (issue 28): one mapping that the trainer copies
snapshots into and that writer processes read the files' data from (trainer/export/export_process.py).

The arena is an anonymous shared-memory file (memfd) of a fixed size, mapped once in the
trainer rank; a writer process maps the same file (its descriptor is passed at the process's
start), so a snapshot reaches the writer without a copy and without the GIL. On CUDA the
whole mapping is registered with the driver once (cudaHostRegister: page-locked), so the
snapshot's device->host copy runs asynchronously on the copy engine straight into it, as into
torch's pinned memory, with no allocation per snapshot.

Invariants:
* Blocks are disjoint ranges of the arena, aligned to ALIGN bytes; a block is handed out by
  `alloc` and returned exactly once by `ArenaBlock.release` (a second release is refused). A
  block may take more of the arena than its data (`alloc(..., reserve=)`): callers that give
  every block one size keep the free ranges multiples of it, so k blocks fit in k blocks' bytes
  whatever the order of allocations and releases (no fragmentation).
* The arena is the bound on snapshot memory: `alloc` waits (the caller's thread: back-pressure)
  until a free range of the size exists; a request larger than the whole arena is refused at
  once (`fits` says so first; the caller then uses private memory).
* A block may be released while a device->host copy into it is still in flight (a superseded
  snapshot): every copy into the arena is queued on the rank's one copy stream, in call order,
  so a later copy into the same range runs after it; the host never reads a released block.
* The mapping is never unmapped while the trainer lives (torch tensors view it); the file goes
  away with the last process that maps it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

import torch

ALIGN = 4096  # block alignment: pages, so a writer's file write starts page-aligned


class ArenaFull(RuntimeError):
    """A block larger than the whole arena was asked for."""


@dataclass
class ArenaBlock:
    """`nbytes` bytes at `offset` of `arena`: `tensor` views them (uint8, on the host)."""

    arena: "HostArena"
    offset: int
    nbytes: int
    tensor: torch.Tensor
    size: int  # arena bytes it takes (block_bytes of nbytes, or of the reserve when larger)
    _released: bool = False

    def release(self) -> None:
        if self._released:
            raise RuntimeError(f"arena block at {self.offset} ({self.nbytes} bytes) released twice")
        self._released = True
        self.tensor = None  # type: ignore[assignment]  # no view outlives the block
        self.arena._free_range(self.offset, self.size)


class HostArena:
    """`nbytes` of shared host memory (module docstring); `register`: page-lock it for CUDA copies."""

    def __init__(self, nbytes: int, *, register: bool = False, name: str = "lorafleet-export-arena") -> None:
        if nbytes < ALIGN:
            raise ValueError(f"an arena needs at least {ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes - nbytes % ALIGN
        self.fd = os.memfd_create(name)  # close-on-exec; passed to writer processes explicitly (pass_fds)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # the whole arena; blocks view it
        self.registered = False
        self.register_seconds = 0.0
        if register:
            t0 = time.perf_counter()
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte export arena failed (cudaError {int(err)})")
            self.registered = True
            self.register_seconds = time.perf_counter() - t0
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted, coalesced
        self.used = 0  # bytes in blocks handed out
        self.blocks = 0  # blocks handed out and not yet released
        self.wait_seconds = 0.0  # time `alloc` calls waited for room (back-pressure)
        self.waiters = 0  # alloc calls waiting now (tests observe it)

    def fits(self, nbytes: int, *, reserve: int = 0) -> bool:
        """Whether a block of `nbytes` (taking `reserve`, if larger) can ever be handed out (it is no larger than the arena)."""
        return block_bytes(max(nbytes, reserve)) <= self.nbytes

    def room_for(self, nbytes: int, *, reserve: int = 0) -> bool:
        """Whether `alloc(nbytes, reserve=reserve)` would return now without waiting."""
        size = block_bytes(max(nbytes, reserve))
        with self._cond:
            return self._fits_now(size)

    def largest_free(self) -> int:
        with self._cond:
            return max((n for _, n in self._free), default=0)

    def alloc(self, nbytes: int, *, reserve: int = 0) -> ArenaBlock:
        """A block of `nbytes` that takes max(nbytes, reserve) of the arena (rounded up to ALIGN),
        waiting until a free range of that size exists."""
        size = block_bytes(max(nbytes, reserve))
        if size > self.nbytes:
            raise ArenaFull(f"a {nbytes}-byte snapshot does not fit the {self.nbytes}-byte export arena")
        with self._cond:
            offset = self._take(size)
            if offset is None:
                self.waiters += 1
                t0 = time.perf_counter()
                try:
                    self._cond.wait_for(lambda: self._fits_now(size))
                finally:
                    self.waiters -= 1
                    self.wait_seconds += time.perf_counter() - t0
                offset = self._take(size)
            self.used += size
            self.blocks += 1
        return ArenaBlock(self, offset, nbytes, self.tensor[offset : offset + nbytes], size)

    def _fits_now(self, size: int) -> bool:
        return any(n >= size for _, n in self._free)

    def _take(self, size: int) -> int | None:
        """First fit (the lowest offset: blocks stay packed at the start of the arena)."""
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, n - size)
                return off
        return None

    def _free_range(self, offset: int, size: int) -> None:
        with self._cond:
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < offset:
                i += 1
            if (i > 0 and free[i - 1][0] + free[i - 1][1] > offset) or (i < len(free) and offset + size > free[i][0]):
                raise RuntimeError(f"arena range {offset}+{size} overlaps a free range: released twice")
            free.insert(i, (offset, size))
            if i + 1 < len(free) and offset + size == free[i + 1][0]:  # merge with the next
                free[i] = (offset, size + free[i + 1][1])
                del free[i + 1]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:  # and with the previous
                free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
                del free[i]
            self.used -= size
            self.blocks -= 1
            self._cond.notify_all()


def block_bytes(nbytes: int) -> int:
    """The arena bytes a block of `nbytes` takes (rounded up to ALIGN)."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
