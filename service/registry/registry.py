"""The adapter registry: the single source of truth of the service, in SQLite.

Modeled on sglang's `lora_registry.py`: callers get immutable refs
(`AdapterRef`, frozen) and change the registry only through its methods, which
check the invariants below inside one transaction, so a refused call changes
nothing. Restart = open the same file: every run, slot, version, step and
metric is there.

Terms
  * run: one registration of an adapter name; `registration_id` (uuid4 hex)
    names it for good. A name can have many runs over time (re-registered after
    COMPLETED/FAILED), at most one of them live.
  * live: state in PENDING, ACTIVE, RETIRING, CLEANUP. terminal: COMPLETED, FAILED.

Invariants (enforced here, partly by SQLite unique indexes as a second line):
  I1 at most one live run per name;
  I2 a live run holds at most one slot in [0, num_slots); a terminal run holds none;
     no two live runs hold the same slot; a run holds no slot only while it is queued
     (PENDING, waiting for a slot: `queue_position` 1, 2, ... in registration order)
     or, once trained, evicted (ACTIVE/RETIRING, its slot state swapped out to the
     trainer's host memory; it waits in the same queue for a slot to come back to);
     at most `max_live_runs` runs are live;
  I3 versions come from one global counter that only grows and survives restart:
     every `slot_version` (given at registration) and every number handed out by
     `next_version()` (weight publishes) is unique forever, so "<name>@v<k>"
     never names two different weights and a slot's new tenant is never
     confused with the old one;
  I4 state changes follow LEGAL_TRANSITIONS only; terminal states are final;
  I5 step only grows, except when a run is prepared again from an older checkpoint
     (mark_prepared rewinds it to that checkpoint and drops the later steps' records);
     samples_trained is the sum of committed steps' samples;
     progress is committed only for live ACTIVE/RETIRING runs with the caller's
     registration id (a late report about an old tenant is refused, not applied
     to the new one);
  I6 one writer: the file is locked (flock) by the process that opened it;
  I7 a slot lease (a Tinker model's slot, `lease_slot`) holds its slot like a live run:
     register and lease_slot pick only slots held by neither; leases live as long as
     the process that took them (the models are in its memory), so opening drops them;
  I8 every run has an owner, fixed at registration: the tenant whose key registered it, or
     NULL for the admin (the API token, a job file; runs of a registry file written before
     owners existed are the admin's). Every read a tenant makes is filtered by owner here,
     in SQL (`tenant=` arguments; None = the admin, who sees every run), and a run of
     another owner is NotFound with the same message as a run that does not exist.
     Names are global (engines serve "<name>@v<k>"): I1 holds across owners.
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from service.config.adapter import AdapterConfig
from service.config.job import default_live_runs
from service.errors import Conflict, NoFreeSlot, NotFound
from service.registry.sampling_records import SamplingRecords
from service.registry.slots import RegistrySlots
from service.registry.views import RegistryViews, RunQuota
from service.registry.records import (  # noqa: F401 - the records' names are the registry's interface too
    _QUEUE_WHERE, _WAITING, _QUEUED_SQL, _QUEUE_INDEXES, _AHEAD_OF_TIMED, _AHEAD_OF_UNTIMED,  # the queue's SQL
    _SCHEMA,
    LEGAL_TRANSITIONS,
    LIVE_STATES,
    PROGRESS_STATES,
    TERMINAL_STATES,
    AdapterRef,
    AdapterState,
    ConfigCache,
    QueuedRun,
    SlotHolder,
    StepRecord,
    _checkpoint_sets,
    _ref,
    _Transaction,
    _visible,
)


class Registry(RegistrySlots, RegistryViews, SamplingRecords):
    """SQLite-backed registry. Thread-safe (one lock around one connection). Its slot record (free
    slots, holders, the queue, leases, bind and release) is service/registry/slots.py; its reads for
    lists, counts and the loop are its views (service/registry/views.py)."""

    def __init__(self, db_path: str | Path, num_slots: int, max_live_runs: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_live_runs is not None and max_live_runs < num_slots:
            raise ValueError(f"max_live_runs must be >= num_slots ({num_slots}), got {max_live_runs}")
        self.db_path = Path(db_path)
        self.num_slots = num_slots
        self.max_live_runs = max_live_runs if max_live_runs is not None else default_live_runs(num_slots)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.db_path.with_name(self.db_path.name + ".lock"), "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(
                f"registry {self.db_path} is already open in another process; one controller owns it at a time"
            ) from None
        self._lock = threading.Lock()
        self.state_changes = 0  # state writes through this registry (`_update`): a reader that saw N has nothing new to see
        self._configs = ConfigCache()  # parsed configs by registration id (immutable): refs parse none twice
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so each method is one transaction.
        self._db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._create_sampling_tables()  # Tinker sampling sessions and stability records (sampling_records.py)
        self._db.execute("DELETE FROM slot_leases")  # I7: the previous process's leases died with it
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(runs)")}
        if "queued_at" not in columns:  # a registry file written before the queue existed
            self._db.execute("ALTER TABLE runs ADD COLUMN queued_at REAL")
        if "owner" not in columns:  # a registry file written before owners (I8): its runs are the admin's
            self._db.execute("ALTER TABLE runs ADD COLUMN owner TEXT")
        self._db.execute("CREATE INDEX IF NOT EXISTS runs_by_owner ON runs(owner, name, run_id)")
        self._db.execute("CREATE INDEX IF NOT EXISTS runs_by_owner_state ON runs(owner, state)")  # quotas, filters
        self._db.execute("DROP INDEX IF EXISTS runs_queue")  # an earlier, wider queue index the planner did not pick
        for sql in _QUEUE_INDEXES:
            self._db.execute(sql)
        # the slot record's reads (free slots, holders: several a round) scan the slots, not every run
        self._db.execute("CREATE INDEX IF NOT EXISTS runs_holding ON runs(slot) WHERE slot IS NOT NULL")

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lock_file.close()

    # --- transactions -----------------------------------------------------------------------

    def _tx(self):
        return _Transaction(self._db, self._lock)

    def _bump_version(self) -> int:
        self._db.execute("UPDATE counters SET value = value + 1 WHERE name = 'version'")
        return self._db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()[0]

    def _latest_row(self, name: str, tenant: str | None = None) -> sqlite3.Row:
        # The newest run of a name is its live run when it has one (I1: a new run
        # can only be registered when no live run exists). For a tenant: its own newest run
        # of the name (I8; another owner's run is not there at all).
        where, args = _visible(tenant)
        row = self._db.execute(f"SELECT * FROM runs WHERE name = ? AND {where} ORDER BY run_id DESC LIMIT 1",
                               (name, *args)).fetchone()
        if row is None:
            raise NotFound(f"no adapter named {name!r}; list adapters with GET /v1/adapters")
        return row

    def _run_row(self, registration_id: str, tenant: str | None = None) -> sqlite3.Row:
        where, args = _visible(tenant)
        row = self._db.execute(f"SELECT * FROM runs WHERE registration_id = ? AND {where}",
                               (registration_id, *args)).fetchone()
        if row is None:
            raise NotFound(f"no adapter run with registration id {registration_id!r}; list a name's runs with "
                           "GET /v1/adapters/{name}/runs")
        return row

    # --- tenant operations ------------------------------------------------------------------

    def register(self, name: str, config: AdapterConfig, *, total_steps: int | None, owner: str | None = None,
                 quota: RunQuota | None = None) -> AdapterRef:
        """New PENDING run of `owner` (a tenant; None = the admin) with a fresh version, holding
        the lowest free slot, or queued (no slot, a queue position) when every slot is held or
        others wait already.

        Conflict when the name has a live run (a retiring one gets a retry hint; a live run of
        another owner is named only as taken, I8); NoFreeSlot when `max_live_runs` runs are live;
        QuotaExceeded when the owner's `quota` (live runs, queued runs) is used up: checked in the
        same transaction as the insert, so concurrent registrations never pass it together.
        A COMPLETED/FAILED name registers again, by any owner: a new run, the old ones stay."""
        with self._tx():
            now = time.time()  # inside the transaction: queue order (queued_at) is registration order (run_id)
            live = self._db.execute(
                "SELECT state, owner FROM runs WHERE name = ? AND state IN ('PENDING','ACTIVE','RETIRING','CLEANUP')", (name,)
            ).fetchone()
            if live is not None and owner is not None and live["owner"] != owner:
                # Names are global; whose run holds it, and its state, are not this tenant's business.
                raise Conflict(f"adapter name {name!r} is taken by a live run; pick another name "
                               "(names are unique across the service while a run of them is live)")
            if live is not None:
                state = live["state"]
                if state in (AdapterState.RETIRING, AdapterState.CLEANUP):
                    raise Conflict(
                        f"adapter {name!r} is still retiring (state {state}); retry the registration once it is "
                        f"COMPLETED (poll GET /v1/adapters/{name})"
                    )
                raise Conflict(
                    f"adapter name {name!r} is in use by a live run (state {state}); pick another name, "
                    f"or retire it first (DELETE /v1/adapters/{name}) and register again once it is COMPLETED"
                )
            live_count = self._db.execute(
                "SELECT COUNT(*) FROM runs WHERE state IN ('PENDING','ACTIVE','RETIRING','CLEANUP')"
            ).fetchone()[0]
            if live_count >= self.max_live_runs:
                raise NoFreeSlot(
                    f"too many live adapters: {live_count} registered runs are live and max_live_runs is "
                    f"{self.max_live_runs} ({self.num_slots} trainer slots, the rest queued or evicted); "
                    "retry after one of them is retired (DELETE /v1/adapters/<name>) and COMPLETED"
                )
            free = self._free_slots()  # held by neither runs nor Tinker models' leases (I7)
            # A free slot goes to the queue first (FIFO): a newcomer never overtakes a waiting run.
            waiting = self._db.execute(_QUEUED_SQL).fetchone() is not None
            slot = free[0] if free and not waiting else None
            if quota is not None:
                quota.check(owner, *self._usage(owner), queued=slot is None)
            registration_id = uuid.uuid4().hex
            self._db.execute(
                "INSERT INTO runs (name, registration_id, state, slot, slot_version, config_json, total_steps,"
                " created_at, updated_at, queued_at, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, registration_id, AdapterState.PENDING, slot, self._bump_version(),
                 config.model_dump_json(), total_steps, now, now, None if slot is not None else now, owner),
            )
            return self._ref(self._run_row(registration_id))

    def get(self, name: str, tenant: str | None = None) -> AdapterRef:
        """The newest run of `name` (its live run if it has one); for a tenant, its own newest (I8)."""
        with self._lock:
            return self._ref(self._latest_row(name, tenant))

    def get_run(self, registration_id: str, tenant: str | None = None) -> AdapterRef:
        with self._lock:
            return self._ref(self._run_row(registration_id, tenant))

    def runs(self, name: str, tenant: str | None = None) -> list[AdapterRef]:
        """Every run of `name` the caller may see, oldest first; NotFound when there is none (I8)."""
        where, args = _visible(tenant)
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM runs WHERE name = ? AND {where} ORDER BY run_id", (name, *args)).fetchall()
            if not rows:
                self._latest_row(name, tenant)  # raises the one NotFound message of a name
            positions = self._queue_positions()
        return [self._ref(r, positions) for r in rows]

    def owned_runs(self, tenant: str) -> list[AdapterRef]:
        """Every run `tenant` registered, any state, oldest first (whose folders it may start from)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs WHERE owner = ? ORDER BY run_id", (tenant,)).fetchall()
        return [self._ref(r, {}) for r in rows]

    def list(self, state: AdapterState | None = None, tenant: str | None = None) -> list[AdapterRef]:
        """The newest run of every name, oldest name first; optionally only those in `state`.
        For a tenant: the newest of its own runs of every name it used (I8)."""
        where, args = _visible(tenant)
        sql = (f"SELECT * FROM runs r WHERE {where} AND run_id = (SELECT MAX(run_id) FROM runs WHERE name = r.name"
               f" AND {where})")
        args = (*args, *args)
        if state is not None:
            sql += " AND state = ?"
            args = (*args, AdapterState(state))
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY run_id", args).fetchall()
            positions = self._queue_positions()
        return [self._ref(r, positions) for r in rows]

    def live(self) -> list[AdapterRef]:
        """Every live run, in registration order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM runs WHERE state IN ('PENDING','ACTIVE','RETIRING','CLEANUP') ORDER BY run_id"
            ).fetchall()
            positions = self._queue_positions()
        return [self._ref(r, positions) for r in rows]

    def metrics(self, name: str, tenant: str | None = None) -> tuple[str, list[StepRecord]]:
        """(registration id, per-step series by step) of the newest run of `name` (the tenant's own, I8)."""
        with self._lock:
            registration_id = self._latest_row(name, tenant)["registration_id"]
            return registration_id, self._steps(registration_id)

    def run_metrics(self, registration_id: str, tenant: str | None = None) -> tuple[str, list[StepRecord]]:
        """(name, per-step series by step) of one run, any state (a tenant's own only, I8)."""
        with self._lock:
            name = self._run_row(registration_id, tenant)["name"]
            return name, self._steps(registration_id)

    def _steps(self, registration_id: str) -> list[StepRecord]:
        rows = self._db.execute("SELECT * FROM steps WHERE registration_id = ? ORDER BY step", (registration_id,)).fetchall()
        return [StepRecord(r["step"], r["samples"], r["weight_version"], json.loads(r["metrics_json"]), r["recorded_at"])
                for r in rows]

    # --- lifecycle --------------------------------------------------------------------------

    def transition(
        self,
        registration_id: str,
        to: AdapterState,
        *,
        expect: AdapterState | None = None,
        reason: str | None = None,
        export_path: str | None = None,
        checkpoint_path: str | None = None,
        checkpoint_step: int | None = None,
    ) -> AdapterRef:
        """Move a run to `to` (I4). With `expect`, refuse (Conflict) unless the run is
        in that state now: compare-and-set for callers that acted on an older ref.
        Entering a terminal state releases the slot (I2). A checkpoint comes as its path AND
        its step, recorded together (`_checkpoint_sets`)."""
        to = AdapterState(to)
        now = time.time()
        with self._tx():
            row = self._run_row(registration_id)
            current = AdapterState(row["state"])
            if expect is not None and current != expect:
                raise Conflict(f"adapter {row['name']!r} is {current}, not {expect}; its state changed meanwhile")
            if to not in LEGAL_TRANSITIONS[current]:
                allowed = ", ".join(sorted(LEGAL_TRANSITIONS[current])) or "none (final state)"
                raise Conflict(f"adapter {row['name']!r} cannot go from {current} to {to}; allowed from {current}: {allowed}")
            if to == AdapterState.FAILED and not reason:
                raise ValueError("a FAILED transition needs a reason")
            sets = {"state": to, "updated_at": now}
            if reason is not None:
                sets["failure_reason"] = reason
            if export_path is not None:
                sets["export_path"] = export_path
            if checkpoint_path is not None or checkpoint_step is not None:
                sets.update(_checkpoint_sets(row, checkpoint_path, checkpoint_step))
            if to == AdapterState.ACTIVE and row["activated_at"] is None:
                sets["activated_at"] = now
            if to in TERMINAL_STATES:
                sets["slot"] = None
                sets["queued_at"] = None
                sets["finished_at"] = now
            self._update(registration_id, sets)
            return self._ref(self._run_row(registration_id))

    def mark_prepared(self, registration_id: str, *, weight_version: int, step: int = 0, samples_trained: int = 0,
                      total_steps: int | None = None) -> AdapterRef:
        """Record that the run's trainer slot is initialized and `weight_version` is
        published; a PENDING run becomes ACTIVE. A run retired meanwhile keeps its
        state but is marked trained (so retirement exports it). `step` and
        `samples_trained` come from a resumed checkpoint (0 for a fresh start); a run
        prepared again (restart) is rewound to them. `total_steps`, when given, replaces
        the registered total: the exact one the runtime counted as the run opened its data
        (registration estimated it; Prepared.total_steps), in the same UPDATE."""
        now = time.time()
        with self._tx():
            row = self._run_row(registration_id)
            state = AdapterState(row["state"])
            if state in TERMINAL_STATES:
                raise Conflict(f"adapter {row['name']!r} is {state}; a finished run cannot be prepared")
            if row["slot"] is None:
                raise Conflict(f"adapter {row['name']!r} holds no slot (queued); it is prepared once bound to one")
            sets: dict[str, Any] = {"weight_version": weight_version, "updated_at": now}
            if row["activated_at"] is None:
                sets["activated_at"] = now
            if step != row["step"]:
                # The slot now holds the state of `step` (its last checkpoint, or a fresh
                # start): that is the run's progress. Steps recorded after it were lost with
                # the process that trained them and are trained again (I5's one exception).
                self._db.execute("DELETE FROM steps WHERE registration_id = ? AND step > ?", (registration_id, step))
                sets["step"] = step
                sets["samples_trained"] = samples_trained
            if total_steps is not None:
                sets["total_steps"] = total_steps
            if state == AdapterState.PENDING:
                sets["state"] = AdapterState.ACTIVE
            self._update(registration_id, sets)
            return self._ref(self._run_row(registration_id))

    # --- progress from the training loop ----------------------------------------------------

    def record_step(
        self,
        registration_id: str,
        *,
        step: int,
        samples: int,
        metrics: dict[str, float],
        weight_version: int | None = None,
        served: bool = True,
    ) -> AdapterRef:
        """Commit one optimizer step of a run (I5): `samples` trained in it, its metrics, the weight
        version it produced. `served` False: the engines are still loading that version, so the run's
        weight_version (what the engines serve) moves only at `mark_served`."""
        now = time.time()
        with self._tx():
            row = self._progress_row(registration_id)
            if step <= row["step"]:
                raise Conflict(f"adapter {row['name']!r}: step {step} is not after the committed step {row['step']}")
            if samples < 0:
                raise ValueError(f"samples must be >= 0, got {samples}")
            clean = {k: float(v) for k, v in metrics.items()}
            metrics_json = json.dumps(clean)
            self._db.execute(
                "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?)",
                (registration_id, step, samples, weight_version, metrics_json, now),
            )
            sets: dict[str, Any] = {
                "step": step,
                "samples_trained": row["samples_trained"] + samples,
                "last_metrics_json": metrics_json,
                "updated_at": now,
            }
            if weight_version is not None and served:
                sets["weight_version"] = weight_version
            self._update(registration_id, sets)
            return self._ref(self._run_row(registration_id))

    def mark_served(self, registration_id: str, weight_version: int) -> None:
        """The engines serve `weight_version` of the run (its publish finished). Never moves the
        run's weight_version back (publishes of one adapter finish in order, but a late report must
        not undo a newer one)."""
        with self._tx():
            self._db.execute(
                "UPDATE runs SET weight_version = ? WHERE registration_id = ? AND (weight_version IS NULL OR weight_version < ?)",
                (weight_version, registration_id, weight_version),
            )

    def record_checkpoint(self, registration_id: str, path: str, step: int) -> AdapterRef:
        """A checkpoint of this run at `step` is complete on disk at `path`."""
        with self._tx():
            row = self._progress_row(registration_id)
            self._update(registration_id, {**_checkpoint_sets(row, path, step), "updated_at": time.time()})
            return self._ref(self._run_row(registration_id))

    def next_version(self) -> int:
        """A number never handed out before (I3), for naming a weight publish."""
        with self._tx():
            return self._bump_version()

    def _ref(self, row: sqlite3.Row, positions: dict[str, int] | None = None) -> AdapterRef:
        """The ref of `row`; its queue position from `positions` (a list's refs), or read for this
        one row when not given (the caller holds the lock then)."""
        if positions is None:
            position = self._queue_position(row) if row["slot"] is None and row["state"] in LIVE_STATES else None
            return _ref(row, position, self._configs)
        return _ref(row, positions.get(row["registration_id"]), self._configs)

    def _progress_row(self, registration_id: str) -> sqlite3.Row:
        row = self._run_row(registration_id)
        if row["state"] not in PROGRESS_STATES:
            raise Conflict(
                f"adapter {row['name']!r} (registration {registration_id}) is {row['state']}; "
                "progress is recorded only for ACTIVE or RETIRING runs"
            )
        return row

    def _update(self, registration_id: str, sets: dict[str, Any]) -> None:
        cols = ", ".join(f"{k} = ?" for k in sets)
        self._db.execute(f"UPDATE runs SET {cols} WHERE registration_id = ?", (*sets.values(), registration_id))
        if "state" in sets:  # the one write of a run's state: a change a reader of live_states may not have seen
            self.state_changes += 1
