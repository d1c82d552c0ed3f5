"""Durable records of the Tinker face (issue 40): sessions, models and every future, in the service's
SQLite registry file, next to the runs.

  tinker_sessions  a session's id and tenant (heartbeats stay in memory: a restart counts from its start),
                   what the client said of it (user metadata, display name, project label) and how it
                   ended (the client's finish reason, or 'expired')
  tinker_session_samplers  the sampling sessions a session opened (get_session's sampler_ids)
  tinker_models    a model's tenant, session, LoRA (rank, seed, targets), its last durable snapshot
                   (a store reference, the last operation it covers, the step), and whether it ended
  tinker_futures   every future: its tenant and model, its operation's sequence number, kind and
                   request (what a replay needs), its state and, once done, its result
  tinker_checkpoints  every checkpoint a model saved (its folder is in the store): its time, expiry
                   and user metadata, and whether it is published (readable by every tenant, writable
                   by its own only: the RestClient's views, api/tinker/checkpoints/runs.py)
  tinker_custom_losses  every server-side custom loss (create_custom_loss): its tenant, session and
                   the graph as sent (api/tinker/custom_losses.py)

Why a connection of its own with group commit: a future is durable before its id is answered (a
client that polls after a crash must find it: never "unknown request id"), and at fleet scale
thousands of calls a second arrive. Writes are queued and committed by one writer thread in
batches (one fsync per batch); a caller that needs its write durable waits for its batch
(`commit`'s returned event, or `write(..., wait=True)`). Reads go through the same connection under
its lock and see every committed batch plus nothing half-written.

Invariants:
  D1 a future's row is committed before its request id is returned to the client;
  D2 a model's snapshot reference is updated only after the snapshot is committed in the store,
     and names the last operation (seq) whose effect it holds;
  D3 `seq` grows with every operation of a model in the order the model runs them, so the
     operations after a snapshot are exactly those with a larger seq;
  D4 a done future keeps its result for `result_ttl_s` after it finished, then it is deleted.
"""

from __future__ import annotations

