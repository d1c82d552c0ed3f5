"""The registry's slot record: which live run or Tinker lease holds each trainer slot, the queue of
runs waiting for one, and the changes the scheduler makes (bind, release, lease, release a lease).
`Registry` (service/registry/registry.py) inherits it; the invariants I2 and I7 are stated there.
Every method runs under the registry's lock or in one of its transactions.
"""

from __future__ import annotations

import sqlite3
import time

from service.errors import Conflict, NoFreeSlot
from service.registry.records import (
    _AHEAD_OF_TIMED,
    _AHEAD_OF_UNTIMED,
    _QUEUE_WHERE,
    _QUEUED_SQL,
    _WAITING,
    PROGRESS_STATES,
    AdapterRef,
    AdapterState,
    QueuedRun,
    SlotHolder,
)


class RegistrySlots:
    """The slot record's methods (mixed into Registry, which provides _db, _lock, _tx, num_slots,
    _run_row, _ref and _update)."""

    def free_slots(self) -> list[int]:
        with self._lock:
            return self._free_slots()

    def _free_slots(self) -> list[int]:
        """The one scan for free slots (I2, I7): held by no live run and no lease, lowest first.
        Caller holds the lock."""
        held = {r[0] for r in self._db.execute("SELECT slot FROM runs WHERE slot IS NOT NULL UNION SELECT slot FROM slot_leases")}
        return [s for s in range(self.num_slots) if s not in held]

    def slot_holders(self) -> dict[int, SlotHolder]:
        """slot -> who holds it (live runs by registration id, leases by holder): the durable slot
        record (I2, I7) in one read, proportional to the slots, not to the registered runs."""
        with self._lock:
            out = {r["slot"]: SlotHolder(r["registration_id"], AdapterState(r["state"]), None)
                   for r in self._db.execute("SELECT slot, registration_id, state FROM runs WHERE slot IS NOT NULL")}
            for r in self._db.execute("SELECT slot, holder, tenant FROM slot_leases"):
                out[r["slot"]] = SlotHolder(r["holder"], None, r["tenant"])
            return out

    def queue_heads(self, limit: int, offset: int = 0) -> list[QueuedRun]:
        """`limit` runs of the queue from `offset`, in order, without building their refs (the scheduler
        reads this every round, page by page: its cost grows with what it reads, not with the queue)."""
        if limit <= 0:
            return []
        with self._lock:
            rows = self._db.execute("SELECT registration_id, state, queued_at, activated_at, owner FROM runs INDEXED BY runs_waiting"
                                    f" WHERE {_QUEUE_WHERE}"
                                    " LIMIT ? OFFSET ?", (limit, offset)).fetchall()
        return [QueuedRun(r["registration_id"], AdapterState(r["state"]), r["queued_at"] or 0.0, r["activated_at"] is not None,
                          r["owner"]) for r in rows]

    # --- slot leases (I7) ----------------------------------------------------------------------

    def lease_slot(self, holder: str, tenant: str, slot: int | None = None) -> int:
        """The lowest free slot (or `slot`, which must be free), now held by `holder` (a Tinker model
        id) until `release_lease`. NoFreeSlot when every slot is held; Conflict when `holder` already
        holds one or `slot` is not free."""
        with self._tx():
            if self._db.execute("SELECT 1 FROM slot_leases WHERE holder = ?", (holder,)).fetchone():
                raise Conflict(f"{holder!r} already holds a trainer slot")
            free = self._free_slots()
            if slot is not None:
                if slot not in free:
                    raise Conflict(f"slot {slot} is not free")
                free = [slot]
            if not free:
                # The holders are not named: this message reaches a tenant (a Tinker future), and
                # other tenants' runs and models are not theirs to see (I8). Operators: GET /v1/fleet.
                raise NoFreeSlot(
                    f"no free trainer slot: all {self.num_slots} slots are held by adapter runs or Tinker models; "
                    "retry after an adapter is retired or a Tinker model is unloaded"
                )
            self._db.execute("INSERT INTO slot_leases (slot, holder, tenant, created_at) VALUES (?, ?, ?, ?)",
                             (free[0], holder, tenant, time.time()))
            return free[0]

    def release_lease(self, holder: str) -> int | None:
        """Free the slot `holder` leased; its number, or None when it held none."""
        with self._tx():
            row = self._db.execute("SELECT slot FROM slot_leases WHERE holder = ?", (holder,)).fetchone()
            if row is None:
                return None
            self._db.execute("DELETE FROM slot_leases WHERE holder = ?", (holder,))
            return row["slot"]

    def leases(self) -> dict[str, tuple[int, str]]:
        """holder -> (slot, tenant) of every slot lease."""
        with self._lock:
            return {r["holder"]: (r["slot"], r["tenant"]) for r in self._db.execute("SELECT slot, holder, tenant FROM slot_leases")}

    # --- the queue: runs without a slot ------------------------------------------------------

    def queued(self) -> list[AdapterRef]:
        """Live runs waiting for a slot, first in line first."""
        with self._lock:
            queue = self._queue()
            positions = {rid: i + 1 for i, rid in enumerate(queue)}
            return [self._ref(self._run_row(rid), positions) for rid in queue]

    def bind(self, registration_id: str, slot: int) -> AdapterRef:
        """Give free `slot` to one queued run (the scheduler picks which, across both kinds of
        tenant: service/scheduling/scheduler.py). Conflict when the run is not queued or the slot not free."""
        with self._tx():
            row = self._run_row(registration_id)
            if not self._waiting(registration_id):
                raise Conflict(f"adapter {row['name']!r} is not waiting for a slot (state {row['state']}, slot {row['slot']})")
            if slot not in self._free_slots():
                raise Conflict(f"slot {slot} is not free")
            self._update(registration_id, {"slot": slot, "queued_at": None, "updated_at": time.time()})
            return self._ref(self._run_row(registration_id), {})

    def release_slot(self, registration_id: str, *, expect_slot: int) -> AdapterRef:
        """An evicted run gives its slot back and joins the end of the queue (I2). Only a trained
        (ACTIVE/RETIRING) run holding `expect_slot` can be evicted: a PENDING run has nothing
        to swap out, a CLEANUP run is about to end."""
        now = time.time()
        with self._tx():
            row = self._run_row(registration_id)
            if row["state"] not in PROGRESS_STATES or row["activated_at"] is None:
                raise Conflict(f"adapter {row['name']!r} is {row['state']}; only a trained ACTIVE or RETIRING run can be evicted")
            if row["slot"] != expect_slot:
                raise Conflict(f"adapter {row['name']!r} holds slot {row['slot']}, not {expect_slot}; its slot changed meanwhile")
            self._update(registration_id, {"slot": None, "queued_at": now, "updated_at": now})
            return self._ref(self._run_row(registration_id))

    # --- helpers ----------------------------------------------------------------------------

    def _queue(self) -> list[str]:
        """Registration ids of the queued runs, in queue order (caller holds the lock)."""
        return [r[0] for r in self._db.execute(_QUEUED_SQL)]

    def _queue_positions(self) -> dict[str, int]:
        """registration id -> 1-based queue position (caller holds the lock)."""
        return {rid: i + 1 for i, rid in enumerate(self._queue())}

    def _waiting(self, registration_id: str) -> bool:
        """Whether the run waits in the queue (one row's test; caller holds the lock)."""
        return self._db.execute(f"SELECT 1 FROM runs WHERE registration_id = ? AND {_WAITING}", (registration_id,)).fetchone() is not None

    def _queue_position(self, row: sqlite3.Row) -> int | None:
        """The 1-based queue position of one run, None when it does not wait: one count in SQLite
        (queue order is `ORDER BY queued_at, run_id`, NULLs first), no Python per queued run: the
        slot changes of every turn build a ref, and the queue holds every registered tenant
        (issue 26: per-round cost proportional to the residents). Caller holds the lock."""
        if not self._waiting(row["registration_id"]):
            return None
        if row["queued_at"] is None:
            ahead = self._db.execute(_AHEAD_OF_UNTIMED, (row["run_id"],))
        else:
            ahead = self._db.execute(_AHEAD_OF_TIMED, (row["queued_at"], row["queued_at"], row["run_id"]))
        return ahead.fetchone()[0] + 1

