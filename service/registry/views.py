"""The registry's read views (service/registry/registry.py `Registry` inherits them): pages of the adapter
list, counts by state and residency, a tenant's usage against its quota, and the loop's reads.

Pages: what `GET /v1/adapters` asks (`list_page`), as a query, its SQL, and the page it answers.

A list is the newest run of every name the caller may see (I8), oldest name first (by run_id), and
filtered by state, by owner (the admin only: a tenant sees its own runs anyway) and by a part of
the name (the dashboard's search). A page is at most `limit` of them, from `offset` or after a
`cursor`. A cursor is keyset (`run_id > the cursor's`), so a page boundary never repeats or skips
a row when runs are registered or end meanwhile (a name registered again moves to the end: its
newest run is new). Every page also says how many rows match in all (`total`).

Cost: the page's rows (index runs_by_name for the newest run of a name, runs_by_state and
runs_by_owner_state for the filters) plus one count of the matching rows; the refs of the page
only are built (service/registry/registry.py), outside the registry lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlite3
import threading

from service.errors import BadValue, QuotaExceeded
from service.registry.records import _LIVE_WHERE, _UNQUEUED, _WAITING, AdapterRef, AdapterState, _visible

MAX_PAGE = 1000  # rows a page may ask for
DEFAULT_PAGE = 100
_CURSOR_PREFIX = "r"


@dataclass(frozen=True)
class ListQuery:
    """One page of the adapter list. `owner`: only runs of this tenant (for the admin; "" = the
    admin's own runs); `name_contains`: a case-insensitive part of the name; `cursor`: the
    `next_cursor` of the previous page (then `offset` must be 0)."""

    state: AdapterState | None = None
    owner: str | None = None
    name_contains: str | None = None
    limit: int = DEFAULT_PAGE
    offset: int = 0
    cursor: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise BadValue(f"limit {self.limit} is out of range: 1..{MAX_PAGE}", field="limit")
        if self.offset < 0:
            raise BadValue(f"offset {self.offset} is negative: 0 or more", field="offset")
        if self.cursor is not None and self.offset:
            raise BadValue("give a cursor or an offset, not both (a cursor continues where its page ended)", field="cursor")
        if self.cursor is not None:
            after_run_id(self.cursor)  # refused now, with the reason, not halfway through a read


@dataclass(frozen=True)
class Page:
    refs: list[AdapterRef]
    total: int  # rows matching the query in all pages
    next_cursor: str | None  # the cursor of the next page; None on the last one


def cursor_of(run_id: int) -> str:
    return f"{_CURSOR_PREFIX}{run_id}"


def after_run_id(cursor: str) -> int:
    """The run_id a cursor continues after; BadValue for anything this module did not write."""
    digits = cursor[len(_CURSOR_PREFIX):] if cursor.startswith(_CURSOR_PREFIX) else ""
    if not digits.isdigit():
        raise BadValue(f"cursor {cursor!r} is not one this service gave out; pass the next_cursor of a page "
                       "(or leave it out for the first page)", field="cursor")
    return int(digits)


def page_sql(query: ListQuery, tenant: str | None) -> tuple[str, tuple, str, tuple]:
    """(rows SQL, its args, count SQL, its args) of `query` for the caller `tenant` (None = the admin)."""
    where, args = _visible(tenant)
    conds = [where, f"run_id = (SELECT MAX(run_id) FROM runs WHERE name = r.name AND {where})"]
    cond_args: list = [*args, *args]
    if query.state is not None:
        conds.append("state = ?")
        cond_args.append(AdapterState(query.state).value)
    if query.owner is not None:
        conds.append("owner IS NULL" if query.owner == "" else "owner = ?")
        cond_args += [] if query.owner == "" else [query.owner]
    if query.name_contains:
        conds.append("instr(lower(name), ?) > 0")
        cond_args.append(query.name_contains.lower())
    count_sql = f"SELECT COUNT(*) FROM runs r WHERE {' AND '.join(conds)}"
    row_conds, row_args = list(conds), list(cond_args)
    if query.cursor is not None:
        row_conds.append("run_id > ?")
        row_args.append(after_run_id(query.cursor))
    rows_sql = f"SELECT * FROM runs r WHERE {' AND '.join(row_conds)} ORDER BY run_id LIMIT ? OFFSET ?"
    return rows_sql, (*row_args, query.limit + 1, query.offset), count_sql, tuple(cond_args)


@dataclass(frozen=True)
class RunQuota:
    """What one tenant key may hold (service/config/quotas.py TenantQuota, resolved for it): live runs, and
    of them waiting for a slot (queued or evicted); None = no bound of its own. `source` names the
    setting, for the message."""

    max_live_runs: int | None = None
    max_queued_runs: int | None = None
    source: str = "quotas"

    def check(self, owner: str | None, live: int, waiting: int, *, queued: bool) -> None:
        """QuotaExceeded (HTTP 429) when one more live run (waiting, when `queued`) would pass a bound."""
        who = f"tenant {owner!r}" if owner is not None else "the admin"
        usage = f"{who} has {live} live run(s), {waiting} of them waiting for a slot"
        if self.max_live_runs is not None and live >= self.max_live_runs:
            raise QuotaExceeded(f"quota reached: {usage}; its max_live_runs is {self.max_live_runs} ({self.source}). "
                                "Retry once one of its runs is COMPLETED (DELETE /v1/adapters/<name> retires one)")
        if queued and self.max_queued_runs is not None and waiting >= self.max_queued_runs:
            raise QuotaExceeded(f"quota reached: {usage}; its max_queued_runs is {self.max_queued_runs} ({self.source}), "
                                "and every trainer slot is taken, so this run would wait too. Retry once one of its "
                                "runs holds a slot or ends")


class RegistryViews:
    """Reads only; the lock and connection are the registry's (each read is one locked section)."""

    # The registry's: its lock and connection, `_ref(row, positions)` and `_queue_positions()`.
    _lock: threading.Lock
    _db: sqlite3.Connection

    def list_page(self, query: ListQuery, tenant: str | None = None) -> Page:
        """One page of `list` (ListQuery above); refs built after the lock (the loop never waits on them)."""
        rows_sql, rows_args, count_sql, count_args = page_sql(query, tenant)
        with self._lock:
            rows = self._db.execute(rows_sql, rows_args).fetchall()
            total = self._db.execute(count_sql, count_args).fetchone()[0]
            positions = self._queue_positions() if any(r["slot"] is None for r in rows) else {}
        more = len(rows) > query.limit
        rows = rows[: query.limit]
        return Page([self._ref(r, positions) for r in rows], total, cursor_of(rows[-1]["run_id"]) if more and rows else None)

    def state_counts(self, tenant: str | None = None) -> dict[AdapterState, int]:
        """Newest run of every name by state (what /health and /metrics count), in SQL."""
        where, args = _visible(tenant)
        sql = (f"SELECT state, COUNT(*) FROM runs r WHERE {where} AND run_id = (SELECT MAX(run_id) FROM runs"
               f" WHERE name = r.name AND {where}) GROUP BY state")
        with self._lock:
            return {AdapterState(s): n for s, n in self._db.execute(sql, (*args, *args))}

    def residency_counts(self) -> dict[str, int]:
        """Live runs by residency (resident, queued, evicted: AdapterRef.residency), in SQL."""
        sql = (f"SELECT CASE WHEN slot IS NOT NULL THEN 'resident' WHEN activated_at IS NULL THEN 'queued' ELSE 'evicted' END,"
               f" COUNT(*) FROM runs WHERE {_LIVE_WHERE} AND (slot IS NOT NULL OR ({_WAITING})) GROUP BY 1")
        with self._lock:
            return {"resident": 0, "queued": 0, "evicted": 0, **dict(self._db.execute(sql).fetchall())}

    def recently_updated(self, k: int) -> list[AdapterRef]:
        """The newest run of the `k` names updated most recently (a step, a state change):
        /metrics' per-adapter series ("top")."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs r WHERE run_id = (SELECT MAX(run_id) FROM runs WHERE name = r.name)"
                                    " ORDER BY updated_at DESC, run_id DESC LIMIT ?", (k,)).fetchall()
            positions = self._queue_positions() if any(r["slot"] is None for r in rows) else {}
        return [self._ref(r, positions) for r in rows]

    def live_states(self) -> dict[str, AdapterState]:
        """registration id -> state of every live run: two columns, no refs (the loop's per-round read)."""
        with self._lock:
            sql = f"SELECT registration_id, state FROM runs WHERE {_LIVE_WHERE} ORDER BY run_id"
            return {r[0]: AdapterState(r[1]) for r in self._db.execute(sql)}

    def live_count(self) -> int:
        with self._lock:
            return self._db.execute(f"SELECT COUNT(*) FROM runs WHERE {_LIVE_WHERE}").fetchone()[0]

    def ids_in_state(self, state: AdapterState) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT registration_id FROM runs WHERE state = ? ORDER BY run_id", (state.value,))]

    def unqueued_live(self) -> list[AdapterRef]:
        """The live runs not waiting in the queue (holding a slot, or ending without one): what
        reconcile acts on; as many as the slots plus the runs ending now, whatever the queue."""
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM runs INDEXED BY runs_unqueued WHERE {_UNQUEUED} ORDER BY run_id").fetchall()
        return [self._ref(r, {}) for r in rows]

    def usage(self, owner: str | None) -> tuple[int, int]:
        """(live runs, of them waiting for a slot) of `owner` (None = the admin)."""
        with self._lock:
            return self._usage(owner)

    def _usage(self, owner: str | None) -> tuple[int, int]:
        who, args = ("owner IS NULL", ()) if owner is None else ("owner = ?", (owner,))
        row = self._db.execute(f"SELECT COUNT(*), COALESCE(SUM({_WAITING}), 0) FROM runs WHERE {who} AND {_LIVE_WHERE}",
                               args).fetchone()
        return int(row[0]), int(row[1])
