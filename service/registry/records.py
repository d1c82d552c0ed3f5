"""The registry's records: run states and their rules, the immutable refs callers get, the SQLite
schema, and the row helpers (service/registry/registry.py holds the invariants and the one class that
changes them)."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from service.config.adapter import AdapterConfig


class AdapterState(StrEnum):
    PENDING = "PENDING"  # registered; slot reserved (or queued for one), trainer slot not yet initialized
    ACTIVE = "ACTIVE"  # slot initialized, weights published, training
    RETIRING = "RETIRING"  # retire requested: stop rollout, abort requests, final checkpoint + export
    CLEANUP = "CLEANUP"  # export done; clearing the trainer slot and engine versions
    COMPLETED = "COMPLETED"  # done; slot released
    FAILED = "FAILED"  # failed with a reason; slot released


LIVE_STATES = frozenset({AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP})
TERMINAL_STATES = frozenset({AdapterState.COMPLETED, AdapterState.FAILED})
LEGAL_TRANSITIONS: dict[AdapterState, frozenset[AdapterState]] = {
    AdapterState.PENDING: frozenset({AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.FAILED}),
    AdapterState.ACTIVE: frozenset({AdapterState.RETIRING, AdapterState.FAILED}),
    AdapterState.RETIRING: frozenset({AdapterState.CLEANUP, AdapterState.FAILED}),
    AdapterState.CLEANUP: frozenset({AdapterState.COMPLETED, AdapterState.FAILED}),
    AdapterState.COMPLETED: frozenset(),
    AdapterState.FAILED: frozenset(),
}
# Progress (steps, publishes, checkpoints) may still arrive while retiring: the
# train call in flight when the tenant asked to retire did consume its samples.
PROGRESS_STATES = frozenset({AdapterState.ACTIVE, AdapterState.RETIRING})
# The queue: live runs without a slot, first come first served. CLEANUP never waits
# (it has nothing left to train), so it is not in the queue.
# A never-trained run retired while queued is not in it either: it ends without a slot.
_LIVE_WHERE = "state IN ('PENDING','ACTIVE','RETIRING','CLEANUP')"
_WAITING = "slot IS NULL AND (state = 'PENDING' OR (state IN ('ACTIVE','RETIRING') AND activated_at IS NOT NULL))"
_QUEUE_WHERE = f"{_WAITING} ORDER BY queued_at, run_id"
# Partial indexes whose WHERE is the queries' own text, named by INDEXED BY in the per-round reads:
# without statistics SQLite's planner prefers runs_by_state there, which reads every live run and
# sorts them (0.8 ms a read with 1,024 registered, several a round; issue 26: the scheduler's cost
# must follow the slots, not the tenants). `runs_waiting` is the queue in its order; `runs_unqueued`
# the live runs that do not wait (slots and ending runs: what reconcile acts on).
_UNQUEUED = f"{_LIVE_WHERE} AND NOT ({_WAITING})"
_QUEUE_INDEXES = (f"CREATE INDEX IF NOT EXISTS runs_waiting ON runs(queued_at, run_id) WHERE {_WAITING}",
                  f"CREATE INDEX IF NOT EXISTS runs_unqueued ON runs(run_id) WHERE {_UNQUEUED}")
_QUEUED_SQL = f"SELECT registration_id FROM runs INDEXED BY runs_waiting WHERE {_QUEUE_WHERE}"
# How many wait ahead of a run, in the queue's order (NULL times first, then by time, then run id):
# for a run queued at NULL, the NULLs with a lower run id; for one with a time, all NULLs, every
# earlier time and its own time's lower run ids. Each part is a range of runs_waiting (one OR over
# them made SQLite scan the table instead).
_COUNT_WAITING = f"SELECT COUNT(*) FROM runs INDEXED BY runs_waiting WHERE {_WAITING}"
_AHEAD_OF_UNTIMED = f"{_COUNT_WAITING} AND queued_at IS NULL AND run_id < ?"
_AHEAD_OF_TIMED = (f"SELECT ({_COUNT_WAITING} AND queued_at IS NULL) + ({_COUNT_WAITING} AND queued_at < ?) +"
                   f" ({_COUNT_WAITING} AND queued_at = ? AND run_id < ?)")


@dataclass(frozen=True)
class AdapterRef:
    """An immutable snapshot of one run. `last_metrics` is a fresh dict per ref."""

    name: str
    registration_id: str
    state: AdapterState
    slot: int | None
    slot_version: int
    config: AdapterConfig
    total_steps: int | None
    step: int
    samples_trained: int
    weight_version: int | None
    last_metrics: dict[str, float]
    failure_reason: str | None
    export_path: str | None
    checkpoint_path: str | None
    checkpoint_step: int | None
    created_at: float
    updated_at: float
    activated_at: float | None  # first time its trainer slot was initialized; None = never trained
    finished_at: float | None
    queue_position: int | None = None  # 1-based place among the live runs waiting for a slot; None = holds one or ended
    owner: str | None = None  # the tenant that registered it; None = the admin (I8)

    @property
    def queued(self) -> bool:
        """Live and waiting for a slot (never trained: PENDING; trained: evicted)."""
        return self.queue_position is not None

    @property
    def residency(self) -> str | None:
        """Where its trainer state is: "resident" (holds a slot), "queued" (waits for its first
        slot), "evicted" (trained, swapped out, waits for a slot to come back to); None once ended
        or retired before it trained."""
        if self.slot is not None:
            return "resident"
        if self.queue_position is None:
            return None
        return "evicted" if self.activated_at is not None else "queued"

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


@dataclass(frozen=True)
class SlotHolder:
    """Who holds a slot: a live run (`key` its registration id, `state` its state) or a lease
    (`key` the holder, a Tinker model id; `tenant` its tenant)."""

    key: str
    state: AdapterState | None
    tenant: str | None


@dataclass(frozen=True)
class QueuedRun:
    """A run waiting for a slot, as the scheduler reads the queue (no config parsed)."""

    registration_id: str
    state: AdapterState
    queued_at: float  # time.time() it began waiting (registration or eviction)
    trained: bool  # activated before: evicted (restored when bound) rather than new (prepared)
    owner: str | None = None  # its tenant (token shares); None = the admin


@dataclass(frozen=True)
class StepRecord:
    step: int
    samples: int
    weight_version: int | None
    metrics: dict[str, float]
    recorded_at: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES ('version', 0);
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    registration_id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    slot INTEGER,
    slot_version INTEGER NOT NULL UNIQUE,
    config_json TEXT NOT NULL,
    total_steps INTEGER,
    step INTEGER NOT NULL DEFAULT 0,
    samples_trained INTEGER NOT NULL DEFAULT 0,
    weight_version INTEGER,
    last_metrics_json TEXT NOT NULL DEFAULT '{}',
    failure_reason TEXT,
    export_path TEXT,
    checkpoint_path TEXT,
    checkpoint_step INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    activated_at REAL,
    finished_at REAL,
    queued_at REAL,  -- when it last began waiting for a slot (registration or eviction); orders the queue
    owner TEXT  -- I8: the registering tenant; NULL = the admin
);
-- I1 and I2 as indexes: a bug that slips past the checks fails the commit instead of corrupting.
CREATE UNIQUE INDEX IF NOT EXISTS one_live_run_per_name ON runs(name)
    WHERE state IN ('PENDING', 'ACTIVE', 'RETIRING', 'CLEANUP');
CREATE UNIQUE INDEX IF NOT EXISTS one_run_per_slot ON runs(slot) WHERE slot IS NOT NULL;
CREATE INDEX IF NOT EXISTS runs_by_name ON runs(name, run_id);
-- The reads that run at every round or every list (issue 26): live runs by state (and, made once
-- the columns exist in a file of an older schema: registry.py, a tenant's runs by state and the queue).
CREATE INDEX IF NOT EXISTS runs_by_state ON runs(state, run_id);
CREATE TABLE IF NOT EXISTS steps (
    registration_id TEXT NOT NULL REFERENCES runs(registration_id),
    step INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    weight_version INTEGER,
    metrics_json TEXT NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (registration_id, step)
);
-- I7 slot leases: a slot held by something that is not a dataset-driven run (a Tinker model,
-- service/tenants/tinker_model.py, leased by service/scheduling/scheduler.py). A leased slot is held exactly like a live run's slot (I2 counts
-- both); a lease lives only as long as the process that took it (opening the registry drops them).
CREATE TABLE IF NOT EXISTS slot_leases (
    slot INTEGER PRIMARY KEY,
    holder TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT under the registry lock; ROLLBACK on any exception,
    so a refused or failed call changes nothing."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db, self._lock = db, lock

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self._lock.release()


def _visible(tenant: str | None) -> tuple[str, tuple]:
    """The SQL condition (and its arguments) on `runs` rows the caller may see (I8): every row
    for the admin (None), the tenant's own rows otherwise."""
    if tenant is None:
        return "1", ()
    return "owner = ?", (tenant,)


