"""The scheduler: the one owner of trainer slots and of residency, for every kind of tenant.

Tenants (service/scheduling/tenant.py) are RL runs, SFT runs (service/tenants/runs.py) and Tinker models
(service/tenants/tinker_model.py). This module is the only one that assigns, takes back and swaps
slots, and the only caller of the trainer's round (trainer/rounds.py). It runs on the training
loop's thread (service/loop/training_loop.py; the Tinker-only host runs it on a thread of its own:
service/tenants/tinker_models.py); other threads only hand it work (a Tinker model's queue, a model
to create) and wake it (`notify`).

The slot record is the registry's (service/registry/registry.py: a live run's `slot`, a Tinker model's
lease, I2 and I7): durable for runs, leases for models. The scheduler reads it (`slot_holders`,
one query per round) and changes it only here, right after the trainer side effect succeeded.

Each round (the loop's steps 1a and 2-3):
  place()     S1 creations first: a Tinker model being created gets a free slot now, or one
                 freed by evicting an idle resident (keep-warm, P2) or one whose turn is over
                 (P3), or is refused (NoSlot);
              S2 waiters: runs queued in the registry (new, or evicted) and evicted models with
                 a queued call, oldest first (one FIFO across both kinds); while they outnumber
                 the free slots, residents are evicted by ONE policy (service/scheduling/residency.py:
                 idle first, then turns, least recently active first): the trainer's bit-exact
                 swap_out under the tenant's key, then the record gives the slot back;
              S3 free slots go to the waiters in order: a new run is bound (the controller's
                 reconcile prepares it next), an evicted tenant is swapped back in;
              S4 the next waiters (those the next placements will restore, up to one per slot)
                 whose snapshot was spilled to disk are prefetched: the trainer reads their
                 files into host memory while the next round runs, so their swap-in is a copy.
              The queue is read in pages until enough waiters are found for this placement
                 (the free slots plus one per slot to evict for), so its cost grows with the
                 slots, not with the tenants registered (issue 26).
  gather()    G1 waits until every resident dataset run has a whole step, or `max_wait_s` after
                 the first tenant became ready; a Tinker call waits at most `window_s` once
                 ready (calls arriving together still share one step) and never for an idle
                 loop: a submission wakes the wait at once.
  run_round() R1 every ready resident offers its work; ONE trainer call (`run_round`): a mixed
                 step over the dataset samples and the Tinker datums, then the models'
                 optimizer steps; then the operations that run alone (save, load, unload);
              R2 each tenant settles its part; a round that failed before it ran gives every
                 offer back (nothing counts as done, T2).

Invariants:
  C1 a slot is held by at most one tenant, the one the registry names; a tenant is offered a
     round only while it holds its slot (T1);
  C2 nothing is evicted unless tenants wait beyond the free slots (P1); a tenant with an
     operation taken into the round in progress is never evicted (placement runs between
     rounds only);
  C3 a failed swap-out leaves the tenant resident and unchanged (its slot stays held); a
     failed swap-in keeps its snapshot stored and gives the slot back;
  C4 a Tinker model is never waited for: its calls are answered (or told to wait for a slot,
     with the reason) at every round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from service.errors import Conflict, NoFreeSlot
from service.scheduling.token_ledger import TokenLedger
from service.registry.registry import AdapterState, Registry
from service.scheduling.residency import Resident, ResidencyKnobs, choose_evictions
from service.scheduling.round_parts import RoundContextOnce, RoundPart, Span, offer_tokens  # noqa: F401 - RoundPart: the tenants' view
from service.scheduling.tenant import Offer, Tenant, TenantKind
from trainer.batch import TrainBatch
from trainer.interface import TrainerInterface
from trainer.rounds import RoundResult, RoundWork

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """A tenant that needs a slot NOW or never (a Tinker model being created): `enter(slot)`
    initializes its slot; `done(error)` is told the outcome (None: admitted)."""

    tenant: Tenant
    enter: Callable[[int], None]
    done: Callable[[BaseException | None], None]


@dataclass
class RoundOutcome:
    """What a round did, for the loop: dataset steps to commit, runs to fail, counters."""

    settled: list[Any] = field(default_factory=list)  # what each tenant's settle returned (None dropped)
    seconds: float = 0.0  # the trainer call's wall time
    samples: list = field(default_factory=list)  # the dataset samples trained (token counts)
    tenants: int = 0  # tenants that took part
    calls: int = 0  # Tinker forward_backward calls that ran in the mixed step

    @property
    def empty(self) -> bool:
        return self.tenants == 0


class RoundRefused(RuntimeError):
    """The trainer refused a round's dataset batch (nothing of it ran); the loop retries the round."""


