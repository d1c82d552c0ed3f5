"""Request ids and their results: the SDK's futures protocol, durable (issue 40).

Every POST that starts work answers ``{"request_id", "model_id"}`` at once; the SDK
then polls ``retrieve_future``. A retrieve waits up to ``poll_s`` (POLL_HOLD_S) for the result and
otherwise answers ``{"type": "try_again", ...}`` (the SDK polls again). A finished
request answers its JSON result, protobuf bytes (ForwardBackwardOutput), or
``{"error", "category"}`` (category ``user`` for bad input: the SDK raises it and does
not retry). A future belongs to the tenant that made it: another tenant's id is 404.

Every future is a record (service/registry/tinker_records.py): created before its id is answered
(the route awaits `durable()`), its result written when it resolves and kept `result_ttl_s` after.
So a client that polls across a restart finds its future: pending (its operation runs again after
the restart, or answers why it cannot; a sample in flight answers 410, which the SDK's sampling
client answers by sending it again) or done (its result). Waiters of this process are in memory;
a result asked for after a restart is read from the record.

Batched polling (api/tinker/completions.py): a sample future made by a sampling client's session
also reports its completion to that session's queue, which ``retrieve_futures`` answers.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from api.tinker.completions import Completions, Target
from api.tinker.resolved_feed import ResolvedFeed
from service.registry.tinker_records import TinkerRecords

# How long a poll (retrieve_future, retrieve_futures) is held for a result before it answers try_again.
# Each waiting call costs one poll per hold: 1,016 tenants queued for 8 slots sent about 100 polls a
# second at a 10 s hold (issue 41's benchmark, docs/BENCHMARKS.md), about 68 (two waiting calls each,
# forward_backward and optim_step) at 30 s, Tinker's own hold (the SDK's session_futures_poller says
# ~30 s), and 58 at 35 s, the longest that leaves 10 s for the round trip under the SDK's 45 s client
# timeout of either poll (tests/unit/test_tinker_batched_polling.py). Not longer: pyqwest 0.10 and later
# turn that timeout into a 90 s budget, but the SDK allows pyqwest from 0.4.1, whose budget is 45 s, and
# httpx's transport keeps 45 s between bytes (benchmarks/bench_sdk_poll_cost.py). The polls are most of what a
# thousand waiting tenants cost their client (~1 ms of its CPU each). A result that comes sooner
# answers the poll at once.
POLL_HOLD_S = 35.0


@dataclass
class Outcome:
    json: dict | None = None  # a JSON result (or an error body)
    proto: bytes | None = None  # a protobuf result
    status: int = 200  # the HTTP status of the retrieve that answers it (410: send the request again)

    def record(self) -> tuple[str, bytes]:
        if self.proto is not None:
            return "proto", self.proto
        return ("gone" if self.status == 410 else "json"), json.dumps(self.json).encode()

    @staticmethod
    def from_record(kind: str, data: bytes) -> "Outcome":
        if kind == "proto":
            return Outcome(proto=bytes(data))
        return Outcome(json=json.loads(bytes(data)), status=410 if kind == "gone" else 200)

    @property
    def failed(self) -> bool:
        """An error answer (the SDK's retrieve_futures calls it a failed request)."""
        return self.status != 200 or (self.json is not None and "error" in self.json)

    @property
    def size(self) -> int:
        """Bytes of the answer's body (the SDK reserves them before it fetches the result)."""
        return len(self.proto) if self.proto is not None else len(json.dumps(self.json).encode())


@dataclass
class _Entry:
    tenant: str
    model_id: str | None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    target: Target | None = None  # a sample's sampling session and clone: its completion is reported there
    adopted: bool = False  # a future of an earlier process
    watched: bool = False  # its id goes to the front's feed when it finishes (api/tinker/resolved_feed.py)


def user_error(message: str) -> Outcome:
    return Outcome(json={"error": message, "category": "user"})


def server_error(message: str) -> Outcome:
    return Outcome(json={"error": message, "category": "server"})


def gone(message: str) -> Outcome:
    """HTTP 410: the SDK's sampling and logprob clients send such a request again on their own."""
    return Outcome(json={"error": message, "category": "server"}, status=410)


class FutureStore:
    """Futures of one serving event loop, recorded in `records` (module doc). In memory: the pending
    ones and the newest finished ones, at most `keep` (plus an eighth between trims) unless more are
    pending; older results come from the records."""

    def __init__(self, records: TinkerRecords, poll_s: float = POLL_HOLD_S, keep: int = 10000):
        self.records = records
        self.poll_s = poll_s
        self.keep = keep
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.completions = Completions(long_poll_s=poll_s)  # retrieve_futures (api/tinker/completions.py)
        # model -> why its queued calls wait (no trainer slot now: the scheduler's last placement), or
        # None: a retrieve of such a call answers try_again with queue_state paused_capacity and it.
        self.reason_of: Callable[[str], str | None] = lambda model_id: None
        # model -> nothing: a call of it was cancelled (its queue's head may have changed: the scheduler's
        # wait index looks at it again, service/scheduling/wait_index.py W1)
        self.on_cancel: Callable[[str], None] = lambda model_id: None
        self.feed: ResolvedFeed | None = None  # set when the API front parks polls (api/server.py)
        self.try_again = 0  # polls answered try again here (/metrics: with the front, its parked ones are not)

    def create(self, tenant: str, model_id: str | None, kind: str = "call", target: Target | None = None) -> str:
        """A new future, recorded (D1: the route answers its id after `durable()`). `target`: a sample's
        poll target (completions.py Q1)."""
        request_id = uuid.uuid4().hex
        self._entries[request_id] = _Entry(tenant, model_id, target=target)
        self.records.add_future(request_id, tenant, model_id, kind)
        self._trim()
        return request_id

    def adopt(self, request_id: str, tenant: str, model_id: str | None) -> None:
        """A future of an earlier process whose operation runs again in this one (a revived model's)."""
        if request_id not in self._entries:
            self._entries[request_id] = _Entry(tenant, model_id, adopted=True)

    def _trim(self) -> None:
        """Oldest finished first (their results stay in the records), down to `keep`, once the entries
        pass `keep` by an eighth: one scan per keep/8 creates. A scan at every create past `keep` (every
        entry, to drop one) was a quarter of the coordinator's busy time with 256 Tinker tenants (py-spy);
        the scan stops once it found enough finished ones. Pending entries are never dropped."""
        excess = len(self._entries) - self.keep
        if excess <= self.keep // 8:
            return
        drop = []
        for rid, entry in self._entries.items():  # oldest first
            if entry.done.done():
                drop.append(rid)
                if len(drop) == excess:
                    break
        for rid in drop:
            del self._entries[rid]

    async def durable(self) -> None:
        """Returns once everything recorded so far is committed (D1): a barrier in the records' queue,
        whose commit wakes this loop."""
        loop = asyncio.get_running_loop()
        committed = loop.create_future()
        self.records.write("SELECT 1", then=lambda: loop.call_soon_threadsafe(_settle, committed))
        await committed

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry.done.done():
            return
        kind, data = outcome.record()
        self.records.resolve(request_id, kind, data, keep_request=True)  # a snapshot drops requests it covers
        if entry is not None:
            entry.done.set_result(outcome)
            if entry.target is not None:  # completions.py Q1
                self.completions.add(entry.tenant, entry.target, request_id, outcome.failed, outcome.size)
            elif entry.adopted and entry.model_id is None:  # a sample in flight at the restart (Q5)
                self.completions.add_orphan(entry.tenant, request_id)
            if entry.watched and self.feed is not None:
                self.feed.announce(request_id)

    def entry(self, request_id: str) -> _Entry | None:
        return self._entries.get(request_id)

    def owned(self, tenant: str, request_id: str) -> _Entry | None:
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry.tenant == tenant else None

    async def retrieve(self, tenant: str, request_id: str) -> Outcome | None:
        """The outcome, or None when still running after ``poll_s`` (try again). KeyError: not this tenant's."""
        entry = self.owned(tenant, request_id)
        if entry is None:
            row = self.records.future(request_id)
            if row is None or row.tenant != tenant:
                raise KeyError(request_id)
            if row.state == "done":
                self.completions.retrieved(tenant, [request_id])
                return Outcome.from_record(row.result_kind, row.result)
            return None  # an earlier process's future whose operation cannot run here any more is answered at start
        try:
            outcome = await asyncio.wait_for(asyncio.shield(entry.done), self.poll_s)
        except TimeoutError:
            return None
        if entry.target is not None or entry.adopted:  # its completion is needed no more (completions.py Q4)
            self.completions.retrieved(tenant, [request_id], entry.target)
        return outcome

    def watch(self, tenant: str, request_id: str) -> bool:
        """After a retrieve answered try again: whether its finish will be announced on the front's feed
        (resolved_feed.py), which it now is for this still-running future of `tenant` held in memory."""
        self.try_again += 1
        entry = self.owned(tenant, request_id)
        if self.feed is None or self.feed.fd is None or entry is None or entry.done.done():
            return False
        entry.watched = True
        return True

    def queue_state(self, tenant: str, request_id: str) -> dict:
        """The try_again body's queue fields for a still-running request."""
        entry = self.owned(tenant, request_id)
        reason = self.reason_of(entry.model_id) if entry is not None and entry.model_id else None
        if reason is None:
            return {"queue_state": "active"}
        return {"queue_state": "paused_capacity", "queue_state_reason": reason}

    def cancel(self, tenant: str, request_id: str) -> bool:
        entry = self.owned(tenant, request_id)
        if entry is None:
            row = self.records.future(request_id)
            if row is None or row.tenant != tenant:
                raise KeyError(request_id)
            return False
        if entry.done.done():
            return False
        self.resolve(request_id, user_error("cancelled by the client"))
        if entry.model_id:
            self.on_cancel(entry.model_id)
        return True


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
