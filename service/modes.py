"""The two ways to run the service: batch mode (`run_batch`) and service mode (`run_service`).

Both start the whole fleet (service/fleet/startup.py), register the job file's
adapters, and run the training loop (service/loop/training_loop.py) under a StopSignal, so
Ctrl-C / SIGTERM drain (every live run checkpointed) before the process exits.

Registering a job's adapters after a restart over the same state dir:
  * a name with a live run in the registry is NOT registered again: that run
    continues from its last checkpoint (the controller prepares it from there);
  * with `resume=True` a name whose newest run COMPLETED is skipped too, so a
    batch job killed midway finishes only what was left;
  * otherwise the name gets a new run.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from service.fleet.startup import ApiStarter, Fleet, start_fleet
from service.config.job import JobConfig
from service.config.settings import ServiceSettings
from service.errors import LorafleetError, NotFound
from service.loop.training_loop import LoopOptions, LoopReport, run_training_loop
from service.loop.progress import AdapterSummary, ProgressView, summarize, summary_lines, summary_table
from service.registry.registry import AdapterState
from service.shutdown import StopSignal
from service.loop.tb_log import TrainingLog, tensorboard_dir

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
# Written by service mode once it serves (removed on exit): where to reach it.
SERVICE_INFO_FILE = "service.json"


@dataclass
class BatchResult:
    exit_code: int
    summaries: list[AdapterSummary]
    loop: LoopReport
    startup_seconds: dict[str, float]


def precheck_job_adapters(job: JobConfig, settings: ServiceSettings) -> None:
    """The registration checks of every job adapter, before anything starts (BadValue names
    the adapter and the field), so a bad job file fails in a second, not after start-up."""
    from service.control.config_checks import check_adapter_config
    from service.errors import BadValue

    for spec in job.adapters:
        try:
            check_adapter_config(spec.config, settings, job.capacity)
        except BadValue as e:
            raise BadValue(f"adapter {spec.name!r} of the job: {e}", field=e.field) from None


def register_job_adapters(controller: Any, job: JobConfig, *, resume: bool) -> list[str]:
    """Register the job's adapters as the module doc says; returns what was done, one line each."""
    done = []
    for spec in job.adapters:
        try:
            ref = controller.get(spec.name)
        except NotFound:
            ref = None
        if ref is not None and ref.live:
            done.append(f"{spec.name}: continues its live run (state {ref.state}, step {ref.step})")
            continue
        if ref is not None and resume and ref.state == AdapterState.COMPLETED:
            done.append(f"{spec.name}: already COMPLETED (resume)")
            continue
        new = controller.register(spec.name, spec.config)
        where = f"slot {new.slot}" if new.slot is not None else f"the queue at #{new.queue_position}"
        done.append(f"{spec.name}: registered in {where} (registration {new.registration_id[:8]})")
    return done


class _ProgressPoller:
    """Feeds the progress view from the registry twice a second, in a thread of its own."""

    def __init__(self, controller: Any, view: ProgressView, interval_s: float = 0.5) -> None:
        self.controller, self.view, self.interval_s = controller, view, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorafleet-progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.view.update(self.controller.list())
            except Exception:
                log.debug("progress poll failed", exc_info=True)

    def __enter__(self) -> _ProgressPoller:
        if self.view.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
            try:
                self.view.update(self.controller.list())  # the final states, not the last poll's
            except Exception:
                log.debug("final progress update failed", exc_info=True)


@contextmanager
def _running(job: JobConfig, settings: ServiceSettings, *, start_api: ApiStarter | None, resume: bool) -> Iterator[tuple[Fleet, StopSignal]]:
    """The fleet started with the job's adapters registered, under a StopSignal; closed on exit."""
    precheck_job_adapters(job, settings)
    with StopSignal() as stop:
        fleet = start_fleet(job, settings, start_api=start_api)
        stop.install()  # Ray replaced the SIGTERM handler
        try:
            for line in register_job_adapters(fleet.controller, job, resume=resume):
                log.info("%s", line)
            freeze_startup_objects()
            yield fleet, stop
        finally:
            fleet.close()


def freeze_startup_objects() -> None:
    """What the process holds once it is up (its imports, the fleet's handles: about a million objects
    with torch and Ray loaded), collected once and then left out of every later collection
    (gc.freeze): a full pass of Python's cyclic collector walks every tracked object, about 0.5 s of
    CPU for a million, and these live as long as the process (docs/design.md, "Long-lived objects").
    Later objects (tenants, their calls) are collected as before. The trainer rank does the same once
    its model is built (trainer/actor.py TrainWorker.setup), the API front once it is up."""
    gc.collect()
    gc.freeze()


