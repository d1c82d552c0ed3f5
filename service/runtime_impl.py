"""FleetRuntime: the `Runtime` over the real parts (trainer ranks, rollout worker, SGLang engines),
plus the operations the training loop (service/loop.py) calls.

It is a plain object in the coordinator process, shared by the controller
(reconcile: prepare / finish / release; tenant calls: abort / ready / stats / fleet)
and the loop (collect / train / publish / checkpoint). It reaches the trainer through
service/trainer_group.py `TrainerGroup` and the rollout worker through
service/rollout_client.py `RolloutClient`, both typed. The loop calls reconcile and
its own operations one after the other, so those never overlap; tenant calls come
from the API's threads at any time and only read or forward: the run table is
guarded by a lock for them.

Versions flow one way: the controller (prepare) and the loop (publish) assign each
weight version and pass it in; the runtime never asks for one.

State per prepared run: `_Run`, keyed by registration id, the one object that holds a live run's
coordinator-side state (the registry holds what outlives the process):
  * RL runs generate through the rollout worker, which owns their data source;
    groups popped from it wait in `staged` until a whole step (prompts_per_step
    groups) is there, so the trainer only ever gets whole steps.
  * SFT runs read their own `SftSource` here (no rollout).

Invariants:
  I1 a run is in `_runs` iff its trainer slot is initialized for that registration
     (prepare_adapter adds it after init succeeded; release / trainer loss remove it);
  I2 every train call gets, per run, exactly one whole step of samples stamped with
     the run's registration id (the trainer drops any sample of another tenant);
  I3 data counts as trained only after the train call that used it returned: SFT
     rows are committed then; RL groups popped for a failed call go back to `staged`;
  I4 a checkpoint's data cursor lists every row not yet trained on (the rollout's
     pending rows plus the staged groups' rows), so a resume redoes nothing and
     skips nothing.
  I5 an evicted run (more tenants than slots: `evict` / `restore`, docs/concepts.md) stays in
     `_runs` with `evicted` set and no slot: its trainer state is in the trainer's swap store
     under its registration id (host memory, or <state_dir>/swap beyond the budget), its SFT
     cursor and staged RL groups stay here. It never takes part in a train call, a publish or
     a checkpoint until `restore` put it back in a slot (any free one). An evicted RL run keeps
     generating (its weights do not change while out, so its groups stay fresh) until the
     rollout worker's per-adapter buffer is full; a whole step staged is its signal that it
     wants a turn. A trainer restart loses the swap store: evicted runs, like resident ones,
     are prepared again from their last checkpoint.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.data import DataCursor, open_rows
from rollout.groups import RolloutGroup
from rollout.weights import AdapterWeights, PendingFolder
from rollout.worker import AdapterRollout, AdapterStats
from service.batches import CollectedBatch, PublishOutcome, StepPlan, SteppedRun, TrainerLost, TrainOutcome, rl_step
from service.checkpoints import ADAPTER_SUBDIR, Checkpoint, PendingCheckpoint, link_folder, RunState, load_checkpoint, prune_checkpoints
from service.config import AdapterConfig, JobConfig, ServiceSettings
from service.config_checks import no_step_refusal, planned_steps
from service.engine_pids import record_engines
from service.registry import AdapterRef
from service.residency import Resident
from service.rollout_client import RolloutClient
from service.runtime import ComponentHealth, Finished, Prepared, ProcessInfo, RuntimeStats, run_dir
from service.sft import SftSource
from service.trainer_group import TrainerGroup
from trainer.batch import TrainBatch, TrainSample

log = logging.getLogger(__name__)

HANDOFF_DIR = "handoff"  # <state_dir>/handoff: PEFT folders the trainer writes for the engines (weight_transfer 'disk')
KEEP_CHECKPOINTS = 2  # per run: the newest two (one may be mid-write when the process dies)
FAIL_AFTER_BAD_STEPS = 3
REPUBLISH_AT_MOST = 3  # failed publishes in a row of one run that are published again; then its next step publishes  # consecutive non-finite steps, or steps whose every reward failed -> FAILED


@dataclass
class _Run:
    name: str
    registration_id: str
    slot: int | None  # None while evicted (I5)
    config: AdapterConfig
    total_steps: int | None
    step: int  # optimizer steps the trainer slot has taken
    samples_trained: int
    weight_version: int
    sft: SftSource | None = None
    staged: list[RolloutGroup] = field(default_factory=list)  # RL: popped, waiting for a whole step
    sft_in_flight: list | None = None  # SFT: rows of the train call in progress (committed or given back after it)
    bad_steps: int = 0
    publish_failures: int = 0  # failed publishes in a row
    foreign_groups: int = 0  # groups of another registration seen at collection (must stay 0)
    last_metrics: dict[str, float] = field(default_factory=dict)
    evicted: bool = False  # I5
    steps_in: int = 0  # steps since it last came into a slot (turns)
    last_active: float = field(default_factory=time.monotonic)  # its last step or arrival in a slot (LRU)

    @property
    def is_rl(self) -> bool:
        return self.config.objective == "rl"

    @property
    def groups_per_step(self) -> int:
        return self.config.prompts_per_step


class FleetRuntime:
    def __init__(self, job: JobConfig, settings: ServiceSettings, *, trainer: TrainerGroup, rollout: RolloutClient | None,
                 tokenizer_path: str | None = None) -> None:
        """`rollout` None: an SFT-only runtime (nothing generates; tests)."""
        from transformers import AutoTokenizer

        self.job = job
        self.settings = settings
        self.trainer = trainer
        self.rollout = rollout
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or job.base_model.path)
        self._runs: dict[str, _Run] = {}
        self._lock = threading.RLock()
        self._last_train_s: float | None = None
        self._trainer_note = "running"
        self._rr_start = 0  # round-robin start of batch collection
        self._publishing: list[_Publish] = []  # publishes in flight, oldest first
        # Handoff folders of a previous process are never read again: start empty (issue 18: no growth).
        self.handoff_dir = Path(settings.state_dir) / HANDOFF_DIR
        shutil.rmtree(self.handoff_dir, ignore_errors=True)
        self._unroutable: dict[int, int] = {}  # engine index -> checks in a row that found it alive but not routed to
        # engine index -> its restart in flight (the loop never waits for one: issue 14 F6)
        self._restarts: dict[int, _EngineRestart] = {}
        # adapter name -> the trainer's time of its last swap-out / swap-in (kept after the run ends, like its step gauge)
        self._swap_out_s: dict[str, float] = {}
        self._swap_in_s: dict[str, float] = {}

    # --- helpers -------------------------------------------------------------------------------

    def _weights(self, slot: int) -> AdapterWeights:
        cfg, tensors = self.trainer.peft_tensors(slot)
        return AdapterWeights(cfg, tensors=tensors)

    def _engine_weights(self, slot: int, name: str, registration_id: str, version: int) -> AdapterWeights:
        """The slot's weights as the engines take them. weight_transfer 'disk' (engines on this node):
        the trainer writes the PEFT folder straight into the handoff folder (safetensors, raw tensor
        bytes) and only its path travels; the rollout worker's pool deletes it once superseded
        (rollout/weights.py). 'tensors' (remote engines): the tensors, sent in the load request."""
        if self.job.engines.weight_transfer != "disk":
            return self._weights(slot)
        folder = self._handoff_folder(name, registration_id, version)
        self.trainer.export_peft(slot, folder, self._publish_dtype)
        return AdapterWeights.from_folder(folder, handoff=True)

    def _handoff_folder(self, name: str, registration_id: str, version: int) -> Path:
        return self.handoff_dir / f"{name}-{registration_id[:12]}-v{version}"

    @functools.cached_property
    def _publish_dtype(self) -> str:
        """The dtype of the handoff folders: engines.publish_dtype, auto = what the engines serve in
        (rollout.config.EngineConfig.served_dtype). Their device 'auto' is a GPU exactly when the
        placement gives the engines GPUs (service/actors.py start_rollout_worker: none on 'cpu')."""
        engines = self.job.engines
        device = engines.device if engines.device != "auto" else ("cuda" if self.job.placement.accelerator == "gpu" else "cpu")
        return engines.resolved_publish_dtype(device, self.job.base_model.path)

    def runs(self) -> list[str]:
        with self._lock:
            return list(self._runs)

    def _run(self, registration_id: str) -> _Run:
        with self._lock:
            try:
                return self._runs[registration_id]
            except KeyError:
                raise KeyError(f"registration {registration_id} is not prepared in this runtime") from None

    # --- Runtime protocol: lifecycle -----------------------------------------------------------

    def prepare_adapter(self, ref: AdapterRef, weight_version: int) -> Prepared:
        """See Runtime.prepare_adapter. A run resumed from a checkpoint keeps the checkpoint's
        optimizer hyper-parameters (exact continuation); its shape must match this config.

        A fresh run's total_steps is made exact here, before init_slot sets its schedule: registration
        estimated the rows of a file past data_check_bytes from its size (service/config_checks.py), and
        the schedule must end where the data does (`_exact_total`). The data is opened and the checkpoint
        read before the slot is touched, so a run refused here (no whole step) changes nothing."""
        cfg = ref.config
        assert ref.slot is not None, f"{ref.name}: a live run always holds a slot"
        source = ref.checkpoint_path or cfg.resume_from
        ckpt = load_checkpoint(source) if source is not None else None
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
        self._evict_slot(ref.slot)  # whatever this runtime still had there, and this registration's own stale entry
        self.trainer.clear_slot(ref.slot)  # the slot may hold a tenant that was never released cleanly
        if cfg.objective == "rl":
            self._need_rollout().remove_adapter(ref.name)  # a leftover of this name (e.g. after a trainer restart)
        step = samples = 0
        if ckpt is not None:
            self.trainer.load_slot_state(ref.slot, ckpt.trainer_dir, registration=ref.registration_id)  # the new tenant's id
            step, samples = ckpt.state.step, ckpt.state.samples_trained
        else:
            hyper = cfg.slot_hyper_params(total)
            self.trainer.init_slot(ref.slot, hyper, cfg.seed, init_from=cfg.init_from, registration=ref.registration_id)
        run = _Run(ref.name, ref.registration_id, ref.slot, cfg, total, step, samples, weight_version=0, sft=sft)
        version = weight_version
        try:
            if run.is_rl:
                spec = AdapterRollout(
                    name=ref.name, registration_id=ref.registration_id, data=cfg.data_config(), reward=cfg.reward,
                    sampling=cfg.sampling, rollout=cfg.rollout, initial_version=version, cursor=cursor, max_staleness=cfg.max_staleness,
                )
                self._need_rollout().add_adapter(spec, self._engine_weights(ref.slot, ref.name, ref.registration_id, version))
        except BaseException:
            self.trainer.clear_slot(ref.slot)
            raise
        run.weight_version = version
        with self._lock:
            self._runs[ref.registration_id] = run
        log.info("prepared %s in slot %d at step %d (version %d, from %s)", ref.name, ref.slot, step, version, source or cfg.init_from or "seed")
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

    def _evict_slot(self, slot: int) -> None:
        """Forget whatever registration this runtime still has in `slot` (a lost release)."""
        with self._lock:
            stale = [r for r in self._runs.values() if r.slot == slot and not r.evicted]
        for r in stale:
            self._forget(r)

    def _forget(self, run: _Run) -> None:
        with self._lock:
            self._runs.pop(run.registration_id, None)
        if run.is_rl:
            self._need_rollout().remove_adapter(run.name)
        if self.trainer.running:
            if run.evicted:  # its place in the swap store (host memory or spill file) is freed
                self.trainer.drop_swapped(run.registration_id)
            else:
                self.trainer.clear_slot(run.slot)

    def finish_adapter(self, ref: AdapterRef) -> Finished:
        """The final checkpoint, and the export: the checkpoint's PEFT folder, linked (not written
        again) as <run dir>/export."""
        run = self._run(ref.registration_id)
        if run.is_rl:
            # Stop generating and abort its requests (their prompts go back to the data source,
            # so the final checkpoint's cursor still lists them).
            self._need_rollout().abort_adapter(run.name, pause=True)
        done = self._write_checkpoint(ref.registration_id)
        export = run_dir(self.settings.state_dir, ref) / "export"
        link_folder(done.folder / ADAPTER_SUBDIR, export)
        if run.is_rl:
            self._need_rollout().remove_adapter(run.name)
        # path and step from the one checkpoint just committed (issue 14 F9)
        return Finished(export_path=str(export), checkpoint_path=str(done.folder), checkpoint_step=done.state.step)

    def release_adapter(self, ref: AdapterRef) -> None:
        with self._lock:
            run = self._runs.get(ref.registration_id)
        if run is not None:
            self._forget(run)

    def abort(self, ref: AdapterRef) -> int:
        with self._lock:
            run = self._runs.get(ref.registration_id)
        if run is None or not run.is_rl:
            return 0
        return self._need_rollout().abort_adapter(run.name, pause=False, timeout_s=30)

    def ready(self) -> dict[str, ComponentHealth]:
        out = {"trainer": self.trainer.health(note=self._trainer_note)}
        if self.rollout is None:  # SFT-only runtime (tests): nothing generates
            return out
        try:
            engines = self.rollout.engine_health(timeout_s=10)
            out["rollout"] = ComponentHealth(True, f"{len(self.runs())} adapter(s) prepared")
            restarting = set(self.restarting_engines())
            for e in engines:
                note = " (restarting)" if e.index in restarting else "" if e.routable else " (not routable)"
                out[f"engine-{e.index}"] = ComponentHealth(
                    e.alive and e.routable and e.index not in restarting, f"{e.url} starts={e.starts} inflight={e.inflight}" + note
                )
        except Exception as e:
            out["rollout"] = ComponentHealth(False, f"rollout worker unreachable: {type(e).__name__}: {e}")
        return out

    def stats(self) -> RuntimeStats:
        queue: dict[str, int] = {}
        inflight: dict[str, int] = {}
        try:
            if self.rollout is None:
                raise RuntimeError("no rollout worker")
            for name, s in self.rollout.all_stats(timeout_s=5).items():
                queue[name] = s.buffered_groups
            for e in self.rollout.engine_health(timeout_s=5):
                inflight[str(e.index)] = e.inflight
        except Exception:
            log.debug("stats: rollout worker unreachable", exc_info=True)
        with self._lock:
            for r in self._runs.values():
                if r.is_rl:
                    queue[r.name] = queue.get(r.name, 0) + len(r.staged)
            swap_out, swap_in = dict(self._swap_out_s), dict(self._swap_in_s)
        return RuntimeStats(queue_depth=queue, engine_inflight=inflight, train_step_seconds=self._last_train_s,
                            swap_out_seconds=swap_out, swap_in_seconds=swap_in)

    def processes(self) -> list[ProcessInfo]:
        """Every process of the fleet with its id (the operator's GET /v1/fleet): the coordinator,
        each trainer rank, the rollout worker and each engine. pid None: not running / unknown."""
        out = [ProcessInfo("coordinator", "coordinator", os.getpid())]
        try:
            pids = self.trainer.pids() if self.trainer.running else []
        except Exception as e:
            log.info("trainer pids: %s: %s", type(e).__name__, e)
            pids = []
        out += [ProcessInfo(f"trainer-rank-{r}", "trainer", pid) for r, pid in enumerate(pids)]
        if self.rollout is not None:
            try:
                procs = self.rollout.processes()
                out.append(ProcessInfo("rollout-worker", "rollout", procs["worker"]))
                out += [ProcessInfo(f"engine-{i}", "engine", pid) for i, pid in enumerate(procs["engines"])]
            except Exception as e:
                out.append(ProcessInfo("rollout-worker", "rollout", None, f"unreachable: {type(e).__name__}"))
        return out

    # --- more tenants than slots (I5) --------------------------------------------------------------

    def residents(self) -> list[Resident]:
        now = time.monotonic()
        with self._lock:
            runs = [r for r in self._runs.values() if not r.evicted]
        return [Resident(r.registration_id, now - r.last_active, self._has_step(r), r.steps_in, r.last_active) for r in runs]

    def _has_step(self, run: _Run) -> bool:
        """A whole step is ready for the run (RL: pops groups into `staged` up to a step; SFT: rows left)."""
        if run.is_rl:
            need = run.groups_per_step - len(run.staged)
            if need > 0:
                run.staged.extend(g for g in self._need_rollout().pop_groups(run.name, need)
                                  if g.registration_id == run.registration_id)
            return len(run.staged) >= run.groups_per_step
        return run.sft is not None and not run.sft.exhausted

    def wants_slot(self, ref: AdapterRef) -> bool:
        with self._lock:
            run = self._runs.get(ref.registration_id)
        return run is None or not run.evicted or self._has_step(run)

    def evict(self, ref: AdapterRef) -> None:
        run = self._run(ref.registration_id)
        if run.evicted or run.slot != ref.slot:
            raise RuntimeError(f"{run.name} is not resident in slot {ref.slot}")
        out = self.trainer.swap_out(run.slot, run.registration_id)  # SwapError: the slot is as it was
        with self._lock:
            run.evicted, run.slot = True, None
            self._swap_out_s[run.name] = float(out["seconds"])
            if run.sft is not None:
                run.sft.slot = -1  # never used while evicted: restore sets the new slot
        log.info("evicted %s from slot %d at step %d (%s, %.1f MB, %.4f s)", run.name, out["slot"], run.step,
                 out["where"], out["bytes"] / 1e6, out["seconds"])

    def restore(self, ref: AdapterRef) -> None:
        run = self._run(ref.registration_id)
        if not run.evicted or ref.slot is None:
            raise RuntimeError(f"{run.name} is not evicted, or has no slot to come back to")
        back = self.trainer.swap_in(ref.slot, run.registration_id)
        with self._lock:
            run.evicted, run.slot = False, ref.slot
            self._swap_in_s[run.name] = float(back["seconds"])
            run.steps_in, run.last_active = 0, time.monotonic()
            if run.sft is not None:
                run.sft.slot = ref.slot  # its samples are routed to the new slot
        log.info("restored %s into slot %d at step %d (%.4f s)", run.name, ref.slot, run.step, back["seconds"])

    # --- the loop's operations -------------------------------------------------------------------

    def collect_batch(self, active: list[str], max_wait_s: float, poll_s: float = 0.05) -> CollectedBatch:
        """One whole step per run that has one ready, round-robin over `active` registration ids.

        Waits until every active run has a whole step, or until `max_wait_s` has passed
        since the first one became ready (a lone or slow adapter never blocks the others
        for longer than that); returns an empty batch when nothing got ready in
        `max_wait_s` (the loop then reconciles and calls again)."""
        with self._lock:
            runs = [self._runs[r] for r in active if r in self._runs and not self._runs[r].evicted]
        if not self.trainer.running:  # stopped or restarting: nothing can train
            time.sleep(max_wait_s)
            return CollectedBatch([], [])
        if not runs:
            return CollectedBatch([], [])
        k = self._rr_start % len(runs)
        runs = runs[k:] + runs[:k]
        self._rr_start += 1
        start = time.monotonic()
        first_ready: float | None = None
        sft_steps: dict[str, tuple[list, list[TrainSample]]] = {}
        while True:
            ready = []
            for run in runs:
                if run.is_rl:
                    need = run.groups_per_step - len(run.staged)
                    if need > 0:
                        for g in self._need_rollout().pop_groups(run.name, need):
                            if g.registration_id == run.registration_id:
                                run.staged.append(g)
                            else:  # the rollout buffer refuses these already; a second line of defence
                                run.foreign_groups += 1
                    if len(run.staged) >= run.groups_per_step:
                        ready.append(run)
                else:
                    if run.registration_id not in sft_steps:
                        taken = run.sft.take_step()
                        if taken is not None:
                            sft_steps[run.registration_id] = taken
                    if run.registration_id in sft_steps:
                        ready.append(run)
            now = time.monotonic()
            if ready and first_ready is None:
                first_ready = now
            if len(ready) == len(runs) or (first_ready is not None and now - first_ready >= max_wait_s):
                break
            if first_ready is None and now - start >= max_wait_s:
                break
            time.sleep(poll_s)
        samples: list[TrainSample] = []
        plans: list[StepPlan] = []
        for run in ready:
            if run.is_rl:
                step_samples, plan = rl_step(run.slot, run.registration_id, run.staged[: run.groups_per_step])
                samples.extend(step_samples)
                plans.append(plan)
            else:
                rows, sft_samples = sft_steps.pop(run.registration_id)
                run.sft_in_flight = rows  # committed after the train call (I3)
                samples.extend(sft_samples)
                plans.append(StepPlan(run.registration_id, len(sft_samples), None, None, 0))
        return CollectedBatch(samples, plans)

    def train(self, batch: CollectedBatch) -> TrainOutcome:
        """One mixed train call over the batch; accounting per I3. Raises TrainerLost if the trainer died."""
        t0 = time.monotonic()
        try:
            result = self.trainer.train(TrainBatch(samples=batch.samples))
        except Exception as e:
            self._return_batch(batch)
            if self.trainer.is_lost(e):
                self._trainer_note = f"lost: {type(e).__name__}"
                raise TrainerLost(f"trainer died during a train call: {type(e).__name__}: {e}") from e
            raise
        seconds = time.monotonic() - t0
        self._last_train_s = seconds
        stepped: list[SteppedRun] = []
        failed: dict[str, str] = {}
        # One rollout call for every RL run of the batch (skip counts, exhaustion), not one per run. The
        # train call has succeeded: a slow answer must not lose its accounting (I3), so on failure the
        # skip counts are left out and _exhausted asks per run, as it would without them.
        rl_stats: dict[str, AdapterStats] = {}
        if any((r := self._runs.get(p.registration_id)) is not None and r.is_rl for p in batch.plans):
            try:
                rl_stats = self._need_rollout().all_stats(timeout_s=30)
            except Exception as e:
                log.info("rollout stats after a train call: %s: %s", type(e).__name__, e)
        for plan in batch.plans:
            run = self._runs.get(plan.registration_id)
            if run is None:
                continue
            self._consume_batch_part(run)
            metrics = result.slots.get(run.slot)
            reports = metrics.steps if metrics is not None else []
            if run.slot in result.skipped_nonfinite or not reports:
                run.bad_steps += 1
                if run.bad_steps >= FAIL_AFTER_BAD_STEPS:
                    failed[run.registration_id] = f"{run.bad_steps} consecutive steps with a non-finite loss or gradient (last at step {run.step + 1})"
                continue
            if run.is_rl and plan.reward_failures == plan.samples:
                run.bad_steps += 1
                if run.bad_steps >= FAIL_AFTER_BAD_STEPS:
                    failed[run.registration_id] = f"the reward failed on every sample of {run.bad_steps} consecutive steps"
            else:
                run.bad_steps = 0
            report = reports[-1]
            run.step = report.step
            run.steps_in += 1
            run.last_active = time.monotonic()
            run.samples_trained += plan.samples
            # The API shows these keys by name (last reward / loss, the metrics series) and /metrics
            # exports them; any other float-valued key is stored and shown too.
            m = {"loss": report.loss, "learning_rate": report.lr, "grad_norm": report.grad_norm, "train_seconds": seconds,
                 "tokens": float(metrics.loss_tokens)}  # this call's loss tokens of the slot (dashboard: tokens / s)
            if run.is_rl:
                m["kl_mean"] = metrics.kl_mean
            stats = rl_stats.get(run.name) if run.is_rl else None
            if stats is not None and stats.registration_id == run.registration_id:
                m.update(stats.step_metrics())
            elif run.sft is not None:
                m.update(run.sft.skip_metrics())
            if plan.reward_mean is not None:
                m["reward_mean"] = plan.reward_mean
            if plan.staleness_mean is not None:
                m["staleness_mean"] = plan.staleness_mean
            if plan.version_min is not None:
                m["sample_version_min"] = plan.version_min
            m.update(plan.metrics)
            # Samples of another tenant of the slot: dropped by the trainer / refused here (both must stay 0).
            m["foreign_samples_dropped"] = result.dropped_foreign.get(run.slot, 0) + run.foreign_groups
            run.last_metrics = m
            interval = run.config.checkpoint_interval
            stepped.append(SteppedRun(
                run.registration_id, run.name, run.step, plan.samples, m,
                exhausted=self._exhausted(run, stats), due_checkpoint=interval > 0 and run.step % interval == 0,
            ))
        return TrainOutcome(stepped, failed, seconds)

    def _consume_batch_part(self, run: _Run) -> None:
        if run.is_rl:
            del run.staged[: run.groups_per_step]
        # SFT rows: committed here (I3)
        elif run.sft is not None and run.sft_in_flight is not None:
            run.sft.commit(run.sft_in_flight)
            run.sft_in_flight = None

    def _return_batch(self, batch: CollectedBatch) -> None:
        for plan in batch.plans:
            run = self._runs.get(plan.registration_id)
            if run is not None and run.sft is not None and run.sft_in_flight is not None:
                run.sft.give_back(run.sft_in_flight)
                run.sft_in_flight = None

    def _exhausted(self, run: _Run, stats: AdapterStats | None = None) -> bool:
        """`stats`: the RL run's rollout stats when already fetched (else asked for here)."""
        if run.config.num_step is not None and run.step >= run.config.num_step:
            return True
        if run.is_rl:
            if run.staged:
                return False
            s = stats if stats is not None else self._need_rollout().stats(run.name)
            return s.data.exhausted and s.buffered_groups == 0 and s.inflight_groups == 0
        return run.sft.exhausted

    def fatal_runs(self) -> dict[str, str]:
        """Registration id -> why, for every prepared run that can never make another step: an SFT
        run whose every row is over a length limit, an RL run whose rollout reports a fatal_reason
        (no row fits, the engines keep refusing its requests). The loop fails these runs."""
        with self._lock:
            runs = list(self._runs.values())
        out = {run.registration_id: run.sft.failure_reason for run in runs
               if run.sft is not None and run.sft.failure_reason is not None}
        rl = {run.name: run.registration_id for run in runs if run.is_rl}
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
        budget or data is used up. An RL run whose data ran out with fewer groups staged than a
        step needs drops that tail (SFT does the same in SftSource.take_step)."""
        out = []
        for reg in active:
            run = self._runs.get(reg)
            if run is None:
                continue
            if run.is_rl and run.staged and (run.config.num_step is None or run.step < run.config.num_step):
                s = self._need_rollout().stats(run.name)
                if s.data.exhausted and s.buffered_groups == 0 and s.inflight_groups == 0:
                    log.info("%s: data used up; dropping a tail of %d group(s), less than a step", run.name, len(run.staged))
                    run.staged.clear()
            if self._exhausted(run):
                out.append((run.name, reg))
        return out

    def publish(self, registration_id: str, version: int) -> bool:
        """Hand the run's current weights to the engines as `version` (RL; SFT runs are not served).

        Returns once the weights are taken from the trainer; with weight_transfer 'disk' at once: the
        trainer snapshots the weights before its next call and writes the handoff folder (nothing
        pickled or base64-encoded) on a writer thread while that call runs; the rollout worker
        waits for that write, not the loop nor the next train call. The engines load them while the loop goes on (the rollout worker applies one adapter's publishes in order,
        and any later remove/abort of the adapter after them; its buffer counts the version as
        published before the load starts, so groups of older weights are already one behind).
        Returns True while the engines load it: `settle_publishes` reports the outcome, and only
        then do the engines serve it. False: nothing to load (an SFT run)."""
        run = self._run(registration_id)
        run.weight_version = version
        if not run.is_rl:
            return False
        if run.evicted:
            raise RuntimeError(f"{run.name} is evicted; it is published once restored")
        if self.job.engines.weight_transfer == "disk":
            # The trainer snapshots the weights before its next train call and writes the folder beside
            # it (trainer/export_writer.py); the rollout worker waits for the write, the loop does not.
            folder = self._handoff_folder(run.name, registration_id, version)
            weights: AdapterWeights | PendingFolder = PendingFolder(
                folder, self.trainer.begin_export_peft(run.slot, folder, self._publish_dtype))
        else:
            weights = self._weights(run.slot)
        ref = self._need_rollout().publish_version(run.name, version, weights)
        self._publishing.append(_Publish(registration_id, run.name, version, ref, weights.folder if isinstance(weights, PendingFolder) else None))
        return True

    def settle_publishes(self) -> list[PublishOutcome]:
        """Publishes that finished since the last call (the loop records the served versions and
        republishes the failed ones whose run still has that version as its newest)."""
        if not self._publishing:
            return []
        finished = self.rollout.finished([p.ref for p in self._publishing])
        out = []
        for p in self._publishing:
            if p.ref not in finished:
                continue
            with self._lock:
                run = self._runs.get(p.registration_id)
            try:
                self.rollout.outcome(p.ref)
                if run is not None:
                    run.publish_failures = 0
                out.append(PublishOutcome(p.registration_id, p.name, p.version, None))
            except Exception as e:
                if p.folder is not None:  # never current anywhere: nothing reads it again
                    shutil.rmtree(p.folder, ignore_errors=True)
                newest = run is not None and run.is_rl and not run.evicted and run.weight_version == p.version
                if run is not None:
                    run.publish_failures += 1
                again = newest and run.publish_failures <= REPUBLISH_AT_MOST
                out.append(PublishOutcome(p.registration_id, p.name, p.version, f"{type(e).__name__}: {e}"[:500], republish=again))
        self._publishing = [p for p in self._publishing if p.ref not in finished]
        return out

    def publishes_in_flight(self) -> int:
        return len(self._publishing)

    def checkpoint(self, registration_id: str) -> str:
        """Write a complete checkpoint of the run at its current step; returns its folder."""
        return str(self._write_checkpoint(registration_id).folder)

    def _write_checkpoint(self, registration_id: str) -> Checkpoint:
        """Write a complete checkpoint of the run at its current step (its folder and RunState)."""
        run = self._run(registration_id)
        if run.evicted:
            raise RuntimeError(f"{run.name} is evicted (swapped out of its slot); it is checkpointed once restored")
        folder = run_dir(self.settings.state_dir, _RefLike(run.name, registration_id))
        cursor = self._cursor(run)
        with PendingCheckpoint(folder, run.step) as pending:
            self.trainer.save_slot_state(run.slot, pending.trainer_dir)
            self.trainer.export_peft(run.slot, pending.adapter_dir)
            state = RunState(
                name=run.name, registration_id=registration_id, objective=run.config.objective, rank=run.config.rank,
                samples_per_step=run.config.samples_per_step,
                step=run.step, samples_trained=run.samples_trained, weight_version=run.weight_version,
                data_cursor=cursor.model_dump(mode="json") if cursor is not None else None,
                rng={"data_shuffle_seed": run.config.seed, "slot_init_seed": run.config.seed},
                metrics={k: v for k, v in run.last_metrics.items() if math.isfinite(v)},
            )
            done = pending.commit(state)
        prune_checkpoints(folder, KEEP_CHECKPOINTS)
        return done

    def _cursor(self, run: _Run) -> DataCursor | None:
        if run.sft is not None:
            return run.sft.cursor()
        cursor: DataCursor = self._need_rollout().data_cursor(run.name)
        staged = [(g.prompt_index, g.epoch) for g in run.staged]  # popped (consumed) but not trained: I4
        return cursor.model_copy(update={"pending": staged + list(cursor.pending), "consumed": cursor.consumed - len(staged)})

    # --- faults --------------------------------------------------------------------------------------

    def check_engines(self) -> list[str]:
        """Restart every managed engine whose process died, or that stays out of routing on two
        checks in a row although alive: a connection error takes an engine out, and the rollout
        worker takes it back within about a second once it answers /health and its adapters are
        brought up to date (``EnginePool.readmit``); one still out after that is restarted. The rollout
        worker loads every adapter's current version on the restarted engine (republished).

        A restart is started, not waited for (issue 14 F6): the loop goes on training SFT runs
        and RL runs with groups already generated while the engine starts (tens of seconds);
        only generation waits for an engine, and a publish while none is in routing becomes
        current at once and is loaded when it comes back (EnginePool.publish). An engine with a
        restart in flight is not looked at again until that restart finished; a restart that
        failed is reported and the next check starts another. Returns what was done, including
        publishes that failed and restarts that ended since the last check."""
        if self.rollout is None:
            return []
        done = self._finished_restarts()
        for e in self.rollout.engine_health():
            if e.index in self._restarts:  # being restarted: its health says nothing yet
                continue
            unroutable = e.alive and not e.routable
            if unroutable and self._unroutable.get(e.index, 0) == 0:
                self._unroutable[e.index] = 1  # once may be a readmission in progress: look again next time
                continue
            self._unroutable.pop(e.index, None)
            if not e.alive or unroutable:
                why = "was dead" if not e.alive else "stayed out of routing after a connection error"
                with self._lock:
                    self._restarts[e.index] = _EngineRestart(self.rollout.begin_restart_engine(e.index), why, time.monotonic())
                done.append(f"engine {e.index} {why}: restarting it; training goes on, generation waits for an engine")
        return done

    def _finished_restarts(self) -> list[str]:
        """Engine restarts that ended since the last check (dropped from the ones in flight)."""
        with self._lock:
            restarts = dict(self._restarts)
        if not restarts:
            return []
        finished = self.rollout.finished([r.ref for r in restarts.values()])
        done = []
        for index, r in restarts.items():
            if r.ref not in finished:
                continue
            with self._lock:
                del self._restarts[index]
            took = time.monotonic() - r.started
            try:
                health = self.rollout.outcome(r.ref, f"rollout restart_engine({index})")
                done.append(f"engine {index} {r.why}: restarted ({health.url}) and republished; seen back {took:.1f} s after the restart began")
            except Exception as err:
                done.append(f"engine {index} {r.why}: its restart failed after {took:.1f} s ({type(err).__name__}: {err}); "
                            f"the next check tries again"[:1000])
        if any("restarted (" in d for d in done):  # the new processes replace the dead ones in the record of what to reap
            record_engines(self.settings.state_dir, [e.url for e in self.rollout.engine_health()])
        return done

    def restarting_engines(self) -> list[int]:
        """Engines with a restart in flight."""
        with self._lock:
            return sorted(self._restarts)

    def trainer_lost(self) -> bool:
        """Whether the trainer should run but a rank's process is gone (it died while nothing trained),
        or a restart failed halfway."""
        if not self.trainer.running:
            return self.trainer.stopped_reason == "restarting"
        return self.trainer.lost()

    def restart_trainer(self) -> list[str]:
        """Replace the dead trainer; every run is forgotten here and must be prepared again
        (the controller does that from each run's last checkpoint once its runtime is re-attached)."""
        with self._lock:
            lost = list(self._runs.values())
            self._runs.clear()
        for run in lost:
            if run.is_rl:
                try:
                    self._need_rollout().remove_adapter(run.name)
                except Exception:
                    log.exception("removing %s from the rollout worker", run.name)
        self._trainer_note = "restarting"
        self.trainer.restart()
        self._trainer_note = "running"
        return [r.registration_id for r in lost]

    def drain(self) -> dict[str, tuple[str, int]]:
        """Stop generating for every run and checkpoint each; registration id -> (checkpoint folder, step)."""
        out = {}
        for reg in self.runs():
            run = self._runs.get(reg)
            if run is None or run.evicted:  # evicted: resumes from its last checkpoint (I5)
                continue
            if run.is_rl:
                try:
                    self._need_rollout().abort_adapter(run.name, pause=True)
                except Exception:
                    log.exception("draining %s: abort", run.name)
            try:
                out[reg] = (self.checkpoint(reg), run.step)
            except Exception:  # one run's failure must not cost the others their checkpoint
                log.exception("draining %s: checkpoint failed; it resumes from its previous one", run.name)
        return out

    def shutdown(self) -> None:
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


@dataclass(frozen=True)
class _Publish:
    """A publish in flight (FleetRuntime.publish)."""

    registration_id: str
    name: str
    version: int
    ref: Any  # ObjectRef of the rollout worker's publish_version
    folder: str | None  # its handoff folder (weight_transfer 'disk')


@dataclass(frozen=True)
class _EngineRestart:
    """A restart of one engine in flight (FleetRuntime.check_engines)."""

    ref: Any  # ObjectRef of the rollout worker's restart_engine: EngineHealth, or its error
    why: str
    started: float  # time.monotonic()


@dataclass(frozen=True)
class _RefLike:
    """The two fields run_dir() reads."""

    name: str
    registration_id: str