class ConfigCache:
    """registration id -> its parsed AdapterConfig. A run's config_json never changes after
    registration, so a parsed config is reused by every ref of that run: building a list of
    1,024 refs then parses no JSON config (the validators cost about 50 us a config). Bounded
    (least recently used out first); thread-safe."""

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._configs: OrderedDict[str, AdapterConfig] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, registration_id: str, config_json: str) -> AdapterConfig:
        with self._lock:
            config = self._configs.get(registration_id)
            if config is not None:
                self._configs.move_to_end(registration_id)
                return config
        config = AdapterConfig.model_validate_json(config_json)
        with self._lock:
            self._configs[registration_id] = config
            while len(self._configs) > self.capacity:
                self._configs.popitem(last=False)
        return config


def _ref(row: sqlite3.Row, queue_position: int | None, configs: ConfigCache | None = None) -> AdapterRef:
    config = (configs.get(row["registration_id"], row["config_json"]) if configs is not None
              else AdapterConfig.model_validate_json(row["config_json"]))
    return AdapterRef(
        queue_position=queue_position,
        owner=row["owner"],
        name=row["name"],
        registration_id=row["registration_id"],
        state=AdapterState(row["state"]),
        slot=row["slot"],
        slot_version=row["slot_version"],
        config=config,
        total_steps=row["total_steps"],
        step=row["step"],
        samples_trained=row["samples_trained"],
        weight_version=row["weight_version"],
        last_metrics=json.loads(row["last_metrics_json"]),
        failure_reason=row["failure_reason"],
        export_path=row["export_path"],
        checkpoint_path=row["checkpoint_path"],
        checkpoint_step=row["checkpoint_step"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        activated_at=row["activated_at"],
        finished_at=row["finished_at"],
    )


def _checkpoint_sets(row: sqlite3.Row, path: str | None, step: int | None) -> dict[str, Any]:
    """The one place a run's checkpoint columns are written (issue 14 F9: checkpoint_step must
    always be the step of the checkpoint at checkpoint_path): both or neither, in the caller's
    one UPDATE; an older checkpoint than the recorded one changes nothing (a late report
    never replaces a newer checkpoint)."""
    if path is None or step is None:
        raise ValueError(f"a checkpoint is recorded with its path and its step together (got path={path!r}, step={step!r})")
    if row["checkpoint_step"] is not None and step < row["checkpoint_step"]:
        return {}
    return {"checkpoint_path": path, "checkpoint_step": step}
