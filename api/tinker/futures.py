"""Request ids and their results: the SDK's futures protocol.

Every POST that starts work answers ``{"request_id", "model_id"}`` at once; the SDK
then polls ``retrieve_future``. A retrieve waits up to ``poll_s`` for the result and
otherwise answers ``{"type": "try_again", ...}`` (the SDK polls again). A finished
request answers its JSON result, protobuf bytes (ForwardBackwardOutput), or
``{"error", "category"}`` (category ``user`` for bad input: the SDK raises it and does
not retry). A future belongs to the tenant that made it: another tenant's id is 404.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Outcome:
    json: dict | None = None  # a JSON result (or an error body)
    proto: bytes | None = None  # a protobuf result


@dataclass
class _Entry:
    tenant: str
    model_id: str | None
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def user_error(message: str) -> Outcome:
    return Outcome(json={"error": message, "category": "user"})


def server_error(message: str) -> Outcome:
    return Outcome(json={"error": message, "category": "server"})


class FutureStore:
    """In-memory, single event loop. Results are kept until retrieved, then dropped
    after ``keep`` further requests (the SDK may re-read a result after a lost response)."""

    def __init__(self, poll_s: float = 10.0, keep: int = 10000):
        self.poll_s = poll_s
        self.keep = keep
        self._entries: dict[str, _Entry] = {}
        # model -> why its queued calls wait (no trainer slot now: the scheduler's last placement), or
        # None: a retrieve of such a call answers try_again with queue_state paused_capacity and it.
        self.reason_of: Callable[[str], str | None] = lambda model_id: None

    def create(self, tenant: str, model_id: str | None) -> str:
        request_id = uuid.uuid4().hex
        self._entries[request_id] = _Entry(tenant, model_id)
        if len(self._entries) > self.keep:  # oldest finished first
            for rid in [r for r, e in self._entries.items() if e.done.done()][: len(self._entries) - self.keep]:
                del self._entries[rid]
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and not entry.done.done():
            entry.done.set_result(outcome)

    def entry(self, request_id: str) -> _Entry | None:
        return self._entries.get(request_id)

    def owned(self, tenant: str, request_id: str) -> _Entry | None:
        entry = self._entries.get(request_id)
        return entry if entry is not None and entry.tenant == tenant else None

    async def retrieve(self, tenant: str, request_id: str) -> Outcome | None:
        """The outcome, or None when still running after ``poll_s`` (try again). KeyError: not this tenant's."""
        entry = self.owned(tenant, request_id)
        if entry is None:
            raise KeyError(request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), self.poll_s)
        except TimeoutError:
            return None

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
            raise KeyError(request_id)
        if entry.done.done():
            return False
        entry.done.set_result(user_error("cancelled by the client"))
        return True
