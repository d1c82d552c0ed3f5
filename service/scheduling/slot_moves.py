"""The scheduler's placement (its S1-S4, stated in service/scheduling/scheduler.py's module doc):
admissions, the waiters in one FIFO, evictions by the one residency policy, swaps back in and
prefetches of spilled snapshots. `Scheduler` inherits it; it runs on the scheduler's thread only.
With service/scheduling/scheduler.py, the only module that changes the slot record (C1-C3).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from service.errors import Conflict
from service.registry.registry import AdapterState
from service.scheduling.residency import Resident, choose_evictions
from service.scheduling.tenant import Tenant, TenantKind

log = logging.getLogger(__name__)


class SlotMoves:
    """Placement's methods (mixed into Scheduler, which provides registry, trainer, knobs, clock,
    counters, the tenants and the slot record's helpers)."""

    # --- placement: S1-S3 -----------------------------------------------------------------------

    def place(self) -> list[str]:
        """Admit, evict and swap back in (module doc); returns what it did, one line each (each also
        logged here). Its wall time adds to `seconds["place"]` (the per-round cost, /metrics)."""
        t0 = time.perf_counter()
        events = self._place()
        self.seconds["place"] += time.perf_counter() - t0
        self.counters["placements"] += 1
        for e in events:
            log.info("%s", e)
        return events

    def _place(self) -> list[str]:
        events: list[str] = []
        holders = self.slot_holders()
        free = self.registry.free_slots()
        waiters = self._waiters(holders, want=len(free) + 2 * self.registry.num_slots)
        self.contended = len(waiters) > len(free)  # some wait for a slot: the residents' turns end (M7's deferral)
        if self.contended:
            residents = self._resident_view(holders)
            for key in choose_evictions(list(residents.values()), len(waiters), len(free), self.knobs):
                events += self._evict(self._tenants[key], residents[key].slot)
            free = self.registry.free_slots()
        reason = (f"waiting for a trainer slot: all {self.registry.num_slots} slots are held and other tenants "
                  "wait too; they rotate in turns")
        placing = {key for key, _ in waiters[:len(free)]}
        for m in self._waits.take_newly_waiting():  # C4: it is told why it waits (a Tinker future answers try_again with it)
            if m.key not in placing:
                m.waiting_for_slot(reason)
        for i, (key, _) in enumerate(waiters):
            tenant = self._tenants.get(key)
            if i >= len(free):  # C4, the runs among them too
                if tenant is not None:
                    tenant.waiting_for_slot(reason)
                continue
            slot = free[i]
            if tenant is None:  # a run to prepare: bound now, prepared by the controller's reconcile
                try:
                    self.registry.bind(key, slot)
                    events.append(f"{key[:8]} leaves the queue for slot {slot}")
                except Conflict as e:  # retired or failed meanwhile
                    log.info("bind %s: %s", key, e)
                continue
            events += self._restore(tenant, slot)
        events += self._prefetch([key for key, _ in waiters[len(free): len(free) + self.registry.num_slots]])
        if events or self._tiers_stale:
            self._read_swap_tiers()
        return events

    def _prefetch(self, upcoming: list[str]) -> list[str]:
        """S4: start reading the spilled snapshots of the next waiters into host memory (each once)."""
        events = []
        for key in upcoming:
            if key not in self._spilled or key in self._prefetched:
                continue
            self._prefetched.add(key)
            try:
                answer = self.trainer.prefetch_swapped(key)
            except Exception as e:  # a prefetch only saves time: its swap-in reads the file itself
                log.info("prefetch of %s: %s: %s", key, type(e).__name__, e)
                continue
            self.counters["prefetches"] += 1
            events.append(f"prefetching {self._tenants[key].name} from disk ({answer})")
        return events

    def _read_swap_tiers(self) -> None:
        self._tiers_stale = False
        try:
            self.swap_tiers = dict(self.trainer.swap_tiers())
        except Exception as e:  # a gauge: the next placement that changes something reads it again
            log.info("swap tiers: %s: %s", type(e).__name__, e)

    def placement_pending(self) -> bool:
        """Whether placing now would change something: a free slot and a waiter."""
        return bool(self.registry.free_slots()) and bool(self._waiters(self.slot_holders(), want=1))

    def _waiters(self, holders: dict[int, Any], want: int) -> list[tuple[str, bool]]:
        """(key, trained) of the tenants waiting for a slot that want one, in placement order (S2):
        oldest first, except that tenants over their token share (service/config/quotas.py) go after the
        others. A queued run this process has not prepared always wants one (new, or trained before a
        restart: it is prepared from its checkpoint); an evicted run wants one when it has a step ready
        or is retiring (its final checkpoint); an evicted model when a call of it is queued.

        Runs are read from the queue in pages until `want` of them want a slot (or the queue ends):
        a placement needs no more. Models are taken from the wait index (service/scheduling/wait_index.py)
        oldest first until `want` of them are within their share (or none is left): a round looks at
        the models that changed since the last one and at those it takes, not at every evicted model
        (with a thousand models waiting that scan was most of `place`: issue 41). Each owner's share is
        read once."""
        resident = {h.key for h in holders.values()}
        out: list[tuple[bool, float, str, bool]] = []
        shares: dict[str | None, bool] = {}

        def over_share(owner: str | None) -> bool:
            if owner not in shares:
                shares[owner] = self._over_share(owner)
            return shares[owner]

        page, offset, found = max(want, 16), 0, 0
        while found < want:
            heads = self.registry.queue_heads(page, offset)
            for q in heads:
                tenant = self._tenants.get(q.registration_id)
                if tenant is None:  # new, or trained in an earlier process: prepared (from its checkpoint) once bound
                    out.append((over_share(q.owner), q.queued_at, q.registration_id, q.trained))
                elif q.state == AdapterState.RETIRING or tenant.wants_slot():
                    out.append((over_share(tenant.owner), q.queued_at, tenant.key, True))
                else:
                    continue
                found += 1
            if len(heads) < page:
                break
            offset += page
        self._waits.refresh(resident.__contains__)
        for since, m in self._waits.waiting(resident.__contains__, want, counts=lambda m: not over_share(m.owner)):
            out.append((over_share(m.owner), since, m.key, True))
        out.sort(key=lambda e: (e[0], e[1]))
        return [(key, trained) for _, _, key, trained in out]

    def _over_share(self, owner: str | None) -> bool:
        """Whether `owner` trained more than its token share of the last window (service/config/quotas.py)."""
        quotas = self.knobs.quotas
        share = quotas.token_share(owner) if quotas is not None else None
        return share is not None and self.tokens.share(owner) > share

    def _resident_view(self, holders: dict[int, Any]) -> dict[str, Resident]:
        """What the policy needs of each resident tenant that may be evicted: ACTIVE runs and Tinker
        models (a PENDING run has nothing to swap out, a retiring one is about to end)."""
        now = self.clock()
        return {t.key: Resident(t.key, now - t.last_active, t.ready(), t.steps_in, t.last_active, slot,
                                self.knobs.turn_of(t.owner))
                for t, slot, state in self.residents(holders) if state in (None, AdapterState.ACTIVE)}

    def _evict(self, tenant: Tenant, slot: int) -> list[str]:
        tenant.on_evicting(slot)  # a Tinker model's due snapshot, taken from the slot before it leaves
        try:
            out = self.trainer.swap_out(slot, tenant.key)  # SwapError: the slot is as it was (C3)
        except Exception as e:
            return self._evict_failed(tenant, e)
        self._vacate(tenant, slot)
        tenant.on_evicted()
        if out.get("where") == "disk":
            self._spilled.add(tenant.key)
        self.counters["evictions"] += 1
        self.swap_out_s[tenant.name] = float(out.get("seconds", 0.0))
        return [f"evicted {tenant.name} from slot {slot} ({out.get('where', '?')}, {out.get('bytes', 0) / 1e6:.1f} MB, "
                f"{out.get('seconds', 0.0):.4f} s)"]

    def _evict_failed(self, tenant: Tenant, error: Exception) -> list[str]:
        """A swap-out that failed (e.g. the spill folder is full): the tenant keeps its slot (C3); a
        run is failed by the loop (take_failures), a model keeps training where it is."""
        why = f"evict failed: {type(error).__name__}: {error}"
        if tenant.kind != TenantKind.TINKER:
            self._failures[tenant.key] = why
        return [f"{tenant.name}: {why}"]

    def _restore(self, tenant: Tenant, slot: int) -> list[str]:
        self._occupy(tenant, slot)
        restore = tenant.restore_from()  # its durable state (a revived or new Tinker model), else its swap
        try:
            back = restore(slot) if restore is not None else self.trainer.swap_in(slot, tenant.key)
            back = back if isinstance(back, dict) else {}
        except Exception as e:  # the snapshot (or the durable state) stays stored for another try (C3)
            self._vacate_quietly(tenant, slot)
            if tenant.kind == TenantKind.TINKER:
                self._waits.touch(tenant.key)  # it waits again: told why at the next placement (C4)
            return [f"restoring {tenant.name} failed: {type(e).__name__}: {e}"]
        self._forget_swap(tenant.key)
        tenant.on_restored()
        if restore is None:  # a swap back in (a durable restore fills a created or revived model)
            self.counters["restores"] += 1
        self.swap_in_s[tenant.name] = float(back.get("seconds", 0.0))
        return [f"restored {tenant.name} into slot {slot} ({back.get('seconds', 0.0):.4f} s)"]

    def _forget_swap(self, key: str) -> None:
        self._spilled.discard(key)
        self._prefetched.discard(key)

    def _vacate_quietly(self, tenant: Tenant, slot: int) -> None:
        try:
            self._vacate(tenant, slot)
        except Exception:
            log.exception("giving slot %d of %s back", slot, tenant.name)

