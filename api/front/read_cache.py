"""Reads that stay cheap under bursts (issue 26): `ReadCache`, one answer per (route, caller, query)
for concurrent requests and for `ttl_s` after it.

The API serves from the coordinator process, beside the training loop: every request's Python work
(SQL rows to refs, refs to JSON, a Prometheus page) takes the interpreter from the loop for its
duration. A burst of 100 dashboards asking for the same page used to build that page 100 times; here
the first request builds it and the 99 others wait for that one (single flight), and requests within
`ttl_s` of it are answered with the same bytes. So a burst costs the loop one build per distinct
query, whatever its size (an answer shared is one whose build started at most `ttl_s` before the
request came; with ttl_s 0, one whose build started after it came: a burst then costs two builds).
A write through the API (register, retire, abort) clears the cache: a
caller reads its own writes at once; what the loop changes (steps, states) shows within `ttl_s`.

Stale while refreshing (`stale_s` > 0): a request that finds an answer older than `ttl_s` but whose
build started at most `ttl_s + stale_s` before it is answered at once with those bytes, and one
build of a new answer starts in the background (one per key at a time). So a burst that comes
every few seconds waits for no build: a dashboard's poll every 2 s against ttl_s 1 s used to make
every burst wait for the build its first request started (issue 26: p99 under bursts). What the loop
changes then shows within `ttl_s + stale_s`; a write still clears everything (nothing stale after it).

Bounded: at most `max_entries` answers are kept (least recently stored out first). Event-loop
only (asyncio locks): no thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")  # an answer: the API's JSON bytes, the front's whole response (api/front/read_front.py)


class ReadCache(Generic[T]):
    def __init__(self, ttl_s: float, max_entries: int = 256, clock: Callable[[], float] = time.monotonic, *,
                 stale_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self._refreshing: dict[Hashable, asyncio.Task] = {}  # background builds (stale_s), one per key
        self.max_entries = max_entries
        self.clock = clock
        self._answers: OrderedDict[Hashable, tuple[float, int, T]] = OrderedDict()
        self._flights: dict[Hashable, asyncio.Lock] = {}
        self._generation = 0  # bumped by clear(): an answer built before a write is never stored after it
        self.builds = 0  # answers built (the rest were shared): for tests and benchmarks

    def clear(self) -> None:
        self._generation += 1
        self._answers.clear()

    def _fresh(self, key: Hashable, since: float) -> T | None:
        """The stored answer if its build started at `since` or later (and no write came after it)."""
        hit = self._answers.get(key)
        if hit is not None and hit[1] == self._generation and hit[0] >= since:
            return hit[2]
        return None

    async def get(self, key: Hashable, build: Callable[[], Awaitable[T]]) -> T:
        """The answer for `key`: one whose build started at most `ttl_s` before this request came (a
        stored one, or the one a concurrent request is building), else a new one from `build()`
        (whose exception reaches its own request only, and is not stored)."""
        now = self.clock()
        since = now - self.ttl_s
        hit = self._fresh(key, since)
        if hit is not None:
            return hit
        if self.stale_s > 0:
            stale = self._fresh(key, since - self.stale_s)
            if stale is not None:
                if key not in self._refreshing:
                    task = asyncio.get_running_loop().create_task(self._refresh(key, build))
                    self._refreshing[key] = task
                    task.add_done_callback(lambda _t, k=key: self._refreshing.pop(k, None))
                return stale
        return await self._build(key, build, since)

    async def _refresh(self, key: Hashable, build: Callable[[], Awaitable[T]]) -> None:
        """A background build (stale_s); its failure is logged, the stale answer ages out as usual."""
        try:
            await self._build(key, build, self.clock())
        except Exception:
            log.warning("refreshing the cached answer of %r failed", key, exc_info=True)

    async def _build(self, key: Hashable, build: Callable[[], Awaitable[T]], since: float) -> T:
        flight = self._flights.setdefault(key, asyncio.Lock())
        async with flight:
            hit = self._fresh(key, since)  # built while this request waited: it is as new as needed
            if hit is not None:
                return hit
            generation, started = self._generation, self.clock()
            body = await build()
            self.builds += 1
            self._answers[key] = (started, generation, body)  # of an older generation: never served (_fresh)
            self._answers.move_to_end(key)
            while len(self._answers) > self.max_entries:
                self._answers.popitem(last=False)
        if not flight.locked():
            self._flights.pop(key, None)
        return body
