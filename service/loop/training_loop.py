"""The training loop: one short driver that shows the whole of it.

    while not stopping:
        4b. settle               publishes that finished: the registry's weight_version moves to what
                                 the engines now serve; a failed one is published again
        1a. place                the scheduler (service/scheduling/scheduler.py), the one owner of slots: admits
                                 Tinker models being created, evicts residents for waiting tenants by
                                 one policy (keep-warm, turns), binds free slots to waiters in order,
                                 swaps evicted tenants back in
        1b. reconcile            the controller moves runs along their lifecycle (prepare runs bound to a
                                 slot, finish and release retiring ones) through the runtime
        2.  gather               every resident tenant with work ready: a whole step of an RL or SFT run,
                                 a Tinker model's queued calls; waiting at most `max_wait_s` for the
                                 others once one is ready (a Tinker call only the scheduler's window)
        3.  round                ONE trainer call over all of it (a mixed step over the runs' samples and
                                 the models' datums, then the models' optimizer steps), settled per tenant
        4.  publish              the stepped RL runs' new weights (only theirs), under fresh versions;
                                 the trainer writes each to a handoff folder (weight_transfer 'disk'),
                                 the engines load them while the loop goes on (the next round)
        5.  commit               per stepped run, only now (the round succeeded): record_step
        6.  checkpoint           every `checkpoint_interval` steps of a run
        7.  retire               runs whose data or num_step is used up
    on stop: drain               stop generating, checkpoint every live run

Rollout never waits for this loop (the rollout worker keeps generating with the
newest published weights); the loop never waits for a slow tenant for longer
than the bound, nor for engines loading weights or restarting.

Guarantees while publishes overlap training (issue 18 item 4):
  G1 staleness: the rollout buffer counts a version as published when the publish reaches the
     worker, before the engines load it, so an adapter's next step never takes groups more than
     its max_staleness publishes behind the trainer's weights (rollout/worker.py publish_version);
  G2 a failed publish is reported and, if it was the run's newest version, published again
     under a fresh version (4b);
  G3 the registry's weight_version (what the API says the engines serve) moves only when a
     publish finished (record_step(served=False), then mark_served at 4b): it is never newer
     than what the engines serve. Faults handled here: a dead SGLang engine is restarted and its
adapters republished (runtime.check_engines); a dead trainer (found by a round, or by the
periodic check while nothing trains) is restarted and every live run is prepared again from
its last checkpoint (re-attaching the runtime makes the controller do that); a run whose steps
keep failing (non-finite loss, every reward failing), or that can never make a step (every row
over a length limit, the engines refusing its requests: runtime.fatal_runs), is marked FAILED
and the others go on.

The role objects, all in this (the coordinator) process:
  controller  service/control/controller.py    registry and lifecycle (1b, 5, 6, 7; weight versions)
  runtime     service/fleet/fleet_runtime.py  FleetRuntime: runs' side effects, checkpoints, drain; its parts:
     scheduler  service/scheduling/scheduler.py   slots and residency of every tenant, the round (1a, 2, 3)
     publisher  service/fleet/publishing.py  weights to the engines (4, 4b)
     health     service/fleet/health.py engine restarts, trainer liveness
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.errors import Conflict
from service.tenants.batches import TrainerLost
from service.errors import NoPlacement
from service.loop.fleet_stats import FleetStats, batch_token_counts
from service.shutdown import StopSignal
from service.loop.tb_log import TrainingLog

log = logging.getLogger(__name__)


class LoopOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_mode: bool = Field(False, description="Return once no live run is left (batch mode); else run until stopped.")
    max_wait_s: float = Field(1.0, gt=0, description="Once one adapter has a whole step, wait at most this long for the others.")
    engine_check_s: float = Field(5.0, gt=0, description="How often dead engines are looked for (seconds).")
    max_round_errors: int = Field(5, ge=1, description="Give up (raise) after this many rounds in a row that raised.")


@dataclass
class LoopReport:
    train_calls: int = 0
    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0  # inside mixed train calls
    collect_seconds: float = 0.0  # waiting for whole steps (rollout generating)
    publish_seconds: float = 0.0  # the loop's wait per publish: the trainer's export (handoff folder) and the hand-over
    checkpoint_seconds: float = 0.0
    wall_seconds: float = 0.0
    stopped_by: str | None = None  # None: batch mode ran out of runs
    events: list[str] = field(default_factory=list)


def run_training_loop(controller: Any, runtime: Any, opts: LoopOptions, stop: StopSignal,
                      on_round: Callable[[], None] | None = None, *, fleet_stats: FleetStats | None = None,
                      training_log: TrainingLog | None = None) -> LoopReport:
    """`controller`: service.control.controller.Controller; `runtime`: service.fleet.fleet_runtime.FleetRuntime.
    `fleet_stats` gets one record per round that trained dataset samples (the dashboard's
    throughput); `training_log` every committed step and round (TensorBoard)."""
    report = LoopReport()
    t_start = time.monotonic()
    next_engine_check = 0.0
    errors = 0  # consecutive rounds that raised
    while not stop.is_set():
        try:
            for p in runtime.settle_publishes():                                                # 4b (before a retiring run is finished)
                _settle(controller, runtime, p, report)
            _, unkept = runtime.place()                                                         # 1a
            for registration_id, reason in {**unkept, **runtime.fatal_runs()}.items():           # faults: a swap-out that failed,
                try:                                                                            # a run that can never step
                    controller.fail(registration_id, reason)
                except Conflict as e:  # no longer live (retired or deleted meanwhile)
                    log.info("fail %s: %s", registration_id, e)
            for change in controller.reconcile():                                               # 1b
                log.info("%s: %s -> %s%s", change.name, change.from_state, change.to_state, f" ({change.reason})" if change.reason else "")
            if opts.batch_mode and not controller.live_count():  # one count a round, no rows (per-round cost, issue 26)
                break
            if time.monotonic() >= next_engine_check:
                report.events += _logged(runtime.check_engines())                               # fault: dead engine, failed publish
                if runtime.trainer_lost():                                                      # fault: trainer died while idle
                    _restart_trainer(controller, runtime, report, "a trainer rank is gone")
                    continue
                next_engine_check = time.monotonic() + opts.engine_check_s
            t_round = time.monotonic()
            try:
                outcome = runtime.round(opts.max_wait_s, stop)                                  # 2, 3
            except TrainerLost as e:                                                            # fault: dead trainer
                _restart_trainer(controller, runtime, report, str(e))
                continue
            collect_s = time.monotonic() - t_round - outcome.seconds
            report.collect_seconds += collect_s
            if outcome.empty:
                for ref in runtime.exhausted_runs(controller.active_ids()):                     # 7 (a tail shorter than a step)
                    _retire(controller, ref)
                errors = 0
                continue
            report.train_calls += 1
            report.train_seconds += outcome.seconds
            round_publish_s = round_checkpoint_s = 0.0
            round_steps = round_samples = 0
            for s in outcome.stepped:
                version = controller.next_version()
                t_publish = time.monotonic()
                loading = runtime.publish(s.registration_id, version)                           # 4
                dt = time.monotonic() - t_publish
                report.publish_seconds += dt
                round_publish_s += dt
                try:
                    controller.record_step(s.registration_id, step=s.step, samples=s.samples, metrics=s.metrics,
                                           weight_version=version, served=not loading)          # 5
                except Conflict as e:  # failed meanwhile: its progress no longer counts
                    log.info("step of %s not recorded: %s", s.name, e)
                    continue
                if training_log is not None:
                    training_log.log_step(s.name, s.registration_id, s.step, s.metrics, samples=s.samples)
                report.steps += 1
                report.samples += s.samples
                round_steps += 1
                round_samples += s.samples
                if s.due_checkpoint:
                    t_ckpt = time.monotonic()
                    controller.record_checkpoint(s.registration_id, runtime.checkpoint(s.registration_id), s.step)  # 6
                    dt = time.monotonic() - t_ckpt
                    report.checkpoint_seconds += dt
                    round_checkpoint_s += dt
                if s.exhausted:
                    _retire(controller, (s.name, s.registration_id))                            # 7
            for registration_id, reason in outcome.failed.items():
                controller.fail(registration_id, reason)
            if fleet_stats is not None and outcome.samples:
                rollout_tokens, trained_tokens = batch_token_counts(outcome.samples)
                record = fleet_stats.record_round(collect_s=collect_s, train_s=outcome.seconds, publish_s=round_publish_s,
                                                  checkpoint_s=round_checkpoint_s, steps=round_steps, samples=round_samples,
                                                  rollout_tokens=rollout_tokens, trained_tokens=trained_tokens)
                if training_log is not None:
                    training_log.log_round(record)
            if on_round is not None:
                on_round()
            errors = 0
        except NoPlacement as e:  # multinode hook (service/fleet/node_faults.py): a lost node's groups found no room
            report.events += _logged([f"stopping: {e}"])
            stop.request(f"no room after a node was lost: {e}")  # drains below: every live run checkpointed
        except Exception as e:  # a round that failed (e.g. a worker call timed out): log, back off, retry
            errors += 1
            report.events += _logged([f"round failed ({errors} in a row): {type(e).__name__}: {e}"])
            if errors >= opts.max_round_errors:
                raise
            stop.wait(min(0.5 * 2**errors, 10.0))

    if stop.is_set():
        report.stopped_by = stop.reason
        try:  # versions the engines finished loading meanwhile (no republish: generation stops)
            for p in runtime.settle_publishes():
                if p.error is None:
                    controller.mark_served(p.registration_id, p.version)
        except Exception:
            log.exception("settling publishes at stop")
        for registration_id, (path, step) in runtime.drain().items():                           # drain
            try:
                controller.record_checkpoint(registration_id, path, step)
            except Conflict as e:
                log.info("drain checkpoint of %s not recorded: %s", registration_id, e)
    report.wall_seconds = time.monotonic() - t_start
    return report


def _settle(controller: Any, runtime: Any, p: Any, report: LoopReport) -> None:
    """A finished publish (service.tenants.batches.PublishOutcome): record the version the engines now
    serve, or republish a failed one under a fresh version (the run's weights as they are now)."""
    if p.error is None:
        controller.mark_served(p.registration_id, p.version)
        return
    report.events += _logged([f"publish of {p.name} v{p.version} failed: {p.error}" + ("; publishing it again" if p.republish else "")])
    if p.republish:  # its step is recorded already; the served version moves when this one settles
        runtime.publish(p.registration_id, controller.next_version())


def _restart_trainer(controller: Any, runtime: Any, report: LoopReport, why: str) -> None:
    report.events += _logged([f"{why}; restarting the trainer"])
    runtime.restart_trainer()
    controller.attach_runtime(runtime)  # the controller re-prepares every live run from its checkpoint


def _retire(controller: Any, run: tuple[str, str]) -> None:
    name, registration_id = run
    try:
        controller.retire(name, registration_id)
        log.info("%s used up its data or steps: retiring", name)
    except Conflict as e:  # already retiring (a tenant asked first)
        log.info("retire %s: %s", name, e)


def _logged(events: list[str]) -> list[str]:
    for e in events:
        log.warning("%s", e)
    return events
