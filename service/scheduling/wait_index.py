"""The evicted Tinker models that have work, found without looking at every model each round.

With a thousand Tinker models waiting through 8 slots, the placement used to ask every evicted model
for its head call at every round (`slot_wait`, and `offer_unplaced` for the operations that need no
slot): at K = 1,024 that scan was most of `place`'s busy samples on the loop's thread (py-spy,
issue 41). Only a model whose queue changed since the last look can have new work, so the index
looks at those, and takes the oldest waiters off a heap.

Invariants (the scheduler and its models keep them):
  W1 a model is `touch`ed (any thread: one deque append) when it is admitted, when it is evicted,
     and when its queue changes while it is evicted: a call submitted, given back or replayed, an
     unload taken, a call cancelled (the Tinker face's cancel);
  W2 while a model waits, its `slot_wait()` only grows without a touch: its head call is taken or
     cancelled (the next one arrived later). A value appearing where there was none, or a smaller
     one (calls replayed ahead), comes with a touch (W1). So the heap's entry of a waiting model is
     at most its current value; an entry met at the top is checked, and pushed again with the
     current value when it grew: the order out of `waiting` is the order of the current values, as
     a scan and a sort would give;
  W3 `take_unplaced()` returns the touched evicted models (for their unloads), each once; a model
     dropped from the heap because its head no longer needs a slot is touched again, so an unload
     behind a call cancelled before its touch is found at the next look.
The index lives on the loop's thread (the scheduler's); only `touch` is called from others.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any


class WaitIndex:
    """Evicted models with a call waiting for a slot, by `slot_wait` (oldest first), and the touched ones
    (for what needs no slot). `model(key)`: the model (None once removed); its looks take `resident(key)`
    (it holds a slot now)."""

    def __init__(self, model: Callable[[str], Any]) -> None:
        self._model = model
        self._touched: deque[str] = deque()  # W1: appended on any thread, drained on the loop's
        self._heap: list[tuple[float, str]] = []  # (slot_wait when pushed, key)
        self._pushed: dict[str, float] = {}  # key -> the value of its one live heap entry
        self._unplaced: dict[str, Any] = {}  # touched evicted models not yet given to take_unplaced
        self._newly: dict[str, Any] = {}  # touched evicted models that wait, not yet given to take_newly_waiting

    def touch(self, key: str) -> None:
        """Any thread: `key`'s queue or eviction changed (W1)."""
        self._touched.append(key)

    def refresh(self, resident: Callable[[str], bool]) -> None:
        """Take in the touched models (each once): a waiting one's entry is brought up to date."""
        seen: set[str] = set()
        while self._touched:
            key = self._touched.popleft()
            if key in seen:
                continue
            seen.add(key)
            m = self._model(key)
            if m is None or resident(key):
                continue
            self._unplaced[key] = m
            since = m.slot_wait()
            if since is None:
                continue
            self._newly[key] = m
            if self._pushed.get(key) != since:
                self._pushed[key] = since
                heapq.heappush(self._heap, (since, key))

    def waiting(self, resident: Callable[[str], bool], want: int,
                counts: Callable[[Any], bool] = lambda m: True) -> list[tuple[float, Any]]:
        """(slot_wait, model) of the evicted models with a call waiting for a slot, oldest first (W2),
        until `want` of them `counts` (all of them when fewer do); they stay in the index. Call
        `refresh` first."""
        taken: list[tuple[float, str]] = []
        out: list[tuple[float, Any]] = []
        counted = 0
        while self._heap and counted < want:
            since, key = heapq.heappop(self._heap)
            if self._pushed.get(key) != since:
                continue  # an older entry of a key pushed again since
            m = self._model(key)
            now = m.slot_wait() if m is not None and not resident(key) else None
            if now == since:
                taken.append((since, key))
                out.append((since, m))
                counted += counts(m)
            elif now is None:  # resident, gone, or nothing queued that needs a slot: its next touch brings it back
                del self._pushed[key]
                if m is not None:
                    self._touched.append(key)  # W3: its head may have become an unload
            else:  # W2: it has waited since later than its entry says
                self._pushed[key] = now
                heapq.heappush(self._heap, (now, key))
        for entry in taken:
            heapq.heappush(self._heap, entry)
        return out

    def take_newly_waiting(self) -> list[Any]:
        """The evicted models found waiting for a slot since the last call (for the placement to tell them why)."""
        out, self._newly = list(self._newly.values()), {}
        return out

    def take_unplaced(self) -> list[Any]:
        """The evicted models touched since the last call (W3), for their operations that need no slot."""
        out, self._unplaced = list(self._unplaced.values()), {}
        return out