def run_batch(job: JobConfig, settings: ServiceSettings, *, resume: bool = False, console: Console | None = None,
              loop_options: LoopOptions | None = None, start_api: ApiStarter | None = None) -> BatchResult:
    """Batch mode; with `start_api` (api.server.start_api_server) the REST API serves beside it."""
    console = console or Console(stderr=True)
    opts = loop_options or LoopOptions(batch_mode=True)
    with _running(job, settings, start_api=start_api, resume=resume) as (fleet, stop):
        console.print(f"lorafleet: started in {fleet.startup_seconds.get('total', 0.0):.0f} s; training "
                      f"{len(job.adapters)} adapter(s), state in {settings.state_dir}", highlight=False, soft_wrap=True)
        _print_plan(console, fleet)
        if fleet.api_url:
            console.print(f"dashboard: {fleet.api_url}/ui (REST API {fleet.api_url})", highlight=False, soft_wrap=True)
        with ProgressView(console, title=f"lorafleet run ({len(job.adapters)} adapters)") as view, \
                _ProgressPoller(fleet.controller, view), TrainingLog(settings.state_dir) as training_log:
            report = run_training_loop(fleet.controller, fleet.runtime, opts, stop,
                                       fleet_stats=fleet.fleet_stats, training_log=training_log)
        console.print(f"TensorBoard logs: {tensorboard_dir(settings.state_dir)}", highlight=False, soft_wrap=True)
        summaries = job_summaries(fleet, job)
    if report.stopped_by is not None:
        code = EXIT_INTERRUPTED
    elif any(s.state != AdapterState.COMPLETED for s in summaries):
        code = EXIT_FAILED
    else:
        code = EXIT_OK
    return BatchResult(code, summaries, report, fleet.startup_seconds)


def _print_plan(console: Console, fleet: Fleet) -> None:
    """The placement the planner chose, one line per group (service/fleet/placement.py PlacementPlan.lines)."""
    for line in fleet.plan.lines() if fleet.plan is not None else []:
        console.print(f"placement: {line}", highlight=False, soft_wrap=True)


def job_summaries(fleet: Fleet, job: JobConfig) -> list[AdapterSummary]:
    out = []
    for spec in job.adapters:
        try:
            ref = fleet.controller.get(spec.name)
            steps = fleet.controller.metrics(spec.name).steps
        except LorafleetError:
            continue
        out.append(summarize(ref, steps))
    return out


def print_summary(console: Console, result: BatchResult) -> None:
    console.print(summary_table(result.summaries))
    for line in summary_lines(result.summaries):
        console.print(line, highlight=False, soft_wrap=True)
    loop = result.loop
    per_min = 60.0 * loop.steps / loop.wall_seconds if loop.wall_seconds > 0 else 0.0
    start = result.startup_seconds
    console.print(
        f"{loop.steps} adapter steps in {loop.train_calls} mixed train calls, {loop.samples} samples; "
        f"training loop {loop.wall_seconds:.1f} s = {per_min:.1f} adapter steps/min (train calls {loop.train_seconds:.1f} s, "
        f"waiting for rollouts {loop.collect_seconds:.1f} s, weight publishes {loop.publish_seconds:.1f} s, "
        f"checkpoints {loop.checkpoint_seconds:.1f} s); start-up {start.get('total', 0.0):.1f} s "
        f"(engines {start.get('engines', 0.0):.1f} s, trainer {start.get('trainer', 0.0):.1f} s, Ray {start.get('ray', 0.0):.1f} s)",
        highlight=False, soft_wrap=True,
    )
    if loop.stopped_by:
        console.print(f"stopped: {loop.stopped_by}; every live adapter was checkpointed (run again with --resume to finish)",
                      highlight=False)


def run_service(job: JobConfig, settings: ServiceSettings, *, start_api: ApiStarter, console: Console | None = None,
                loop_options: LoopOptions | None = None) -> LoopReport:
    """Service mode: the fleet plus the REST API (started by `start_api`: api.server.start_api_server),
    training whatever is registered, until stopped. The job's adapters are registered unless they
    already COMPLETED (a restart does not redo them)."""
    console = console or Console(stderr=True)
    opts = loop_options or LoopOptions(batch_mode=False)
    with _running(job, settings, start_api=start_api, resume=True) as (fleet, stop):
        console.print(f"lorafleet serving on {fleet.api_url} (state {settings.state_dir}, Ray {fleet.ray_address}); "
                      "Ctrl-C drains and stops", highlight=False, soft_wrap=True)
        _print_plan(console, fleet)
        info = settings.state_dir / SERVICE_INFO_FILE
        partial = info.with_suffix(".json.partial")  # written whole, then renamed: a reader never sees it half-written
        partial.write_text(json.dumps({"api_url": fleet.api_url, "ray_address": fleet.ray_address, "pid": os.getpid()}))
        os.replace(partial, info)
        console.print(f"dashboard: {fleet.api_url}/ui · TensorBoard logs: {tensorboard_dir(settings.state_dir)}",
                      highlight=False, soft_wrap=True)
        try:
            with TrainingLog(settings.state_dir) as training_log:
                return run_training_loop(fleet.controller, fleet.runtime, opts, stop,
                                         fleet_stats=fleet.fleet_stats, training_log=training_log)
        finally:
            info.unlink(missing_ok=True)
