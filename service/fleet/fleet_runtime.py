"""FleetRuntime: the `Runtime` over the real parts (trainer ranks, rollout worker, SGLang engines):
how a dataset-driven run is prepared, finished and released, and the loop's operations on runs.

It is a plain object in the coordinator process, shared by the controller (reconcile: prepare /
finish / release; tenant calls: abort / ready / stats / fleet) and the loop (place, round,
publish, checkpoint, drain). Its parts, each a role of its own:
  scheduler  service/scheduling/scheduler.py     slots and residency of every tenant, the round (one trainer call)
  publisher  service/fleet/publishing.py    stepped RL runs' weights to the engines (steps 4, 4b)
  health     service/fleet/health.py  engine restarts, trainer liveness, what the API reports
  trainer    service/fleet/trainer_group.py the trainer ranks (Ray actors)
  rollout    service/fleet/rollout_client.py the rollout worker and its engines
A prepared run is a tenant (service/tenants/runs.py RlRun / SftRun), held by the scheduler under
its registration id: the one record of a live run's coordinator-side state.

Versions flow one way: the controller (prepare) and the loop (publish) assign each weight
version and pass it in; the runtime never asks for one.

Invariants:
  F1 a run is a tenant of the scheduler iff its trainer slot (or, evicted, its swapped-out state)
     is initialized for that registration (prepare_adapter adds it after init succeeded; release /
     trainer loss remove it);
  F2 a publish is taken only of a resident run (an evicted one is published once restored); a
     checkpoint of a resident one, except at stop: drain saves every tenant, evicted ones swapped
     into a spare slot first;
  F3 a trainer restart loses the slots and the swap store: every prepared run is forgotten here and
     prepared again by the controller from its last checkpoint; Tinker models stay, each restored
     from its durable snapshot when it next has work (service/tenants/tinker_model.py M6).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rollout.data import DataCursor, open_rows
from rollout.messages import AdapterRollout
from service.tenants.batches import CollectedRound, RunFailed, SteppedRun, TrainerLost
from trainer.storage import layouts
from trainer.storage.run_checkpoints import (
    Checkpoint,
    PendingCheckpoint,
    RunState,
    load_checkpoint,
    prune_checkpoints,
    write_checkpoint,
)
from trainer.storage.locations import copy_folder, open_store
from service.control.ownership import check_export_to
from service.config.job import JobConfig
from service.config.settings import ServiceSettings
from service.control.config_checks import no_step_refusal, planned_steps
from service.fleet.health import FleetHealth
from service.errors import NotReady
from service.fleet.engine_pids import record_engines
from service.fleet.publishing import Publisher
from service.registry.registry import AdapterRef, Registry
from service.scheduling.residency import ResidencyKnobs
from service.fleet.rollout_client import RolloutClient
from service.control.runtime_protocol import ComponentHealth, Finished, Prepared, ProcessInfo, RuntimeStats
from service.scheduling.scheduler import Scheduler
from service.tenants.sft_source import SftSource
from service.registry.tinker_records import TinkerRecords
from service.tenants.runs import DatasetRun, RlRun, SftRun
from service.tenants.tinker_model import TinkerModel
from service.scheduling.tenant import TenantKind
from service.fleet.trainer_group import TrainerGroup

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2  # per run: the newest two (one may be mid-write when the process dies)


class FleetRuntime:
    def __init__(self, job: JobConfig, settings: ServiceSettings, *, trainer: TrainerGroup, rollout: RolloutClient | None,
                 tokenizer_path: str | None = None, engines_starting: Any = None) -> None:
        """`rollout` None: an SFT-only runtime (nothing generates; tests). The scheduler is made when
        the controller attaches the runtime (`attach`: it brings the registry). `engines_starting`: the
        rollout worker's start (an ObjectRef of its engines) still under way: the runtime serves
        training at once, and RL runs are prepared once it finished (`engines_ready`)."""
        from transformers import AutoTokenizer

        self.job = job
        self.settings = settings
        self.trainer = trainer
        self.rollout = rollout
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or job.base_model.path)
        self.scheduler: Scheduler | None = None
        self.publisher = Publisher(job, settings, trainer, rollout)
        self.health = FleetHealth(settings.state_dir, trainer, rollout)
        # The one storage layer (trainer/storage/): checkpoints, exports, Tinker states at stop. The
        # trainer commits its parts into the same location (TrainerConfig.storage), by the URLs given.
        self.store = open_store(settings.storage_location)
        self.tinker_records: TinkerRecords | None = None  # made with the scheduler (attach)
        self._engines_starting = engines_starting
        self._engines_since = time.monotonic()

    def attach(self, registry: Registry, knobs: ResidencyKnobs) -> Scheduler:
        """The controller attaches this runtime: the scheduler over its registry (made once; a
        re-attach after a trainer restart keeps it, emptied)."""
        if self.scheduler is None:
            self.scheduler = Scheduler(registry, self.trainer, knobs, max_seq_len=self.settings.tinker_max_seq_len,
                                       window_s=self.settings.tinker_window_ms / 1000.0, is_lost=self.trainer.is_lost)
            self.scheduler.rollout_stats = (lambda: self.rollout.all_stats(timeout_s=30)) if self.rollout is not None else None
            # The Tinker face's durable records, in the registry's file (service/registry/tinker_records.py).
            self.tinker_records = TinkerRecords(registry.db_path, result_ttl_s=self.settings.tinker_result_ttl_s)
        return self.scheduler

    # --- the runs ----------------------------------------------------------------------------------

    def _runs(self) -> list[DatasetRun]:
        if self.scheduler is None:
            return []
        return [t for t in self.scheduler.tenants(TenantKind.SFT, TenantKind.RL) if isinstance(t, DatasetRun)]

    def _run(self, registration_id: str) -> DatasetRun:
        run = self.scheduler.get(registration_id) if self.scheduler is not None else None
        if not isinstance(run, DatasetRun):
            raise KeyError(f"registration {registration_id} is not prepared in this runtime")
        return run

    def runs(self) -> list[str]:
        return [r.key for r in self._runs()]

    def _resident_slot(self, run: DatasetRun, doing: str) -> int:
        slot = self.scheduler.slot_of(run.key)
        if slot is None:  # F2
            raise RuntimeError(f"{run.name} is evicted (swapped out of its slot); it is {doing} once restored")
        return slot

    # --- Runtime protocol: lifecycle -----------------------------------------------------------

    def prepare_adapter(self, ref: AdapterRef, weight_version: int) -> Prepared:
        """See Runtime.prepare_adapter. A run resumed from a checkpoint keeps the checkpoint's
        optimizer hyper-parameters (exact continuation); its shape must match this config.

        A fresh run's total_steps is made exact here, before init_slot sets its schedule: registration
        estimated the rows of a file past data_check_bytes from its size (service/control/config_checks.py), and
        the schedule must end where the data does (`_exact_total`). The data is opened and the checkpoint
        read before the slot is touched, so a run refused here (no whole step) changes nothing."""
        cfg = ref.config
        assert ref.slot is not None, f"{ref.name}: a run is prepared in the slot it holds"
        if cfg.objective == "rl" and not self.engines_ready():
            raise NotReady(f"{ref.name}: the engines are still starting; an RL run is prepared once they serve")
        source = ref.checkpoint_path or cfg.resume_from
        ckpt = load_checkpoint(self.store, source) if source is not None else None
        cursor: DataCursor | None = None
        if ckpt is not None:
            saved = (ckpt.state.objective, ckpt.state.rank, ckpt.state.samples_per_step or cfg.samples_per_step)
            if saved != (cfg.objective, cfg.rank, cfg.samples_per_step):
                raise ValueError(
                    f"checkpoint {ckpt.folder} is of a {saved[0]} run of rank {saved[1]} with {saved[2]} samples per step; "
                    f"this run is {cfg.objective}, rank {cfg.rank}, {cfg.samples_per_step} samples per step: make them equal"
                )
            cursor = DataCursor.model_validate(ckpt.state.data_cursor) if ckpt.state.data_cursor else None
        sft = None
        if cfg.objective != "rl":
            sft = SftSource(cfg.data_config(), self.tokenizer, slot=ref.slot, registration_id=ref.registration_id,
                            samples_per_step=cfg.samples_per_step, cursor=cursor)
        try:
            # A resumed run keeps its recorded total: its schedule is already running (from the checkpoint).
            total = ref.total_steps if ckpt is not None else self._exact_total(ref, sft)
        except BaseException:
            if sft is not None:
                sft.source.close()
            raise
        self._forget_slot(ref.slot)  # whatever this runtime still had there, and this registration's own stale entry
        self.trainer.clear_slot(ref.slot)  # the slot may hold a tenant that was never released cleanly
        if cfg.objective == "rl":
            self._need_rollout().remove_adapter(ref.name)  # a leftover of this name (e.g. after a trainer restart)
        step = samples = 0
        if ckpt is not None:
            self.trainer.load_slot_state(ref.slot, ckpt.store.url(ckpt.trainer_key), registration=ref.registration_id)  # the new tenant's id
            step, samples = ckpt.state.step, ckpt.state.samples_trained
        else:
            hyper = cfg.slot_hyper_params(total)
            self.trainer.init_slot(ref.slot, hyper, cfg.seed, init_from=cfg.init_from, registration=ref.registration_id)
        common = dict(name=ref.name, key=ref.registration_id, config=cfg, total_steps=total, step=step, samples_trained=samples,
                      weight_version=weight_version, owner=ref.owner)
        run: DatasetRun = SftRun(**common, sft=sft) if sft is not None else RlRun(**common, rollout=self.rollout)
        try:
            if isinstance(run, RlRun):
                spec = AdapterRollout(
                    name=ref.name, registration_id=ref.registration_id, data=cfg.data_config(), reward=cfg.reward,
                    sampling=cfg.sampling, rollout=cfg.rollout, initial_version=weight_version, cursor=cursor,
                    max_staleness=cfg.max_staleness,
                )
                self._need_rollout().add_adapter(spec, self.publisher.weights_now(ref.slot, ref.name, ref.registration_id,
                                                                                  weight_version))
        except BaseException:
            self.trainer.clear_slot(ref.slot)
            raise
        self.scheduler.add(run)
        log.info("prepared %s in slot %d at step %d (version %d, from %s)", ref.name, ref.slot, step, weight_version,
                 source or cfg.init_from or "seed")
        return Prepared(step=step, samples_trained=samples, total_steps=total if total != ref.total_steps else None)

    def _exact_total(self, ref: AdapterRef, sft: SftSource | None) -> int | None:
        """The run's total_steps over the rows its data source serves (config_checks.planned_steps, the
        one home of the rule); BadValue (config_checks.no_step_refusal) when they give no whole step.

        The count is the one the data source made when it indexed the file: an SFT run's own source
        (`sft`, opened here anyway). An RL run's source lives in the rollout worker, which opens it only
        after init_slot (its first weights come from the slot), so the rows are counted here with the same
        indexer (rollout.data.open_rows: one pass, JSON checked, nothing tokenized), and only when
        registration estimated them: a .jsonl past data_check_bytes (smaller files were read whole and
        Parquet counted from its metadata, so their count is already exact) and no num_step (which fixes
        the total whatever the rows)."""
        cfg = ref.config
        if cfg.num_step is not None:
            return ref.total_steps
        data = cfg.data_config()
        if sft is not None:
            rows = len(sft.source)
        else:
            path = Path(data.path)
            if path.suffix != ".jsonl" or path.stat().st_size <= self.settings.data_check_bytes:
                return ref.total_steps
            indexed = open_rows(data)
            try:
                rows = len(indexed)
            finally:
                indexed.close()
        total = planned_steps(cfg, rows)
        if total == 0:
            raise no_step_refusal(cfg, rows, Path(data.path).name)
        if total != ref.total_steps:
            log.info("%s: total_steps %s -> %d (the file has %d rows; registration estimated it)", ref.name, ref.total_steps, total, rows)
        return total

    def _forget_slot(self, slot: int) -> None:
        """Forget whatever prepared run this runtime still has in `slot` (a lost release)."""
        holder = self.scheduler.slot_holders().get(slot)
        stale = self.scheduler.get(holder.key) if holder is not None else None
        if isinstance(stale, DatasetRun):
            self._forget(stale)

    def _forget(self, run: DatasetRun) -> None:
        if run.is_rl:
            self._need_rollout().remove_adapter(run.name)
        if self.trainer.running:
            self.scheduler.release(run.key)  # its slot cleared, or its swapped-out state dropped
        else:
            self.scheduler.remove(run.key)
            run.release()

    def finish_adapter(self, ref: AdapterRef) -> Finished:
        """The final checkpoint, and the export: the checkpoint's PEFT folder, linked (not written
        again) as <run dir>/export."""
        run = self._run(ref.registration_id)
        if run.is_rl:
            # Stop generating and abort its requests (their prompts go back to the data source,
            # so the final checkpoint's cursor still lists them).
            self._need_rollout().abort_adapter(run.name, pause=True)
        done = self._write_checkpoint(run)
        export = layouts.run_export(ref.name, ref.registration_id)
        self.store.copy(done.adapter_key, export)  # the final checkpoint's PEFT folder, linked
        if ref.config.export_to is not None:  # and where the tenant asked for it (service/control/ownership.py)
            location, key = check_export_to(ref.config.export_to, self.settings.export_destinations, ref.owner)
            copy_folder(self.store, export, open_store(location), key)
        if run.is_rl:
            self._need_rollout().remove_adapter(run.name)
        # path and step from the one checkpoint just committed (issue 14 F9)
        return Finished(export_path=self.store.url(export), checkpoint_path=done.folder, checkpoint_step=done.state.step)

    def release_adapter(self, ref: AdapterRef) -> None:
        run = self.scheduler.get(ref.registration_id) if self.scheduler is not None else None
        if isinstance(run, DatasetRun):
            self._forget(run)

    def abort(self, ref: AdapterRef) -> int:
        run = self.scheduler.get(ref.registration_id) if self.scheduler is not None else None
        if not isinstance(run, RlRun):
            return 0
        return self._need_rollout().abort_adapter(run.name, pause=False, timeout_s=30)

    def ready(self) -> dict[str, ComponentHealth]:
        if not self.engines_ready():
            return {"trainer": self.trainer.health(), "engines": ComponentHealth(False, "the engines are starting")}
        return self.health.ready(len(self._runs()))

    def stats(self) -> RuntimeStats:
        s = self.scheduler
        return self.health.stats(lambda: {r.name: len(r.staged) for r in self._runs() if isinstance(r, RlRun)},
                                 s.swap_out_s if s is not None else {}, s.swap_in_s if s is not None else {})

    def processes(self) -> list[ProcessInfo]:
        return self.health.processes()

    # --- the loop's operations -------------------------------------------------------------------

    def place(self) -> tuple[list[str], dict[str, str]]:
        """Residency (the scheduler's placement): what it did, and runs it could not keep (to fail)."""
        events = self.scheduler.place()
        self.scheduler.run_unplaced()
        return events, self.scheduler.take_failures()

    def round(self, max_wait_s: float, stop: Any = None) -> CollectedRound:
        """One round: the ready work of every resident tenant (runs and Tinker models), ONE trainer
        call, settled. Raises TrainerLost if the trainer died (every offer given back first)."""
        s = self.scheduler
        if not self.trainer.running:  # stopped or restarting: nothing can train
            if stop is not None:
                stop.wait(max_wait_s)
            return CollectedRound()
        return self.train_round(s.gather(max_wait_s, stop))

    def train_round(self, ready: list) -> CollectedRound:
        """The round over `ready` (what the scheduler's gather returned: (tenant, slot) pairs)."""
        if not ready:
            return CollectedRound()
        try:
            outcome = self.scheduler.run_round(ready)
        except Exception as e:
            if self.trainer.is_lost(e):
                self.health.trainer_note = f"lost: {type(e).__name__}"
                raise TrainerLost(f"trainer died during a train call: {type(e).__name__}: {e}") from e
            raise
        if outcome.samples:
            self.health.last_train_s = outcome.seconds
        stepped = [x for x in outcome.settled if isinstance(x, SteppedRun)]
        failed = {x.registration_id: x.reason for x in outcome.settled if isinstance(x, RunFailed)}
        failed |= {x.registration_id: x.failure for x in stepped if x.failure is not None}  # committed, then FAILED
        return CollectedRound(stepped=stepped, failed=failed, seconds=outcome.seconds, samples=outcome.samples,
                              tenants=outcome.tenants)

    def fatal_runs(self) -> dict[str, str]:
        """Registration id -> why, for every prepared run that can never make another step: an SFT
        run whose every row is over a length limit, an RL run whose rollout reports a fatal_reason
        (no row fits, the engines keep refusing its requests). The loop fails these runs."""
        runs = self._runs()
        out = {r.key: r.fatal_reason() for r in runs if isinstance(r, SftRun) and r.fatal_reason() is not None}
        rl = {r.name: r.key for r in runs if isinstance(r, RlRun)}
        if rl:
            try:
                stats = self._need_rollout().all_stats()  # one call for every RL run
            except Exception as e:  # a busy rollout worker: look again next round (never fail the round for it)
                log.info("rollout stats for fatal runs: %s: %s", type(e).__name__, e)
                stats = {}
            for name, s in stats.items():
                if s.fatal_reason and rl.get(name) == s.registration_id:
                    out[s.registration_id] = s.fatal_reason
        return out

    def exhausted_runs(self, active: list[str]) -> list[tuple[str, str]]:
        """(name, registration id) of active runs that can never make another whole step: their
        budget or data is used up (an RL run's tail shorter than a step is dropped first)."""
        out = []
        for reg in active:
            run = self.scheduler.get(reg)
            if not isinstance(run, DatasetRun):
                continue
            if isinstance(run, RlRun):
                run.drop_tail()
            if run.exhausted():
                out.append((run.name, reg))
        return out

    def publish(self, registration_id: str, version: int) -> bool:
        """Hand the run's current weights to the engines as `version` (service/fleet/publishing.py). True
        while the engines load it (`settle_publishes` reports the outcome); False: nothing to load
        (an SFT run)."""
        run = self._run(registration_id)
        run.weight_version = version
        if not run.is_rl:
            return False
        self.publisher.publish(self._resident_slot(run, "published"), run.name, registration_id, version)
        return True

    def settle_publishes(self):
        resident = set(self.scheduler.residents_of(TenantKind.RL)) if self.scheduler is not None else set()
        return self.publisher.settle({r.key: r for r in self._runs() if r.key in resident})

    def checkpoint(self, registration_id: str) -> str:
        """Write a complete checkpoint of the run at its current step; returns its folder."""
        return self._write_checkpoint(self._run(registration_id)).folder

    def _write_checkpoint(self, run: DatasetRun, slot: int | None = None) -> Checkpoint:
        """`slot`: where the run's state is now (default: the slot it holds; an evicted run has none)."""
        slot = self._resident_slot(run, "checkpointed") if slot is None else slot
        cursor = run.cursor()
        state = RunState(
            name=run.name, registration_id=run.key, objective=run.config.objective, rank=run.config.rank,
            samples_per_step=run.config.samples_per_step,
            step=run.step, samples_trained=run.samples_trained, weight_version=run.weight_version,
            data_cursor=cursor.model_dump(mode="json") if cursor is not None else None,
            rng={"data_shuffle_seed": run.config.seed, "slot_init_seed": run.config.seed},
            metrics=run.finite_metrics(),
        )

        def write_parts(pending: PendingCheckpoint) -> None:
            self.trainer.save_slot_state(slot, self.store.url(pending.trainer_key))
            self.trainer.export_peft(slot, self.store.url(pending.adapter_key))

        done = write_checkpoint(self.store, state, write_parts)  # an unchanged run's checkpoint kept as it is
        prune_checkpoints(self.store, layouts.run_checkpoints(run.name, run.key), KEEP_CHECKPOINTS)
        return done

    # --- faults --------------------------------------------------------------------------------------

    def engines_ready(self) -> bool:
        """Whether the engines started (never blocks). Raises the start's error if it failed: the
        service cannot generate, which stops it as a failed start did before."""
        if self._engines_starting is None:
            return True
        import ray

        done, _ = ray.wait([self._engines_starting], timeout=0)
        if not done:
            return False
        engines = ray.get(self._engines_starting)
        self._engines_starting = None
        record_engines(self.settings.state_dir, engines)
        log.info("engines ready %.1f s after the trainer: %s", time.monotonic() - self._engines_since,
                 ", ".join(e.url for e in engines))
        return True

    def check_engines(self) -> list[str]:
        if not self.engines_ready():
            return []
        return self.health.check_engines()

    def trainer_lost(self) -> bool:
        return self.health.trainer_lost()

    def restart_trainer(self) -> list[str]:
        """Replace the dead trainer (F3); returns the registration ids of the runs to prepare again."""
        lost = self.scheduler.clear() if self.scheduler is not None else []  # Tinker models stay: restored from their durable state
        for t in lost:
            if isinstance(t, RlRun):
                try:
                    self._need_rollout().remove_adapter(t.name)
                except Exception:
                    log.exception("removing %s from the rollout worker", t.name)
            t.release(None)
        self.health.trainer_note = "restarting"
        self.trainer.restart()
        self.health.trainer_note = "running"
        return [t.key for t in lost if isinstance(t, DatasetRun)]

    def drain(self) -> dict[str, tuple[str, int]]:
        """At stop: stop generating for every RL run, then save every tenant (the scheduler's drain:
        evicted ones too, swapped into a spare slot): a run's checkpoint, a Tinker model's state where
        a drained checkpoint of its tenant's (trainer/storage/layouts.py tinker_checkpoint, kind weights). Registration id -> (checkpoint folder,
        step) of each run checkpointed."""
        if self.scheduler is None:
            return {}
        for model in self.scheduler.tenants(TenantKind.TINKER):  # nothing more queued: what is, is saved with them
            if isinstance(model, TinkerModel):
                model.closing = True
        for run in self._runs():
            if run.is_rl:
                try:
                    self._need_rollout().abort_adapter(run.name, pause=True)
                except Exception:
                    log.exception("draining %s: abort", run.name)
        saved = self.scheduler.drain(self._drain_save)
        return {k: v for k, v in saved.items() if isinstance(v, tuple)}

    def _drain_save(self, tenant: Any, slot: int | None) -> Any:
        if isinstance(tenant, DatasetRun):
            return self._write_checkpoint(tenant, slot).folder, tenant.step
        if not isinstance(tenant, TinkerModel):
            return None
        if slot is None:  # durable as it is (revived, no slot since): only what it has queued to keep
            tenant.persist_queue()
            return tenant.journal.snapshot_ref
        url = tenant.snapshot(slot)  # its whole state, pending gradient included: the restart is invisible
        tenant.persist_queue()  # and what it has queued runs after it, in order
        log.info("drained Tinker model %s to %s", tenant.name, url)
        return url

    def shutdown(self) -> None:
        if self.tinker_records is not None:
            self.tinker_records.close()
        if self.rollout is not None:
            try:
                self.rollout.shutdown()
            except Exception:
                log.exception("rollout worker shutdown")
        self.trainer.stop("service stopped")

    def _need_rollout(self) -> RolloutClient:
        if self.rollout is None:
            raise RuntimeError("this runtime has no rollout worker: RL runs cannot be served (SFT only)")
        return self.rollout
