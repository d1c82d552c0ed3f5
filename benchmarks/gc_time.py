"""The time this process spends in Python's cyclic garbage collector, by generation: a window's
`GcTime.read()` before and after. The collector's full (generation 2) passes walk every tracked
object, so a process that holds many (a thousand tenants' SDK clients and futures) pays more for
each, whatever its request rate; this tells that cost apart from the work itself.

  gc_clock = GcTime()          # starts counting (one per process is enough)
  a = gc_clock.read(); ...; b = gc_clock.read(); GcTime.between(a, b)
"""

from __future__ import annotations

import gc
import time


class GcTime:
    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]  # per generation, since this object was made
        self.count = [0, 0, 0]
        self._started: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            gen = info.get("generation", 2)
            self.seconds[gen] += time.perf_counter() - self._started
            self.count[gen] += 1
            self._started = None

    def read(self) -> tuple[list[float], list[int], int]:
        """(seconds per generation, collections per generation, objects tracked now)."""
        return list(self.seconds), list(self.count), len(gc.get_objects())

    @staticmethod
    def between(before: tuple, after: tuple) -> dict:
        """What the collector did between two readings: seconds and collections per generation, and the
        objects it tracked at the second."""
        return {"seconds": [round(b - a, 4) for a, b in zip(before[0], after[0])],
                "collections": [b - a for a, b in zip(before[1], after[1])], "tracked_objects": after[2]}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
