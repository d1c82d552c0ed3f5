"""``sessions_router(service)``: the caller's sessions as the RestClient reads them (``list_sessions``,
``get_session``, ``search_sessions``) and ``join_sampling_session`` (a cloned sampling client's id).

A session is a record (service/registry/tinker_records.py ``tinker_sessions``): its tenant, creation
time, what ``create_session`` said of it (user metadata, display name, a project label: lorafleet has
no projects) and how it ended (``ServiceClient.close``'s reason, first wins, or ``expired``: no
heartbeat for the service's session timeout). Its training runs are the models it created (and a
copy's run: api/tinker/checkpoints/sharing.py); its samplers the sampling sessions it opened.

Invariants:
  N1 every read is scoped to the caller: another tenant's session id is 404 (as if unknown) and no
     listing or search shows another tenant's session, whatever ``access_scope`` or ``owner`` asks
     (nothing is shared between tenants; ``owner: user`` is refused with why);
  N2 listings are newest first (creation time, then id); a search's ``next_cursor`` names the last
     session of its page, and the next page starts strictly after it, so pages never repeat or skip
     a session that existed when the first page was read;
  N3 statuses: ``active`` (not ended), ``client_finished`` with the client's reason; an expired
     session has none (the SDK's "neither finished nor known to be running"); lorafleet fails or
     cancels no session, so ``failed`` and ``cancelled`` match none;
  N4 ``join_sampling_session`` answers numbers from 1 up, never twice for one sampling session, also
     across a restart (a counter in the records; the original client is 0).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import Field

from api.tinker.service import TinkerService
from api.tinker.wire import _In

MAX_PAGE = 1000
FINISH_REASONS = ("success", "errored", "interrupted")


class OwnerIn(_In):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class StatusIn(_In):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = None


class CursorIn(_In):
    last_created_at: datetime
    last_session_id: str


class SearchIn(_In):
    """The SDK's SessionSearchRequest."""

    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(None, min_length=1)
    owner: OwnerIn = OwnerIn()
    statuses: list[StatusIn] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: CursorIn | None = None


class JoinIn(_In):
    sampling_session_id: str


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _micros_of(d: datetime) -> int:
    """A time's whole microseconds since the epoch, in integers (no float rounding)."""
    aware = d.replace(tzinfo=UTC) if d.tzinfo is None else d
    return (aware - _EPOCH) // timedelta(microseconds=1)


def _micros(t: float) -> int:
    """A creation time at the wire's precision: the microseconds `_iso` writes, so a row and a cursor
    naming it compare equal (round(t * 1e6) could land one microsecond off the ISO time's rounding,
    and a page then repeated its last session)."""
    return _micros_of(datetime.fromtimestamp(t, UTC))


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def status_of(row: dict) -> dict | None:
    """A session record's SessionStatus (N3)."""
    if row["ended_at"] is None:
        return {"type": "active"}
    if row["finish_reason"] in FINISH_REASONS:
        return {"type": "client_finished", "reason": {"type": row["finish_reason"]}, "detail": row["finish_detail"]}
    return None


def _matches(row: dict, q: SearchIn) -> bool:
    name = (row["display_name"] or "").lower()
    named = q.display_name is not None and all(w in name for w in q.display_name.lower().split())
    if (q.session_id is not None or q.display_name is not None) and not (row["session_id"] == q.session_id or named):
        return False
    if q.project_ids is not None and (row["project_id"] or "default") not in q.project_ids:
        return False
    meta = json.loads(row["user_metadata"]) if row["user_metadata"] else {}
    if any(meta.get(k) != v for k, v in q.user_metadata.items()):
        return False
    if q.statuses is not None:
        status = status_of(row)
        kind = status["type"] if status else None
        return any(s.type == kind and (s.reasons is None or row["finish_reason"] in s.reasons) for s in q.statuses)
    return True


def sessions_router(service: TinkerService) -> APIRouter:
    r = APIRouter()
    records, runs = service.records, service.runs

    def tenant(request: Request) -> str:
        return service.keys.authenticate(request)

    def known(t: str, session_id: str) -> dict:
        row = records.session_of(t, session_id)
        if row is None:
            raise HTTPException(404, f"unknown session {session_id}")
        return row

    def run_ids(t: str, session_id: str) -> list[str]:
        return [run["model_id"] for run in records.runs_of(t) if run["session_id"] == session_id]

    def summary(t: str, row: dict) -> dict:
        checkpoints = [c for run in run_ids(t, row["session_id"]) for c in runs.list_checkpoints(t, run)["checkpoints"]]
        return {"session_id": row["session_id"], "created_at": _iso(row["created_at"]), "owner": t,
                "project_id": row["project_id"] or "default", "status": status_of(row),
                "checkpoints_count": len(checkpoints), "checkpoint_storage_bytes": sum(c["size_bytes"] for c in checkpoints),
                "display_name": row["display_name"],
                "user_metadata": json.loads(row["user_metadata"]) if row["user_metadata"] else None}

    @r.get("/sessions")
    async def list_sessions(request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE), offset: int = Query(0, ge=0),
                            access_scope: Literal["owned", "accessible"] = "owned") -> dict:
        return {"sessions": [row["session_id"] for row in records.sessions_of(tenant(request))[offset: offset + limit]]}

    @r.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request, access_scope: Literal["owned", "accessible"] = "owned") -> dict:
        t = tenant(request)
        row = known(t, session_id)
        return {"training_run_ids": run_ids(t, session_id), "sampler_ids": records.samplers_of(session_id),
                "user_metadata": json.loads(row["user_metadata"]) if row["user_metadata"] else None,
                "display_name": row["display_name"]}

    @r.post("/sessions/search")
    async def search_sessions(body: SearchIn, request: Request) -> dict:
        t = tenant(request)
        if body.owner.type == "user":
            raise HTTPException(400, "searching other users' sessions is not served by lorafleet: a tenant sees its own "
                                     "sessions only (owner 'own' or 'accessible')")
        rows = sorted((row for row in records.sessions_of(t) if _matches(row, body)),
                      key=lambda row: (_micros(row["created_at"]), row["session_id"]), reverse=True)
        if body.cursor is not None:  # N2: strictly after the cursor's session in (newest first) order
            after = (_micros_of(body.cursor.last_created_at), body.cursor.last_session_id)
            rows = [row for row in rows if (_micros(row["created_at"]), row["session_id"]) < after]
        page = rows[: body.limit]
        more = len(rows) > len(page)
        cursor = {"last_created_at": _iso(page[-1]["created_at"]), "last_session_id": page[-1]["session_id"]} if more else None
        return {"sessions": [summary(t, row) for row in page], "next_cursor": cursor}

    @r.post("/join_sampling_session")
    async def join_sampling_session(body: JoinIn, request: Request) -> dict:
        t = tenant(request)
        if service.sampler is None or service.sampler.session(t, body.sampling_session_id) is None:
            raise HTTPException(404, f"unknown sampling session {body.sampling_session_id}")
        counter = records.next_clone(body.sampling_session_id)
        await service.futures.durable()  # N4: the number is recorded before it is answered
        return {"type": "join_sampling_session", "client_counter": counter}

    return r
