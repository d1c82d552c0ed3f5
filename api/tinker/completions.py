"""Batched polling: ``POST /api/v1/retrieve_futures``, what tinker 0.38's ``SessionFuturesPoller``
sends when ``/api/v1/client/config`` answers ``sample_use_retrieve_futures: true``.

The SDK then runs ONE background long poll per sampling client (a sampling session, or a clone of
it: ``cloned_sampler_id = seq_id // 1_000_000_000``) instead of one ``retrieve_future`` poll per
sample in flight; a sample's future waits until the poller reports its request completed, then
fetches the result with one ``retrieve_future``. The wire (tinker.types.futures_retrieve_request,
futures_retrieve_response, future_completion):

    request  {"target": {"type": "sampling_session", "sampling_session_id", "cloned_sampler_id"},
              "prev_cursor", "timeout", "retrieved_request_ids"}
    response {"completions": [{"state": "finished", "request_id", "response_payload_uncompressed_size"}
                              | {"state": "failed", "request_id"}], "cursor"}

Here (`Completions`, owned by the FutureStore, api/tinker/futures.py; on the serving loop only):
  Q1 a sample future made with a sampling session and a ``seq_id`` joins its target's queue (tenant,
     session, clone) when it resolves, under the next cursor of one counter of the process: cursors
     grow across every target, so a cursor says "everything up to here".
  Q2 a poll answers the target's completions after ``prev_cursor``, at once when there are any; else
     it waits for one up to ``timeout`` (0: answers at once, the SDK's ack-only poll; None: the long
     poll, ``long_poll_s``). Its cursor is the newest one answered, never below ``prev_cursor``. A
     poll costs the loop its own completions, whatever the number of futures in flight: no thread,
     no scan, no read of the records.
  Q3 ownership: a target is its tenant's (the route answers 404 for another tenant's session, as
     for one that does not exist); ``retrieved_request_ids`` of another tenant change nothing.
  Q4 bounded: completions up to ``prev_cursor`` are acknowledged and dropped, and so are retrieved
     ones (named in ``retrieved_request_ids``, or answered by ``retrieve_future``, which a client
     without the poller uses); a target's queue keeps at most ``max_per_target``; an empty queue
     nobody polls is forgotten.
  Q5 a restart: cursors start at the process's start time in microseconds, so an earlier process's
     cursor is below this one's (as is 0, a poller's first), and a cursor this process never gave
     out is treated the same: such a poll gets everything its target's queue holds, plus the
     samples of its tenant that were in flight at the restart (their target is not recorded: each
     answers "failed", its fetch answers 410 and the SDK sends it again), so no waiter is left
     behind. Those are kept `ORPHAN_TTL_S` at most, `max_per_target` per tenant.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

CLONE_SPAN = 1_000_000_000  # the SDK numbers a clone's requests from clone id x CLONE_SPAN (sampling_client.py)
ORPHAN_TTL_S = 600.0  # a sample in flight at a restart is reported to its tenant's pollers this long at most

Target = tuple[str, int]  # (sampling session id, clone id)


def target_of(sampling_session_id: str | None, seq_id: int | None) -> Target | None:
    """The poll target a sample request belongs to (None: not sent by a sampling client's session)."""
    if sampling_session_id is None or seq_id is None or seq_id < 0:
        return None
    return sampling_session_id, seq_id // CLONE_SPAN


@dataclass
class _Queue:
    entries: OrderedDict[str, tuple[int, dict]] = field(default_factory=OrderedDict)  # request id -> (cursor, completion)
    waiters: set[asyncio.Future] = field(default_factory=set)


def completion(request_id: str, failed: bool, size: int) -> dict:
    """One completion as the SDK reads it (a failed request has no payload size)."""
    if failed:
        return {"state": "failed", "request_id": request_id}
    return {"state": "finished", "request_id": request_id, "response_payload_uncompressed_size": size}


class Completions:
    def __init__(self, long_poll_s: float, max_per_target: int = 10000, clock=time.time) -> None:  # noqa: ANN001
        self.long_poll_s = long_poll_s
        self.max_per_target = max_per_target
        self.base = int(clock() * 1e6)  # Q5
        self._last = self.base
        self._queues: dict[tuple[str, Target], _Queue] = {}
        self._orphans: dict[str, OrderedDict[str, tuple[float, dict]]] = {}  # tenant -> request id -> (when, completion)
        self._clock = clock

    # -- filled as futures resolve (FutureStore.resolve) -----------------------------------------

    def add(self, tenant: str, target: Target, request_id: str, failed: bool, size: int) -> None:
        """Q1: `request_id` of `target` completed; a poll waiting on the target answers now."""
        q = self._queues.setdefault((tenant, target), _Queue())
        self._last += 1
        q.entries[request_id] = (self._last, completion(request_id, failed, size))
        while len(q.entries) > self.max_per_target:
            q.entries.popitem(last=False)
        for w in q.waiters:
            if not w.done():
                w.set_result(None)

    def add_orphan(self, tenant: str, request_id: str) -> None:
        """Q5: a sample of an earlier process, answered failed (410) in this one; its target is unknown."""
        orphans = self._orphans.setdefault(tenant, OrderedDict())
        orphans[request_id] = (self._clock(), completion(request_id, True, 0))
        while len(orphans) > self.max_per_target:
            orphans.popitem(last=False)

    def retrieved(self, tenant: str, request_ids: list[str], target: Target | None = None) -> None:
        """Q4: these results were fetched; their completions are needed no more (the tenant's only:
        `target`'s queue, and the orphans)."""
        q = self._queues.get((tenant, target)) if target is not None else None
        orphans = self._orphans.get(tenant, {})
        for rid in request_ids:
            if q is not None:
                q.entries.pop(rid, None)
            orphans.pop(rid, None)

    # -- the poll ------------------------------------------------------------------------------

    def known(self, cursor: int) -> bool:
        """Whether `cursor` is one this process gave out (or its start): Q5 otherwise."""
        return self.base <= cursor <= self._last

    async def poll(self, tenant: str, target: Target, prev_cursor: int, timeout: float | None,
                   retrieved: list[str] = ()) -> dict:
        """Q2: the completions of `tenant`'s `target` after `prev_cursor`, waiting for one up to `timeout`."""
        key = (tenant, target)
        q = self._queues.setdefault(key, _Queue())
        if retrieved:
            self.retrieved(tenant, list(retrieved), target)
        foreign = not self.known(prev_cursor)
        after = -1 if foreign else prev_cursor
        for rid in [r for r, (c, _) in q.entries.items() if c <= after]:  # acknowledged (Q4)
            del q.entries[rid]
        wait_s = self.long_poll_s if timeout is None else min(float(timeout), self.long_poll_s)
        if not q.entries and not (foreign and self._live_orphans(tenant)) and wait_s > 0:
            waiter = asyncio.get_running_loop().create_future()
            q.waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, wait_s)
            except TimeoutError:
                pass
            finally:
                q.waiters.discard(waiter)
        found = [done for _, done in q.entries.values()]
        if foreign:
            found += [done for _, done in self._live_orphans(tenant)]
        # the newest cursor answered; with none, where the caller stands (a foreign cursor: this process's newest)
        cursor = max((c for c, _ in q.entries.values()), default=self._last if foreign else prev_cursor)
        if not q.entries and not q.waiters:
            self._queues.pop(key, None)  # Q4: nothing kept for a target nobody waits on
        return {"completions": found, "cursor": cursor}

    def _live_orphans(self, tenant: str) -> list[tuple[float, dict]]:
        orphans = self._orphans.get(tenant)
        if not orphans:
            return []
        limit = self._clock() - ORPHAN_TTL_S
        for rid in [r for r, (at, _) in orphans.items() if at < limit]:
            del orphans[rid]
        return list(orphans.values())

    def size(self) -> int:
        """Completions held (every target and the orphans): the bound of Q4, for tests and gauges."""
        return sum(len(q.entries) for q in self._queues.values()) + sum(len(o) for o in self._orphans.values())