import json
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tinker_sessions (
    session_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    ended_at REAL,
    user_metadata TEXT,             -- JSON (create_session's)
    display_name TEXT,
    project_id TEXT,                -- a label: lorafleet has no projects
    finish_reason TEXT,             -- success | errored | interrupted (the client's close) | expired; NULL: live
    finish_detail TEXT
);
CREATE TABLE IF NOT EXISTS tinker_session_samplers (
    session_id TEXT NOT NULL,
    sampler_id TEXT NOT NULL,
    PRIMARY KEY (session_id, sampler_id)
);
CREATE TABLE IF NOT EXISTS tinker_custom_losses (
    loss_id TEXT PRIMARY KEY,       -- <session>:loss:<custom_loss_seq_id>
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    spec TEXT NOT NULL,             -- JSON {name, inputs, graph} as the client sent it
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tinker_models (
    model_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    targets TEXT NOT NULL,          -- JSON list of target groups
    user_metadata TEXT,             -- JSON
    created_at REAL NOT NULL,
    snapshot TEXT,                  -- store reference of the last durable snapshot; NULL: the seeded init
    snapshot_seq INTEGER NOT NULL,  -- the last operation whose effect the snapshot holds (D2)
    snapshot_step INTEGER NOT NULL DEFAULT 0,
    snapshot_at REAL NOT NULL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS tinker_futures (
    request_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    model_id TEXT,
    seq INTEGER,                    -- the operation's place in its model's order (D3); NULL: no model operation
    kind TEXT NOT NULL,
    request TEXT,                   -- JSON: what a replay needs (dropped once a snapshot covers it)
    state TEXT NOT NULL,            -- 'pending' | 'done'
    result_kind TEXT,               -- 'json' | 'proto' | 'gone' (a JSON error answered with HTTP 410)
    result BLOB,
    created_at REAL NOT NULL,
    done_at REAL
);
CREATE INDEX IF NOT EXISTS tinker_futures_by_model ON tinker_futures(model_id, seq);
CREATE INDEX IF NOT EXISTS tinker_futures_done ON tinker_futures(done_at) WHERE state = 'done';
CREATE TABLE IF NOT EXISTS tinker_checkpoints (
    tenant TEXT NOT NULL,
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,                -- NULL: never
    user_metadata TEXT,             -- JSON
    public INTEGER NOT NULL DEFAULT 0,  -- published: every tenant may read it (never write it)
    PRIMARY KEY (tenant, run_id, kind, name)
);
CREATE INDEX IF NOT EXISTS tinker_checkpoints_public ON tinker_checkpoints(run_id, kind, name) WHERE public = 1;
CREATE INDEX IF NOT EXISTS tinker_checkpoints_expiring ON tinker_checkpoints(expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS tinker_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO tinker_counters VALUES ('seq', 0);
"""
# Columns added after files were first written: (table, column, declaration) - added by `_migrate`.
_ADDED_COLUMNS = (
    ("tinker_sessions", "user_metadata", "TEXT"), ("tinker_sessions", "display_name", "TEXT"),
    ("tinker_sessions", "project_id", "TEXT"), ("tinker_sessions", "finish_reason", "TEXT"),
    ("tinker_sessions", "finish_detail", "TEXT"), ("tinker_checkpoints", "public", "INTEGER NOT NULL DEFAULT 0"),
)


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    tenant: str
    session_id: str
    rank: int
    seed: int
    targets: tuple[str, ...]
    user_metadata: dict | None
    snapshot: str | None
    snapshot_seq: int
    snapshot_step: int
    snapshot_at: float


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    tenant: str
    model_id: str | None
    seq: int | None
    kind: str
    request: dict | None
    state: str
    result_kind: str | None
    result: bytes | None
    done_at: float | None


class TinkerRecords:
    """The Tinker face's durable records (module doc). Thread-safe."""

    def __init__(self, db_path: str | Path, *, result_ttl_s: float = 3600.0, max_batch: int = 512) -> None:
        self.db_path = Path(db_path)
        self.result_ttl_s = result_ttl_s
        self.max_batch = max_batch
        self._db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._migrate()
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        row = self._db.execute("SELECT value FROM tinker_counters WHERE name = 'seq'").fetchone()
        self._seq = int(row[0])
        self._seq_lock = threading.Lock()
        self._clone_lock = threading.Lock()
        self._clones: dict[str, int] = {}  # join_sampling_session's counters handed out by this process
        self._writes: queue.Queue = queue.Queue()
        # the writer's group commits so far (/metrics: their mean time is the durable write that every
        # call's answer waits for); written by the writer's thread only
        self.commits = 0
        self.committed_writes = 0
        self.commit_seconds = 0.0
        self._closed = False
        self._writer = threading.Thread(target=self._write_forever, name="tinker-records", daemon=True)
        self._writer.start()

    # -- the writer: group commit ---------------------------------------------------------------

    def write(self, sql: str, params: tuple = (), *, wait: bool = False, then: Callable[[], None] | None = None) -> threading.Event:
        """Queue one statement for the next batch; its event is set once the batch is committed
        (`wait`: block until then; `then()`: called on the writer's thread after the commit, e.g. to
        wake an event loop)."""
        done = threading.Event()
        self._writes.put((sql, params, (done, then)))
        if wait:
            done.wait()
        return done

    def _write_forever(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._writes.put(None)
                    break
                batch.append(nxt)
            t0 = time.perf_counter()
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for sql, params, _ in batch:
                        self._db.execute(sql, params)
                    self._db.execute("UPDATE tinker_counters SET value = ? WHERE name = 'seq'", (self._seq,))
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            self.commit_seconds += time.perf_counter() - t0
            self.commits += 1
            self.committed_writes += len(batch)
            for _, _, (done, then) in batch:
                done.set()
                if then is not None:
                    then()

    def _migrate(self) -> None:
        """A file written before `_ADDED_COLUMNS` gets them (a fresh file gets them from the schema)."""
        for table, column, declaration in _ADDED_COLUMNS:
            columns = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if columns and column not in columns:  # no columns: the table is new, the schema makes it whole
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")

    def flush(self) -> None:
        """Wait until everything queued so far is committed."""
        self.write("SELECT 1", wait=True)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._writes.put(None)
        self._writer.join(timeout=30)
        with self._lock:
            self._db.close()

    def next_seq(self) -> int:
        """A number never handed out before (D3: a model's operations take theirs in its order)."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def _read(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            cur = self._db.execute(sql, params)
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    # -- sessions ----------------------------------------------------------------------------------

    def add_session(self, session_id: str, tenant: str, *, user_metadata: dict | None = None, display_name: str | None = None,
                    project_id: str | None = None, ended: tuple[str, str | None] | None = None) -> threading.Event:
        """A session; ``ended``: (reason, detail) of a session that is over as it is made (a copy's)."""
        now = time.time()
        return self.write("INSERT OR IGNORE INTO tinker_sessions (session_id, tenant, created_at, ended_at, user_metadata, "
                          "display_name, project_id, finish_reason, finish_detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          (session_id, tenant, now, now if ended else None, _json(user_metadata), display_name, project_id,
                           *(ended or (None, None))))

    def end_session(self, session_id: str, reason: str | None = None, detail: str | None = None) -> None:
        """The session is over; its first reason stands (the SDK's close: first wins)."""
        self.write("UPDATE tinker_sessions SET ended_at = COALESCE(ended_at, ?), finish_reason = COALESCE(finish_reason, ?), "
                   "finish_detail = COALESCE(finish_detail, ?) WHERE session_id = ?", (time.time(), reason, detail, session_id))

    def live_sessions(self) -> list[tuple[str, str]]:
        """(session id, tenant) of every session not ended."""
        return [(r["session_id"], r["tenant"]) for r in self._read("SELECT session_id, tenant FROM tinker_sessions WHERE ended_at IS NULL")]

    def sessions_of(self, tenant: str) -> list[dict]:
        """Every session of `tenant`, live or ended, newest first, as raw rows."""
        return self._read("SELECT * FROM tinker_sessions WHERE tenant = ? ORDER BY created_at DESC, session_id DESC", (tenant,))

    def session_of(self, tenant: str, session_id: str) -> dict | None:
        rows = self._read("SELECT * FROM tinker_sessions WHERE tenant = ? AND session_id = ?", (tenant, session_id))
        return rows[0] if rows else None

    def link_sampler(self, session_id: str, sampler_id: str) -> threading.Event:
        return self.write("INSERT OR IGNORE INTO tinker_session_samplers VALUES (?, ?)", (session_id, sampler_id))

    def samplers_of(self, session_id: str) -> list[str]:
        return [r["sampler_id"] for r in self._read("SELECT sampler_id FROM tinker_session_samplers WHERE session_id = ? "
                                                    "ORDER BY rowid", (session_id,))]

    def next_clone(self, sampler_id: str) -> int:
        """A number never handed out before for this sampling session, from 1 (the original client is 0):
        join_sampling_session's client_counter. Its write is queued: the caller answers it after a
        commit barrier (D1's rule), and numbers handed out meanwhile are counted in memory."""
        name = f"clones:{sampler_id}"
        with self._clone_lock:
            rows = self._read("SELECT value FROM tinker_counters WHERE name = ?", (name,))
            value = max(self._clones.get(name, 0), int(rows[0]["value"]) if rows else 0) + 1
            self._clones[name] = value
            self.write("INSERT OR REPLACE INTO tinker_counters VALUES (?, ?)", (name, value))
        return value

    # -- custom losses -------------------------------------------------------------------------------

    def add_custom_loss(self, loss_id: str, tenant: str, session_id: str, spec: dict) -> threading.Event:
        return self.write("INSERT OR IGNORE INTO tinker_custom_losses VALUES (?, ?, ?, ?, ?)",
                          (loss_id, tenant, session_id, json.dumps(spec), time.time()))

    def custom_loss(self, tenant: str, loss_id: str) -> tuple[str, dict] | None:
        """(session id, spec) of the tenant's loss; None for another tenant's or an unknown id."""
        rows = self._read("SELECT session_id, spec FROM tinker_custom_losses WHERE tenant = ? AND loss_id = ?", (tenant, loss_id))
        return (rows[0]["session_id"], json.loads(rows[0]["spec"])) if rows else None

    # -- models --------------------------------------------------------------------------------------

    def add_model(self, model_id: str, tenant: str, session_id: str, rank: int, seed: int, targets: tuple[str, ...],
                  user_metadata: dict | None, seq: int) -> threading.Event:
        """A model created: its snapshot is its seeded init, covering operations up to `seq` (its creation)."""
        now = time.time()
        return self.write("INSERT OR REPLACE INTO tinker_models VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, 0, ?, NULL)",
                          (model_id, tenant, session_id, rank, seed, json.dumps(list(targets)),
                           json.dumps(user_metadata) if user_metadata is not None else None, now, seq, now))

    def set_snapshot(self, model_id: str, reference: str | None, seq: int, step: int) -> threading.Event:
        """D2: the caller committed `reference` in the store first. Operations up to `seq` need no replay:
        their requests are dropped."""
        self.write("UPDATE tinker_futures SET request = NULL WHERE model_id = ? AND seq <= ? AND state = 'done'", (model_id, seq))
        return self.write("UPDATE tinker_models SET snapshot = ?, snapshot_seq = ?, snapshot_step = ?, snapshot_at = ? "
                          "WHERE model_id = ?", (reference, seq, step, time.time(), model_id))

    def runs_of(self, tenant: str) -> list[dict]:
        """Every training run (model, live or ended) of `tenant`, oldest first, as raw rows."""
        return self._read("SELECT * FROM tinker_models WHERE tenant = ? ORDER BY created_at, model_id", (tenant,))

    def run_of(self, tenant: str, run_id: str) -> dict | None:
        rows = self._read("SELECT * FROM tinker_models WHERE tenant = ? AND model_id = ?", (tenant, run_id))
        return rows[0] if rows else None

    # -- checkpoints ---------------------------------------------------------------------------------

    def add_checkpoint(self, tenant: str, run_id: str, kind: str, name: str, expires_at: float | None,
                       user_metadata: dict | None) -> threading.Event:
        return self.write("INSERT OR REPLACE INTO tinker_checkpoints (tenant, run_id, kind, name, created_at, expires_at, "
                          "user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          (tenant, run_id, kind, name, time.time(), expires_at, _json(user_metadata)))

    def delete_checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> threading.Event:
        return self.write("DELETE FROM tinker_checkpoints WHERE tenant = ? AND run_id = ? AND kind = ? AND name = ?",
                          (tenant, run_id, kind, name))

    def set_checkpoint_expiry(self, tenant: str, run_id: str, kind: str, name: str, expires_at: float | None) -> threading.Event:
        return self.write("UPDATE tinker_checkpoints SET expires_at = ? WHERE tenant = ? AND run_id = ? AND kind = ? AND name = ?",
                          (expires_at, tenant, run_id, kind, name))

    def set_checkpoint_public(self, tenant: str, run_id: str, kind: str, name: str, public: bool) -> threading.Event:
        return self.write("UPDATE tinker_checkpoints SET public = ? WHERE tenant = ? AND run_id = ? AND kind = ? AND name = ?",
                          (int(public), tenant, run_id, kind, name))

    def published(self, run_id: str, kind: str, name: str) -> dict | None:
        """The published checkpoint of that path, whoever owns it (run ids are unique across tenants)."""
        rows = self._read("SELECT * FROM tinker_checkpoints WHERE run_id = ? AND kind = ? AND name = ? AND public = 1",
                          (run_id, kind, name))
        return rows[0] if rows else None

    def published_runs(self) -> list[tuple[str, str]]:
        """(tenant, run id) of every run with a published checkpoint."""
        return [(r["tenant"], r["run_id"]) for r in self._read("SELECT DISTINCT tenant, run_id FROM tinker_checkpoints WHERE public = 1")]

    def checkpoints(self, tenant: str, run_id: str | None = None) -> list[dict]:
        """The checkpoints of `tenant` (of one run), oldest first, as raw rows."""
        if run_id is None:
            return self._read("SELECT * FROM tinker_checkpoints WHERE tenant = ? ORDER BY created_at", (tenant,))
        return self._read("SELECT * FROM tinker_checkpoints WHERE tenant = ? AND run_id = ? ORDER BY created_at",
                          (tenant, run_id))

    def expired_checkpoints(self, now: float, tenant: str | None = None) -> list[dict]:
        sql = "SELECT * FROM tinker_checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?"
        return self._read(sql + (" AND tenant = ?" if tenant is not None else ""), (now, tenant) if tenant is not None else (now,))

    def end_model(self, model_id: str) -> None:
        self.write("UPDATE tinker_models SET ended_at = ? WHERE model_id = ?", (time.time(), model_id))

    def live_models(self) -> list[ModelRow]:
        """The models not ended, as a restore reads them: every write queued before this call is committed
        first (a model created, or a call answered, just before its trainer was lost is read; reads see
        committed batches only, and the loss can come while the writer is behind)."""
        self.flush()
        rows = self._read("SELECT * FROM tinker_models WHERE ended_at IS NULL ORDER BY created_at")
        return [ModelRow(r["model_id"], r["tenant"], r["session_id"], r["rank"], r["seed"], tuple(json.loads(r["targets"])),
                         json.loads(r["user_metadata"]) if r["user_metadata"] else None, r["snapshot"], r["snapshot_seq"],
                         r["snapshot_step"], r["snapshot_at"]) for r in rows]

    # -- futures ----------------------------------------------------------------------------------

    def add_future(self, request_id: str, tenant: str, model_id: str | None, kind: str, *, seq: int | None = None,
                   request: dict | None = None) -> threading.Event:
        """D1: the caller answers the request id only after the returned event is set."""
        return self.write("INSERT INTO tinker_futures VALUES (?, ?, ?, ?, ?, ?, 'pending', NULL, NULL, ?, NULL)",
                          (request_id, tenant, model_id, seq, kind, json.dumps(request) if request is not None else None,
                           time.time()))

    def resolve(self, request_id: str, result_kind: str, result: bytes, *, keep_request: bool) -> threading.Event:
        return self.write("UPDATE tinker_futures SET state = 'done', result_kind = ?, result = ?, done_at = ?"
                          + ("" if keep_request else ", request = NULL") + " WHERE request_id = ?",
                          (result_kind, result, time.time(), request_id))

    def set_order(self, request_id: str, seq: int, operation: str) -> threading.Event:
        """A model operation's place in its model's order and what it does (every policy: a restore
        needs both to tell what ran after the snapshot; the request itself only under `step`)."""
        return self.write("UPDATE tinker_futures SET seq = ?, kind = ? WHERE request_id = ?", (seq, operation, request_id))

    def set_request(self, request_id: str, seq: int, request: dict) -> threading.Event:
        """A queued operation's request written at stop (graceful: what was not run yet must run after)."""
        return self.write("UPDATE tinker_futures SET seq = ?, request = ? WHERE request_id = ?", (seq, json.dumps(request), request_id))

    def future(self, request_id: str) -> FutureRow | None:
        rows = self._read("SELECT * FROM tinker_futures WHERE request_id = ?", (request_id,))
        return _future(rows[0]) if rows else None

    def futures_after(self, model_id: str, seq: int) -> list[FutureRow]:
        """The model's operations after `seq`, in order (what a restore must replay or run), every write
        queued before this call included (as `live_models`)."""
        self.flush()
        return [_future(r) for r in self._read("SELECT * FROM tinker_futures WHERE model_id = ? AND seq > ? ORDER BY seq",
                                               (model_id, seq))]

    def pending_without_model(self) -> list[FutureRow]:
        """Pending futures of no model operation (sampling, creation): at start they cannot finish any more."""
        return [_future(r) for r in self._read("SELECT * FROM tinker_futures WHERE state = 'pending' AND seq IS NULL")]

    def sweep(self, now: float | None = None) -> None:
        """D4: results older than the ttl go."""
        horizon = (time.time() if now is None else now) - self.result_ttl_s
        self.write("DELETE FROM tinker_futures WHERE state = 'done' AND done_at < ? AND request IS NULL", (horizon,))


def _json(value: dict | None) -> str | None:
    return json.dumps(value) if value is not None else None


def _future(r: dict) -> FutureRow:
    return FutureRow(r["request_id"], r["tenant"], r["model_id"], r["seq"], r["kind"],
                     json.loads(r["request"]) if r["request"] else None, r["state"], r["result_kind"], r["result"], r["done_at"])
