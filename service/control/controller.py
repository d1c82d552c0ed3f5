"""The controller: owns the registry, serves tenant operations, reconciles runs.

Tenant operations (register, list, get, metrics, retire, abort) only read or
change the registry; they never wait on the trainer or the engines (abort asks
the runtime, nothing else). `reconcile()` moves runs along their lifecycle by
calling the attached `Runtime` and committing each new state only after the
side effect succeeded:

    PENDING  --prepare_adapter-->  ACTIVE
    RETIRING --finish_adapter-->   CLEANUP --release_adapter--> COMPLETED
    any live --(runtime call raised)--> FAILED (reason = the error), others unaffected

More tenants than slots (docs/concepts.md): a registration beyond the free slots waits in the
registry's queue (PENDING, no slot). Slots and residency belong to the scheduler
(service/scheduling/scheduler.py, reached through the attached runtime): it evicts, binds queued runs to
free slots and swaps evicted ones back in, before each reconcile; reconcile prepares a run bound
to a slot (first time), finishes and releases. An evicted run that retires is restored by the
scheduler first, to write its final checkpoint and export.

With no runtime attached, reconcile does nothing: runs stay where they are.
The training loop reports progress through record_step / record_checkpoint /
fail and asks retire(name, registration_id) when a run's data or step budget is
used up. Weight versions come from the registry's one counter (`next_version`):
reconcile assigns the first one of a run and passes it into prepare_adapter; the
loop assigns one per publish.

Tenants (issue 14, F5): every tenant operation takes `tenant` — the tenant whose key made the
request, or None for the admin (the API token, the job file, the loop). The registry filters by
it (its I8: a tenant sees and touches only the runs it registered; another's is NotFound, like a
name that does not exist), and a tenant's init_from / resume_from may name only the shared data
roots or its own folders: its runs' and its Tinker folder (service/control/ownership.py).

The controller is a plain object in the coordinator process. It is thread-safe:
the API's threads call tenant operations while the loop reconciles; the registry
serializes its transactions, and reconcile passes are serialized by their own lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from service.config.adapter import AdapterConfig
from service.config.job import SlotCapacity
from service.config.settings import ServiceSettings, format_validation_error
from service.control.config_checks import PEFT_FILES, check_adapter_config
from service.errors import BadValue, Conflict, NotReady
from service.control.ownership import check_export_to, check_tenant_start_paths, own_references
from service.registry.registry import AdapterRef, AdapterState, Registry, StepRecord
from service.registry.views import ListQuery, Page, RunQuota
from service.scheduling.residency import ResidencyKnobs
from service.control.runtime_protocol import ProcessInfo, Runtime, RuntimeStats
from rollout.config import check_adapter_name
from trainer.storage.locations import committed_files, open_store
from trainer.storage.store import CheckpointStore

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 2000


@dataclass(frozen=True)
class Change:
    """One state change made by reconcile()."""

    name: str
    registration_id: str
    from_state: AdapterState
    to_state: AdapterState
    reason: str | None = None


@dataclass(frozen=True)
class MetricsSnapshot:
    """What GET /metrics renders: counts (by state: the newest run of every name; live runs by
    residency), the adapters that get series of their own (settings.metrics_adapter_series: none,
    the metrics_top_k updated most recently, or all), slots, the runtime's and the scheduler's gauges."""

    adapters: list[AdapterRef]
    num_slots: int
    free_slots: int
    runtime: RuntimeStats | None
    by_state: dict[AdapterState, int] = field(default_factory=dict)
    residency: dict[str, int] = field(default_factory=dict)
    swap_tiers: dict[str, dict] = field(default_factory=dict)  # the scheduler's last read of the trainer's tiers
    scheduler_counters: dict[str, int] = field(default_factory=dict)
    coordinator_seconds: dict[str, float] = field(default_factory=dict)  # place, reconcile: time since start
    reconciles: int = 0


@dataclass(frozen=True)
class RunMetrics:
    """The per-step series of one run (the newest run of its name, or one run by id)."""

    name: str
    registration_id: str
    steps: list[StepRecord]


class Controller:
    def __init__(self, settings: ServiceSettings, capacity: SlotCapacity, runtime: Runtime | None = None) -> None:
        self.settings = settings
        self.capacity = capacity
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(settings.db_path, capacity.num_slots, capacity.live_run_bound)
        self._runtime: Runtime | None = None
        # Registration ids whose trainer slot the attached runtime holds in THIS
        # process. After a restart it is empty, so live runs trained before are
        # prepared again (from their last checkpoint) before anything else.
        self._prepared: set[str] = set()
        self._state_changes_seen = -1  # registry.state_changes when reconcile last looked for ended runs
        self._knobs = ResidencyKnobs(idle_evict_s=capacity.evict_idle_s, turn_steps=capacity.turn_steps, quotas=settings.quotas)
        self._reconcile_lock = threading.Lock()  # one reconcile pass at a time
        self.reconcile_seconds, self.reconciles = 0.0, 0  # time in reconcile since start (/metrics: the per-round cost)
        self._started_at = time.time()
        if runtime is not None:
            self.attach_runtime(runtime)

    def close(self) -> None:
        self.registry.close()

    # --- runtime ------------------------------------------------------------------------

    def attach_runtime(self, runtime: Runtime) -> None:
        """Attach (or replace) the runtime; a new runtime holds no slot yet. The runtime's scheduler
        is made over this registry (`attach`), with the keep-warm knobs of `capacity`."""
        with self._reconcile_lock:
            attach = getattr(runtime, "attach", None)
            if attach is not None:
                attach(self.registry, self._knobs)
            self._runtime = runtime
            self._prepared.clear()

    def detach_runtime(self) -> None:
        with self._reconcile_lock:
            self._runtime = None
            self._prepared.clear()

    @property
    def runtime(self) -> Runtime | None:
        """The attached runtime (None before attach / after detach)."""
        return self._runtime

    # --- tenant operations --------------------------------------------------------------

    def register(self, name: str, config: AdapterConfig | dict[str, Any], tenant: str | None = None) -> AdapterRef:
        """Validate (shape, filesystem, limits, what `tenant` may start from), reserve a slot,
        record a PENDING run owned by `tenant` (None = the admin)."""
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise BadValue(str(e), field="name") from None
        if not isinstance(config, AdapterConfig):
            try:
                config = AdapterConfig.model_validate(config)
            except ValidationError as e:
                raise BadValue(f"invalid adapter config:\n{format_validation_error(e, 'config')}", field="config") from None
        checked = check_adapter_config(config, self.settings, self.capacity)
        if checked.config.export_to is not None:  # a location the operator allows the caller (ownership.py)
            check_export_to(checked.config.export_to, self.settings.export_destinations, tenant)
        quota = None
        if tenant is not None:
            if checked.config.init_from is not None or checked.config.resume_from is not None:
                # its runs' folders and its Tinker checkpoints (docs/tinker.md), where the storage keeps them
                own = own_references(open_store(self.settings.storage_location), self.registry.owned_runs(tenant), tenant)
                check_tenant_start_paths(checked.config, state_dir=self.settings.state_dir,
                                         data_roots=self.settings.data_roots, own_dirs=own)
            q = self.settings.quotas.of(tenant)
            quota = RunQuota(q.max_live_runs, q.max_queued_runs, self.settings.quotas.source(tenant))
        ref = self.registry.register(name, checked.config, total_steps=checked.total_steps, owner=tenant, quota=quota)
        log.info("registered %s (registration %s, slot %s, version %s, owner %s)", name, ref.registration_id, ref.slot,
                 ref.slot_version, tenant or "admin")
        return ref

    def list(self, state: str | AdapterState | None = None, tenant: str | None = None) -> list[AdapterRef]:
        return self.registry.list(_parse_state(state) if state is not None else None, tenant)

    def list_page(self, query: ListQuery, tenant: str | None = None) -> Page:
        """One page of the list (service/registry/views.py); `query.owner` is the admin's filter only
        (a tenant sees its own runs whatever it asks)."""
        if tenant is not None and query.owner not in (None, tenant):
            raise BadValue("owner filters the admin's list only; a tenant's list holds its own runs", field="owner")
        return self.registry.list_page(query, tenant)

    def get(self, name: str, tenant: str | None = None) -> AdapterRef:
        return self.registry.get(name, tenant)

    def runs(self, name: str, tenant: str | None = None) -> list[AdapterRef]:
        """Every run of `name` the caller may see (re-registrations included), oldest first."""
        return self.registry.runs(name, tenant)

    def get_run(self, registration_id: str, tenant: str | None = None) -> AdapterRef:
        return self.registry.get_run(registration_id, tenant)

    def metrics(self, name: str, tenant: str | None = None) -> RunMetrics:
        registration_id, steps = self.registry.metrics(name, tenant)
        return RunMetrics(name, registration_id, steps)

    def run_metrics(self, registration_id: str, tenant: str | None = None) -> RunMetrics:
        name, steps = self.registry.run_metrics(registration_id, tenant)
        return RunMetrics(name, registration_id, steps)

    def retire(self, name: str, registration_id: str | None = None, tenant: str | None = None) -> AdapterRef:
        """Ask a live run to retire (-> RETIRING); reconcile finishes it. With
        `registration_id` (the loop's call on exhaustion), only that run is retired."""
        for attempt in range(3):  # the loop may move it PENDING -> ACTIVE between the read and the change
            ref = self.registry.get(name, tenant)
            if registration_id is not None and ref.registration_id != registration_id:
                raise Conflict(f"adapter {name!r}: registration {registration_id} is not its current run")
            if ref.state in (AdapterState.RETIRING, AdapterState.CLEANUP):
                raise Conflict(f"adapter {name!r} is already retiring (state {ref.state}); it ends COMPLETED with its export")
            if not ref.live:
                raise Conflict(f"adapter {name!r} already ended ({ref.state}); only PENDING or ACTIVE adapters can be retired")
            try:
                new = self.registry.transition(ref.registration_id, AdapterState.RETIRING, expect=ref.state)
            except Conflict:
                if attempt == 2:
                    raise
                continue  # read it again: the checks above say what it is now
            log.info("retiring %s (registration %s)", name, ref.registration_id)
            return new
        raise AssertionError("unreachable")

    def abort(self, name: str, tenant: str | None = None) -> int:
        """Abort the run's in-flight generation without retiring it; the number aborted."""
        ref = self.registry.get(name, tenant)
        if not ref.live:
            raise Conflict(f"adapter {name!r} already ended ({ref.state}); abort applies to live adapters only")
        runtime = self._runtime
        if runtime is None or ref.registration_id not in self._prepared:
            return 0  # nothing of it can be in flight
        return int(runtime.abort(ref))

    def health(self) -> dict[str, Any]:
        counts = {s.value: n for s, n in self.registry.state_counts().items()}
        return {"status": "ok", "uptime_s": round(time.time() - self._started_at, 3), "adapters": dict(sorted(counts.items()))}

    def ready(self) -> dict[str, Any]:
        """Ready = a runtime is attached and every component it reports is ok."""
        components: dict[str, dict[str, Any]] = {}
        runtime = self._runtime
        if runtime is None:
            components["runtime"] = {"ok": False, "detail": "no runtime attached (trainer and engines not started)"}
        else:
            try:
                for part, health in runtime.ready().items():
                    components[part] = {"ok": bool(health.ok), "detail": health.detail}
            except Exception as e:  # a broken runtime makes the service not ready, not the endpoint fail
                components["runtime"] = {"ok": False, "detail": f"ready() raised {type(e).__name__}: {e}"}
        free = len(self.registry.free_slots())
        return {
            "ready": bool(components) and all(c["ok"] for c in components.values()),
            "components": components,
            "slots": {"total": self.capacity.num_slots, "free": free, "max_rank": self.capacity.max_rank},
        }

    def processes(self) -> list[ProcessInfo]:
        """The fleet's processes (GET /v1/fleet); only the coordinator while no runtime is attached."""
        runtime = self._runtime
        if runtime is None:
            return [ProcessInfo("coordinator", "coordinator", os.getpid(), "no runtime attached")]
        return runtime.processes()

    def snapshot(self) -> MetricsSnapshot:
        stats = None
        if self._runtime is not None:
            try:
                stats = self._runtime.stats()
            except Exception:
                log.exception("runtime.stats() failed")
        scheduler = getattr(self._runtime, "scheduler", None)  # FleetRuntime's (service/scheduling/scheduler.py)
        series = self.settings.metrics_adapter_series
        adapters = (self.registry.list() if series == "all" else
                    self.registry.recently_updated(self.settings.metrics_top_k) if series == "top" else [])
        return MetricsSnapshot(
            adapters=adapters,
            num_slots=self.capacity.num_slots,
            free_slots=len(self.registry.free_slots()),
            runtime=stats,
            by_state=self.registry.state_counts(),
            residency=self.registry.residency_counts(),
            swap_tiers=dict(scheduler.swap_tiers) if scheduler is not None else {},
            scheduler_counters=dict(scheduler.counters) if scheduler is not None else {},
            coordinator_seconds={"reconcile": self.reconcile_seconds,
                                 **(dict(scheduler.seconds) if scheduler is not None else {})},
            reconciles=self.reconciles,
        )

    # --- progress from the training loop --------------------------------------------------

    def live_count(self) -> int:
        """How many runs are live (the loop reads it every round: one count, no rows)."""
        return self.registry.live_count()

    def active_ids(self) -> list[str]:
        """Registration ids of the ACTIVE runs, oldest first."""
        return self.registry.ids_in_state(AdapterState.ACTIVE)

    def record_step(self, registration_id: str, *, step: int, samples: int, metrics: dict[str, float], weight_version: int | None = None,
                    served: bool = True) -> AdapterRef:
        return self.registry.record_step(registration_id, step=step, samples=samples, metrics=metrics, weight_version=weight_version,
                                         served=served)

    def mark_served(self, registration_id: str, weight_version: int) -> None:
        self.registry.mark_served(registration_id, weight_version)

    def record_checkpoint(self, registration_id: str, path: str, step: int) -> AdapterRef:
        return self.registry.record_checkpoint(registration_id, path, step)

    def next_version(self) -> int:
        return self.registry.next_version()

    def fail(self, registration_id: str, reason: str) -> AdapterRef:
        """Mark one run FAILED (the loop saw bad data, a reward crash loop, NaN...).
        The next reconcile releases its slot in the runtime."""
        ref = self.registry.transition(registration_id, AdapterState.FAILED, reason=reason[:MAX_REASON_CHARS])
        log.warning("adapter %s FAILED: %s", ref.name, reason)
        return ref

    # --- reconciliation -----------------------------------------------------------------

    def reconcile(self) -> list[Change]:
        """One pass over the runs; returns the state changes it made. Releases
        come before preparations, so a slot freed in this pass is clean before
        its next tenant is prepared."""
        t0 = time.perf_counter()
        try:
            return self._reconcile()
        finally:
            self.reconcile_seconds += time.perf_counter() - t0
            self.reconciles += 1

    def _reconcile(self) -> list[Change]:
        with self._reconcile_lock:
            runtime = self._runtime
            if runtime is None:
                return []
            # Per-round cost: the refs of the runs not waiting in the queue (slots + ending): queued and
            # evicted runs have nothing to reconcile, however many are registered. The prepared runs
            # that ended are looked for only after a state changed (`state_changes`): a read of every
            # live run each round grew with the registered tenants (issue 26).
            changes_seen = self.registry.state_changes
            if changes_seen != self._state_changes_seen:
                live = self.registry.live_states()
                for registration_id in sorted(self._prepared - live.keys()):
                    self._release_quietly(runtime, self.registry.get_run(registration_id))
                self._state_changes_seen = changes_seen
            changes: list[Change] = []
            for ref in self.registry.unqueued_live():
                changes.extend(self._advance(runtime, ref))
            return changes

    def _advance(self, runtime: Runtime, ref: AdapterRef) -> list[Change]:
        changes: list[Change] = []
        start = ref.state
        stage = "reconcile"
        try:
            if ref.queued:
                return changes  # queued or evicted: waits for a slot (the scheduler's placement, in queue order)
            needs_prepare = ref.state == AdapterState.PENDING or (
                ref.registration_id not in self._prepared
                and ref.activated_at is not None
                and ref.state in (AdapterState.ACTIVE, AdapterState.RETIRING)
            )
            if needs_prepare:
                stage = "prepare_adapter"
                version = self.registry.next_version()
                prepared = runtime.prepare_adapter(ref, version)
                self._prepared.add(ref.registration_id)
                ref = self.registry.mark_prepared(
                    ref.registration_id,
                    weight_version=version,
                    step=prepared.step,
                    samples_trained=prepared.samples_trained,
                    total_steps=prepared.total_steps,  # exact, where registration estimated the rows
                )
                if ref.state != start:
                    changes.append(Change(ref.name, ref.registration_id, start, ref.state))
            if ref.state == AdapterState.RETIRING:
                export_path = checkpoint_path = checkpoint_step = None
                if ref.activated_at is not None:  # never trained: nothing to export
                    stage = "finish_adapter"
                    finished = runtime.finish_adapter(ref)
                    _check_export(open_store(self.settings.storage_location), finished.export_path)
                    export_path, checkpoint_path = finished.export_path, finished.checkpoint_path
                    checkpoint_step = finished.checkpoint_step
                ref = self.registry.transition(
                    ref.registration_id, AdapterState.CLEANUP, expect=AdapterState.RETIRING,
                    export_path=export_path, checkpoint_path=checkpoint_path, checkpoint_step=checkpoint_step,
                )
                changes.append(Change(ref.name, ref.registration_id, AdapterState.RETIRING, AdapterState.CLEANUP))
            if ref.state == AdapterState.CLEANUP:
                stage = "release_adapter"
                runtime.release_adapter(ref)
                self._prepared.discard(ref.registration_id)
                ref = self.registry.transition(ref.registration_id, AdapterState.COMPLETED, expect=AdapterState.CLEANUP)
                changes.append(Change(ref.name, ref.registration_id, AdapterState.CLEANUP, AdapterState.COMPLETED))
        except Conflict as e:
            # A tenant or the loop changed the run meanwhile (retired while it was being
            # prepared, failed while retiring); the next pass acts on its new state.
            log.info("reconcile %s: %s", ref.name, e)
        except NotReady as e:  # the engines are still starting: prepared at a later pass, nothing changed
            log.debug("reconcile %s: %s", ref.name, e)
        except Exception as e:
            reason = f"{stage} failed: {type(e).__name__}: {e}"[:MAX_REASON_CHARS]
            log.exception("adapter %s: %s", ref.name, reason)
            current = self.registry.get_run(ref.registration_id)
            if current.live:
                failed = self.registry.transition(ref.registration_id, AdapterState.FAILED, reason=reason)
                changes.append(Change(ref.name, ref.registration_id, current.state, failed.state, reason))
            self._release_quietly(runtime, current)
        return changes

    def _release_quietly(self, runtime: Runtime, ref: AdapterRef) -> None:
        """Best-effort release of an ended run's slot in the runtime (its next
        tenant's prepare_adapter overwrites the slot anyway)."""
        try:
            runtime.release_adapter(ref)
        except Exception:
            log.exception("release_adapter(%s) failed; the slot's next prepare_adapter overwrites it", ref.name)
        self._prepared.discard(ref.registration_id)

def _parse_state(state: str | AdapterState) -> AdapterState:
    try:
        return AdapterState(str(state).upper())
    except ValueError:
        raise BadValue(f"unknown state {state!r}; allowed: {', '.join(s.value for s in AdapterState)}", field="state") from None


def _check_export(store: CheckpointStore, export_path: str) -> None:
    """The export is a PEFT folder: by its manifest (committed through the store), else its files."""
    files = committed_files(store, export_path)
    missing = [n for n in PEFT_FILES if n not in files]
    if missing:
        raise RuntimeError(f"export folder {export_path} lacks {missing}: not a PEFT adapter")