class Scheduler:
    def __init__(self, registry: Registry, trainer: TrainerInterface, knobs: ResidencyKnobs, *, max_seq_len: int = 4096,
                 window_s: float = 0.02, clock: Callable[[], float] = time.monotonic,
                 is_lost: Callable[[BaseException], bool] = lambda e: False) -> None:
        """`trainer`: the trainer's one interface (a TrainerGroup in the fleet; a TrainWorker over an
        in-process trainer in tests). `clock`: monotonic seconds for how long tenants have been idle (tests pass their
        own; waits use the wall clock). `is_lost(error)`: whether a trainer call's error means the
        trainer died."""
        self.registry = registry
        self.trainer = trainer
        self.knobs = knobs
        self.max_seq_len = max_seq_len
        self.window_s = window_s
        self.clock = clock
        self.is_lost = is_lost
        self.rollout_stats: Callable[[], dict[str, Any]] | None = None  # set by the runtime (RL runs' stats)
        self._tenants: dict[str, Tenant] = {}  # every admitted tenant, resident or evicted (loop thread)
        self._tenants_lock = threading.Lock()  # readers on other threads (API, metrics)
        self._admissions: deque[Admission] = deque()
        self._wake = threading.Condition()
        self._woken = False
        self._failures: dict[str, str] = {}
        self.swap_out_s: dict[str, float] = {}  # tenant name -> its last swap-out's seconds (a gauge; kept after it ends)
        self.swap_in_s: dict[str, float] = {}
        # Rank 0's swap tiers after the last placement that changed them (TrainerGroup.swap_tiers:
        # {"host"|"disk"|"prefetched": {"count", "bytes"[, "budget_bytes"]}}): read here, on the loop's
        # thread, so /metrics never waits for the trainer's collective lock.
        self.swap_tiers: dict[str, dict] = {}
        self._spilled: set[str] = set()  # evicted keys whose snapshot went to disk (S4)
        self._prefetched: set[str] = set()  # of those, prefetches asked for
        self._tiers_stale = False  # a snapshot was dropped since the last read (release): read again
        self.tokens = TokenLedger(clock=clock)  # trained tokens per owner (token shares: service/config/quotas.py)
        # rounds; mixed steps with Tinker calls, and those that also trained dataset runs (joined);
        # the calls in them; evictions and restores of every kind
        self.counters = dict(rounds=0, mixed_steps=0, joined_steps=0, joined_calls=0, forward_backward_calls=0,
                             largest_step=0, evictions=0, restores=0, prefetches=0, placements=0)
        self.seconds = {"place": 0.0}  # coordinator time in placement since start (the trainer's swaps included)

    # --- tenants --------------------------------------------------------------------------------

    def add(self, tenant: Tenant) -> None:
        """A tenant prepared in the slot the record gives it (a run the controller prepared)."""
        with self._tenants_lock:
            self._tenants[tenant.key] = tenant

    def remove(self, key: str) -> Tenant | None:
        with self._tenants_lock:
            return self._tenants.pop(key, None)

    def get(self, key: str) -> Tenant | None:
        return self._tenants.get(key)

    def tenants(self, kind: TenantKind | None = None) -> list[Tenant]:
        with self._tenants_lock:
            return [t for t in self._tenants.values() if kind is None or t.kind == kind]

    def clear(self) -> list[Tenant]:
        """Forget every tenant (the trainer was lost: its slots and swap store with it). The Tinker
        models' leases go with them; the runs keep their slot record (the controller prepares them
        again from their checkpoints)."""
        with self._tenants_lock:
            gone, self._tenants = list(self._tenants.values()), {}
        for t in gone:
            if t.kind == TenantKind.TINKER:
                self.registry.release_lease(t.key)
        self._spilled.clear()  # the lost trainer's swap store is gone: nothing of it to prefetch
        self._prefetched.clear()
        self._tiers_stale = True  # the new trainer's tiers are read at the next placement
        while self._admissions:
            self._admissions.popleft().done(RuntimeError("the trainer restarted; create the model again"))
        return gone

    def admit(self, admission: Admission) -> None:
        """Any thread: a tenant to admit at the next placement (S1)."""
        self._admissions.append(admission)
        self.notify()

    def notify(self) -> None:
        """Any thread: work arrived; a gather waiting for it returns now."""
        with self._wake:
            self._woken = True
            self._wake.notify_all()

    # --- the slot record ------------------------------------------------------------------------

    def slot_holders(self) -> dict[int, Any]:
        return self.registry.slot_holders()

    def slot_of(self, key: str) -> int | None:
        for slot, holder in self.registry.slot_holders().items():
            if holder.key == key:
                return slot
        return None

    def residents(self, holders: dict[int, Any] | None = None) -> list[tuple[Tenant, int, AdapterState | None]]:
        """(tenant, slot, run state or None for a model) of every admitted tenant holding its slot now,
        in slot order."""
        holders = self.slot_holders() if holders is None else holders
        return [(self._tenants[h.key], slot, h.state) for slot, h in sorted(holders.items()) if h.key in self._tenants]

    def residents_of(self, kind: TenantKind | None = None) -> list[str]:
        """Keys of the admitted tenants (of `kind`) that hold their slot now."""
        return [t.key for t, _, _ in self.residents() if kind is None or t.kind == kind]

    def take_failures(self) -> dict[str, str]:
        """key -> reason of runs the scheduler could not keep going (a swap-out that failed): the
        loop fails them (controller.fail)."""
        out, self._failures = self._failures, {}
        return out

    def _vacate(self, tenant: Tenant, slot: int) -> None:
        if tenant.kind == TenantKind.TINKER:
            self.registry.release_lease(tenant.key)
        else:
            self.registry.release_slot(tenant.key, expect_slot=slot)

    def _occupy(self, tenant: Tenant, slot: int) -> None:
        if tenant.kind == TenantKind.TINKER:
            self.registry.lease_slot(tenant.key, tenant.owner or "", slot)
        else:
            self.registry.bind(tenant.key, slot)

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
        while self._admissions:
            events += self._admit_now(self._admissions.popleft())
        holders = self.slot_holders()
        free = self.registry.free_slots()
        waiters = self._waiters(holders, want=len(free) + 2 * self.registry.num_slots)
        if len(waiters) > len(free):
            residents = self._resident_view(holders)
            for key in choose_evictions(list(residents.values()), len(waiters), len(free), self.knobs):
                events += self._evict(self._tenants[key], residents[key].slot)
            free = self.registry.free_slots()
        for i, (key, _) in enumerate(waiters):
            tenant = self._tenants.get(key)
            if i >= len(free):  # C4: it is told why it waits (a Tinker future answers try_again with it)
                if tenant is not None:
                    tenant.waiting_for_slot(f"waiting for a trainer slot: all {self.registry.num_slots} slots are held "
                                            f"({len(waiters) - len(free)} tenant(s) wait; they rotate in turns)")
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
        """Whether placing now would change something: a tenant to admit, or a free slot and a waiter."""
        if self._admissions:
            return True
        return bool(self.registry.free_slots()) and bool(self._waiters(self.slot_holders(), want=1))

    def _waiters(self, holders: dict[int, Any], want: int) -> list[tuple[str, bool]]:
        """(key, trained) of the tenants waiting for a slot that want one, in placement order (S2):
        oldest first, except that tenants over their token share (service/config/quotas.py) go after the
        others. A queued run this process has not prepared always wants one (new, or trained before a
        restart: it is prepared from its checkpoint); an evicted run wants one when it has a step ready
        or is retiring (its final checkpoint); an evicted model when a call of it is queued.

        Runs are read from the queue in pages until `want` of them want a slot (or the queue ends):
        a placement needs no more. Every evicted model is looked at (they are in memory; C4)."""
        resident = {h.key for h in holders.values()}
        out: list[tuple[bool, float, str, bool]] = []
        page, offset, found = max(want, 16), 0, 0
        while found < want:
            heads = self.registry.queue_heads(page, offset)
            for q in heads:
                tenant = self._tenants.get(q.registration_id)
                if tenant is None:  # new, or trained in an earlier process: prepared (from its checkpoint) once bound
                    out.append((self._over_share(q.owner), q.queued_at, q.registration_id, q.trained))
                elif q.state == AdapterState.RETIRING or tenant.wants_slot():
                    out.append((self._over_share(tenant.owner), q.queued_at, tenant.key, True))
                else:
                    continue
                found += 1
            if len(heads) < page:
                break
            offset += page
        out += [(self._over_share(m.owner), m.waiting_since(), m.key, True) for m in self.tenants(TenantKind.TINKER)
                if m.key not in resident and m.wants_slot()]
        return [(key, trained) for _, _, key, trained in sorted(out, key=lambda e: (e[0], e[1]))]

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

    def _admit_now(self, a: Admission) -> list[str]:
        events: list[str] = []
        free = self.registry.free_slots()
        if not free:
            residents = self._resident_view(self.slot_holders())
            for key in choose_evictions(list(residents.values()), 1, 0, self.knobs):  # idle first, else a turn used up
                events += self._evict(self._tenants[key], residents[key].slot)
            free = self.registry.free_slots()
        if not free:
            a.done(NoFreeSlot(
                f"no free trainer slot: all {self.registry.num_slots} slots are held by adapter runs or Tinker models; "
                "retry after an adapter is retired or a Tinker model is unloaded"))
            return events
        slot = free[0]
        self._occupy(a.tenant, slot)
        try:
            a.enter(slot)
        except BaseException as err:
            self._vacate(a.tenant, slot)
            a.done(err)
            return events
        self.add(a.tenant)
        a.done(None)
        return events + [f"{a.tenant.name} admitted in slot {slot}"]

    def _evict(self, tenant: Tenant, slot: int) -> list[str]:
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
        try:
            back = self.trainer.swap_in(slot, tenant.key)
        except Exception as e:  # the snapshot stays stored for another try (C3)
            self._vacate_quietly(tenant, slot)
            return [f"restoring {tenant.name} failed: {type(e).__name__}: {e}"]
        self._forget_swap(tenant.key)
        tenant.on_restored()
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

    def release(self, key: str) -> None:
        """A tenant ends: its slot is cleared (or its swapped-out state dropped) and it is forgotten.
        The record's slot is freed by the caller's state change (a run's terminal transition) or
        here (a model's lease)."""
        tenant = self.remove(key)
        self._forget_swap(key)
        slot = self.slot_of(key)
        if slot is not None:
            self.trainer.clear_slot(slot)
        elif tenant is not None:
            self.trainer.drop_swapped(key)
            self._tiers_stale = True
        if tenant is not None:
            if tenant.kind == TenantKind.TINKER:
                self.registry.release_lease(key)
            tenant.release()

    # --- stopping: every tenant's state saved ---------------------------------------------------

    def drain(self, save: Callable[[Tenant, int], Any]) -> dict[str, Any]:
        """At stop (nothing trains any more): `save(tenant, slot)` for every admitted tenant, resident
        ones where they are, evicted ones swapped into a free slot or one whose tenant was saved
        already (its trainer state is not needed again in this process; the slot record is left as
        it is, so a restart finds every run where it was). key -> what `save` returned; a tenant whose
        save failed is logged and left out (the others are still saved)."""
        out: dict[str, Any] = {}
        resident = self.residents()
        for tenant, slot, _ in resident:
            self._save_quietly(save, tenant, slot, out)
        spare = self.registry.free_slots() + [slot for t, slot, _ in resident if t.key in out]
        keys = {t.key for t, _, _ in resident}
        for tenant in [t for t in self.tenants() if t.key not in keys]:
            if not spare:
                log.warning("draining %s: no slot to swap it into; it resumes from its last checkpoint", tenant.name)
                continue
            slot = spare[0]
            try:
                self.trainer.clear_slot(slot)
                self.trainer.swap_in(slot, tenant.key)
            except Exception:
                log.exception("draining %s: swapping it in failed; it resumes from its last checkpoint", tenant.name)
                continue
            self._save_quietly(save, tenant, slot, out)
        return out

    @staticmethod
    def _save_quietly(save: Callable[[Tenant, int], Any], tenant: Tenant, slot: int, out: dict[str, Any]) -> None:
        try:
            result = save(tenant, slot)
        except Exception:  # one tenant's failure must not cost the others their checkpoint
            log.exception("draining %s: its save failed; it resumes from its previous one", tenant.name)
            return
        if result is not None:
            out[tenant.key] = result

    # --- the round: G1, R1, R2 ------------------------------------------------------------------

    def gather(self, max_wait_s: float, stop: Any = None, poll_s: float = 0.05) -> list[tuple[Tenant, int]]:
        """The resident tenants with work for the next round (G1), in slot order: ACTIVE runs and
        models. Empty when nothing got ready within `max_wait_s`, or at once when placement has
        work (a model to create, a free slot and a waiter)."""
        start = time.monotonic()  # waits are wall time; `clock` measures idleness only (tests move it)
        first_ready: float | None = None
        while True:
            residents = [(t, slot) for t, slot, state in self.residents() if state in (None, AdapterState.ACTIVE)]
            ready = [(t, slot) for t, slot in residents if t.ready()]
            now = time.monotonic()
            if ready and first_ready is None:
                first_ready = now
            tinker = any(t.kind == TenantKind.TINKER for t, _ in ready)
            if ready:
                waited = now - first_ready
                ready_keys = {t.key for t, _ in ready}
                everyone = all(t.key in ready_keys for t, _ in residents if t.expects_work())
                if (everyone and (not tinker or waited >= self.window_s)) or waited >= max_wait_s \
                        or (tinker and waited >= self.window_s):
                    return ready
            elif now - start >= max_wait_s or self.placement_pending():
                return []
            if stop is not None and stop.is_set():
                return ready
            with self._wake:
                if not self._woken:
                    self._wake.wait(max(self.window_s, 0.001) if tinker else poll_s)
                self._woken = False

    def run_round(self, ready: list[tuple[Tenant, int]]) -> RoundOutcome:
        """R1-R2 over the tenants `gather` returned. Raises what the trainer call raised (after every
        offer was given back; `is_lost` tells the loop whether the trainer died), and RoundRefused
        when the trainer refused the dataset batch (its offers given back; the calls ran and settled)."""
        offers: list[tuple[Tenant, int, Offer]] = []
        for tenant, slot in ready:
            offer = tenant.offer(slot)
            if offer is not None:
                offers.append((tenant, slot, offer))
        if not offers:
            return RoundOutcome()
        work, spans = self._work(offers)
        t0 = time.monotonic()
        result = RoundResult()
        if not work.empty:
            try:
                result = self.trainer.run_round(work)
            except Exception as e:
                for tenant, _, offer in offers:
                    tenant.give_back(offer, f"{type(e).__name__}: {e}")
                raise
        seconds = time.monotonic() - t0
        ctx = RoundContextOnce(seconds, self.rollout_stats)
        outcome = RoundOutcome(seconds=seconds, samples=list(work.batch.samples) if work.batch else [], tenants=len(offers),
                               calls=sum(1 for r in result.calls if r.error is None))
        for (tenant, slot, offer), span in zip(offers, spans):
            if result.refused is not None and offer.samples:  # the batch changed nothing (trainer/rounds.py)
                tenant.give_back(offer, result.refused)
                continue
            self.tokens.add(tenant.owner, offer_tokens(offer))
            settled = tenant.settle(offer, span.part(result), slot, ctx)
            if settled is not None:
                outcome.settled.append(settled)
        for tenant, slot, offer in offers:  # operations that run alone, after the trainer call (R1)
            if offer.single is not None:
                self._run_single(tenant, slot, offer)
        self._count(work, outcome)
        if result.refused is not None:
            raise RoundRefused(f"the trainer refused the round's batch: {result.refused}")
        return outcome

    def _run_single(self, tenant: Tenant, slot: int, offer: Offer) -> None:
        op = offer.single
        try:
            value = op.run(slot)
        except Exception as e:  # noqa: BLE001 - the operation's own caller gets its error
            tenant.settle_single(offer, None, e)
            return
        tenant.settle_single(offer, value, None)

    def run_unplaced(self) -> None:
        """Operations of evicted models that need no slot (unload): run now, whatever the slots."""
        resident = {h.key for h in self.slot_holders().values()}
        for m in self.tenants(TenantKind.TINKER):
            if m.key in resident:
                continue
            offer = m.offer_unplaced()
            if offer is not None:
                self._run_single(m, None, offer)

    def _work(self, offers: list[tuple[Tenant, int, Offer]]) -> tuple[RoundWork, list[Span]]:
        samples, calls, forwards, optim, spans = [], [], [], [], []
        for _, slot, offer in offers:
            spans.append(Span(len(calls), len(offer.calls), len(forwards), len(offer.forwards),
                               len(optim) if offer.optim is not None else None))
            samples += offer.samples
            calls += offer.calls
            forwards += offer.forwards
            if offer.optim is not None:
                optim.append((slot, offer.optim))
        return RoundWork(batch=TrainBatch(samples=samples) if samples else None, calls=calls, forwards=forwards,
                         optim=optim, max_seq_len=self.max_seq_len), spans

    def _count(self, work: RoundWork, outcome: RoundOutcome) -> None:
        c = self.counters
        c["rounds"] += 1
        if outcome.calls:
            c["mixed_steps"] += 1
            c["forward_backward_calls"] += outcome.calls
            c["largest_step"] = max(c["largest_step"], outcome.calls)
            if work.batch is not None:
                c["joined_steps"] += 1
                c["joined_calls"] += outcome.calls
