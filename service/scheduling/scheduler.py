"""The scheduler: the one owner of trainer slots and of residency, for every kind of tenant.

Tenants (service/scheduling/tenant.py) are RL runs, SFT runs (service/tenants/runs.py) and Tinker models
(service/tenants/tinker_model.py). This module is the only one that assigns, takes back and swaps
slots, and the only caller of the trainer's round (trainer/rounds.py). It runs on the training
loop's thread (service/loop/training_loop.py; the Tinker-only host runs it on a thread of its own:
the tests' in-process Tinker host, tests/tinker_in_process.py); other threads only hand it work (a
Tinker model's queue, a model to create) and wake it (`notify`).

The slot record is the registry's (service/registry/registry.py: a live run's `slot`, a Tinker model's
lease, I2 and I7): durable for runs, leases for models. The scheduler reads it (`slot_holders`,
one query per round) and changes it only here, right after the trainer side effect succeeded.

Each round (the loop's steps 1a and 2-3):
  place()     S1 a Tinker model being created waits like any evicted tenant (its creation is its first
                 queued call; its slot is filled from its seeded init): never refused for room;
              S2 waiters: runs queued in the registry (new, or evicted) and evicted models with
                 a queued call, oldest first (one FIFO across both kinds); while they outnumber
                 the free slots, residents are evicted by ONE policy (service/scheduling/residency.py:
                 idle first, then turns, least recently active first): the trainer's bit-exact
                 swap_out under the tenant's key, then the record gives the slot back;
              S3 free slots go to the waiters in order: a new run is bound (the controller's
                 reconcile prepares it next), an evicted tenant is swapped back in (a model whose
                 state is durable only, after a restart or a lost trainer, is loaded from it);
              S4 the next waiters (those the next placements will restore, up to one per slot)
                 whose snapshot was spilled to disk are prefetched: the trainer reads their
                 files into host memory while the next round runs, so their swap-in is a copy.
              The queue is read in pages until enough waiters are found for this placement
                 (the free slots plus one per slot to evict for), so its cost grows with the
                 slots, not with the tenants registered (issue 26); the evicted models come from
                 the wait index (service/scheduling/wait_index.py), which looks at a model when
                 its queue changed and takes the oldest waiting off a heap (issue 41).
  gather()    G1 waits until every resident dataset run has a whole step, or `max_wait_s` after
                 the first tenant became ready; a Tinker call waits at most `window_s` once
                 ready (calls arriving together still share one step) and never for an idle
                 loop: a submission wakes the wait at once; a round whose every resident is
                 ready runs at once (`round_wait`).
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
from dataclasses import dataclass, field
from typing import Any, Callable

from service.scheduling.token_ledger import TokenLedger
from service.registry.registry import AdapterState, Registry
from service.scheduling.residency import ResidencyKnobs
from service.scheduling.round_parts import RoundContextOnce, RoundPart, Span, offer_tokens  # noqa: F401 - RoundPart: the tenants' view
from service.scheduling.slot_moves import SlotMoves
from service.scheduling.tenant import Offer, Tenant, TenantKind
from service.scheduling.wait_index import WaitIndex
from trainer.batch import TrainBatch
from trainer.interface import TrainerInterface
from trainer.rounds import RoundResult, RoundWork

log = logging.getLogger(__name__)


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


def round_wait(ready: list[tuple[Tenant, int]], residents: list[tuple[Tenant, int]], waited_s: float,
               tinker: bool, window_s: float, max_wait_s: float) -> float:
    """G1's rule: how much longer the round waits for more work (<= 0: it runs now), `waited_s`
    after its first tenant became ready.
      - every resident is ready (a lone tenant, or all of them): nothing could join, it runs now;
      - with a Tinker call among the ready: at most `window_s` (calls arriving together share
        one step; a call never waits for a dataset run's step, nor for an idle model's client);
      - dataset runs only: until every resident run that expects work is ready, at most
        `max_wait_s`."""
    keys = {t.key for t, _ in ready}
    if all(t.key in keys for t, _ in residents):
        return 0.0
    if tinker:
        return min(window_s, max_wait_s) - waited_s
    if all(t.key in keys for t, _ in residents if t.expects_work()):
        return 0.0
    return max_wait_s - waited_s


class Scheduler(SlotMoves):
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
        # the same tenants by kind (each in exactly one, beside `_tenants`): the loop asks for the dataset
        # runs every round, and with a thousand Tinker models a scan of them all is most of that call
        self._of_kind: dict[TenantKind, dict[str, Tenant]] = {kind: {} for kind in TenantKind}
        self._tenants_lock = threading.Lock()  # readers on other threads (API, metrics)
        # the evicted Tinker models with work (wait_index.py); a lambda: clear() replaces the dict
        self._waits = WaitIndex(lambda key: self._tenants.get(key))
        self._wake = threading.Condition()
        self._woken = False
        self._failures: dict[str, str] = {}
        self.contended = False  # the last placement left tenants waiting for a slot (slot_moves.py; Tinker models' M7)
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
        # coordinator time since start in the loop's parts of a round (/metrics lorafleet_coordinator_seconds):
        # place (the trainer's swaps included), gather (waiting for ready work), offer (taking it), train (the
        # trainer call), settle (answering it), single (operations that run alone: saves, exports, snapshots);
        # gather_window: the part of gather after the round's first call was ready (waiting for others to join)
        self.seconds = {"place": 0.0, "gather": 0.0, "gather_window": 0.0, "offer": 0.0, "train": 0.0, "settle": 0.0,
                        "single": 0.0}

    # --- tenants --------------------------------------------------------------------------------

    def add(self, tenant: Tenant) -> None:
        """A tenant prepared in the slot the record gives it (a run the controller prepared)."""
        with self._tenants_lock:
            old = self._tenants.get(tenant.key)
            if old is not None:
                self._of_kind[old.kind].pop(old.key, None)
            self._tenants[tenant.key] = tenant
            self._of_kind[tenant.kind][tenant.key] = tenant
        if tenant.kind == TenantKind.TINKER:
            tenant.watch(self._waits.touch)  # W1: it tells the index when its queue changes

    def remove(self, key: str) -> Tenant | None:
        with self._tenants_lock:
            tenant = self._tenants.pop(key, None)
            if tenant is not None:
                self._of_kind[tenant.kind].pop(key, None)
            return tenant

    def get(self, key: str) -> Tenant | None:
        return self._tenants.get(key)

    def tenants(self, *kinds: TenantKind) -> list[Tenant]:
        """Every admitted tenant, or those of `kinds` (kind by kind, each in the order it was added)."""
        with self._tenants_lock:
            if not kinds:
                return list(self._tenants.values())
            return [t for kind in kinds for t in self._of_kind[kind].values()]

    def clear(self) -> list[Tenant]:
        """The trainer was lost (its slots and swap store with it): forget every run (the runs keep
        their slot record; the controller prepares them again from their checkpoints) and return
        them. Tinker models stay, evicted: each comes back from its durable state when it next has
        work (service/tenants/tinker_model.py M6)."""
        with self._tenants_lock:
            gone = [t for t in self._tenants.values() if t.kind != TenantKind.TINKER]
            models = [t for t in self._tenants.values() if t.kind == TenantKind.TINKER]
            self._tenants = {t.key: t for t in models}
            self._of_kind = {kind: {} for kind in TenantKind}
            self._of_kind[TenantKind.TINKER] = dict(self._tenants)
        for m in models:
            self.registry.release_lease(m.key)
            m.lost()
        self._spilled.clear()  # the lost trainer's swap store is gone: nothing of it to prefetch
        self._prefetched.clear()
        self._tiers_stale = True  # the new trainer's tiers are read at the next placement
        return gone

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
        ones where they are, those whose state is durable as it is with slot None (their queued calls
        still need saving), evicted ones swapped into a free slot or one whose tenant was saved
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
            if tenant.durable():  # its state is its durable snapshot (revived, no slot since): nothing to swap in
                self._save_quietly(save, tenant, None, out)
                continue
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
        try:
            return self._gather(start, max_wait_s, stop, poll_s)
        finally:
            self.seconds["gather"] += time.monotonic() - start

    def _gather(self, start: float, max_wait_s: float, stop: Any, poll_s: float) -> list[tuple[Tenant, int]]:
        first_ready: float | None = None
        while True:
            residents = [(t, slot) for t, slot, state in self.residents() if state in (None, AdapterState.ACTIVE)]
            ready = [(t, slot) for t, slot in residents if t.ready()]
            now = time.monotonic()
            if ready and first_ready is None:
                first_ready = now
            tinker = any(t.kind == TenantKind.TINKER for t, _ in ready)
            if ready:
                wait = round_wait(ready, residents, now - first_ready, tinker, self.window_s, max_wait_s)
                if wait <= 0:
                    self.seconds["gather_window"] += now - first_ready
                    return ready
            elif now - start >= max_wait_s or self.placement_pending():
                return []
            else:
                wait = poll_s
            if stop is not None and stop.is_set():
                if first_ready is not None:
                    self.seconds["gather_window"] += time.monotonic() - first_ready
                return ready
            with self._wake:
                if not self._woken:
                    self._wake.wait(max(min(wait, poll_s), 0.001))
                self._woken = False

    def run_round(self, ready: list[tuple[Tenant, int]]) -> RoundOutcome:
        """R1-R2 over the tenants `gather` returned. Raises what the trainer call raised (after every
        offer was given back; `is_lost` tells the loop whether the trainer died), and RoundRefused
        when the trainer refused the dataset batch (its offers given back; the calls ran and settled)."""
        t_offer = time.monotonic()
        offers: list[tuple[Tenant, int, Offer]] = []
        for tenant, slot in ready:
            try:
                offer = tenant.offer(slot)
            except Exception as e:  # one tenant's fault: the others' work taken so far runs in a later round
                for other, _, taken in offers:
                    other.give_back(taken, f"{tenant.name} could not offer its work: {type(e).__name__}: {e}", retry=True)
                raise
            if offer is not None:
                offers.append((tenant, slot, offer))
        if not offers:
            return RoundOutcome()
        work, spans = self._work(offers)
        t0 = time.monotonic()
        self.seconds["offer"] += t0 - t_offer
        result = RoundResult()
        if not work.empty:
            try:
                result = self.trainer.run_round(work)
            except Exception as e:
                lost = self.is_lost(e)  # the trainer died: the work runs again once it is back
                for tenant, _, offer in offers:
                    tenant.give_back(offer, f"{type(e).__name__}: {e}", retry=lost)
                raise
        t_settle = time.monotonic()
        seconds = t_settle - t0
        self.seconds["train"] += seconds
        ctx = RoundContextOnce(seconds, self.rollout_stats)
        outcome = RoundOutcome(seconds=seconds, samples=list(work.batch.samples) if work.batch else [], tenants=len(offers),
                               calls=sum(1 for r in result.calls if r.error is None))
        for i, ((tenant, slot, offer), span) in enumerate(zip(offers, spans)):
            if result.refused is not None and offer.samples:  # the batch changed nothing (trainer/rounds.py)
                tenant.give_back(offer, result.refused)
                continue
            self.tokens.add(tenant.owner, offer_tokens(offer))
            try:
                settled = tenant.settle(offer, span.part(result), slot, ctx)
            except Exception as e:
                if self.is_lost(e):  # the trainer died under a settle (a model's snapshot of its step)
                    self._give_back_unsettled(offers, i, e)
                raise
            if settled is not None:
                outcome.settled.append(settled)
        t_single = time.monotonic()
        self.seconds["settle"] += t_single - t_settle
        for tenant, slot, offer in offers:  # operations that run alone, after the trainer call (R1)
            if offer.single is not None:
                self._run_single(tenant, slot, offer)
        self.seconds["single"] += time.monotonic() - t_single
        self._count(work, outcome)
        if result.refused is not None:
            raise RoundRefused(f"the trainer refused the round's batch: {result.refused}")
        return outcome

    @staticmethod
    def _give_back_unsettled(offers: list[tuple[Tenant, int, Offer]], failed: int, error: Exception) -> None:
        """The trainer died while the tenant of offer `failed` settled (a Tinker model's snapshot under
        durability step, which answers nothing of its offer until the step is durable): that offer,
        every later one and the operations that run alone (none ran yet) go back, to run once the
        trainer is restored (T2); the earlier tenants settled."""
        why = f"{type(error).__name__}: {error}"
        for k, (tenant, _, offer) in enumerate(offers):
            if k >= failed or offer.single is not None:
                tenant.give_back(offer, why, retry=True)

    def _run_single(self, tenant: Tenant, slot: int, offer: Offer) -> None:
        op = offer.single
        try:
            value = op.run(slot)
        except Exception as e:  # noqa: BLE001 - the operation's own caller gets its error
            tenant.settle_single(offer, None, e)
            return
        tenant.settle_single(offer, value, None)

    def run_unplaced(self) -> None:
        """Operations of evicted models that need no slot (unload): run now, whatever the slots. Asked
        of the evicted models whose queue changed since the last look (wait_index.py W3), and of those
        whose background snapshot is still being written (it is recorded at the look that finds it done)."""
        self._waits.refresh({h.key for h in self.slot_holders().values()}.__contains__)
        for m in self._waits.take_unplaced():
            offer = m.offer_unplaced()
            if offer is not None:
                self._run_single(m, None, offer)
            if m.writing_snapshot:
                self._waits.touch(m.key)

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
