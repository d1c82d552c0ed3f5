"""Start and stop the whole service: `start_fleet(job, settings)` -> `Fleet`.

Everything that coordinates runs in THIS process (the one running `lorafleet serve` /
`lorafleet run`): the controller and its registry, the FleetRuntime, the training loop
(service/modes.py) and, when asked, the REST API (uvicorn in a thread). The only Ray
actors are the trainer ranks and the rollout worker (service/fleet/actors.py); the SGLang
engines are processes the rollout worker launches.

Order (each step waits for the one before, except engines and trainer, which
start side by side because both are slow):
  1. Ray: join the cluster named by RAY_ADDRESS or the job's ray.address, else start a private
     local one (service/fleet/ray_connect.py: never an accidental join of whatever runs on the host)
  2. leftover engines of a previous process that was killed are reaped (pid file)
  3. placement: plan (refused before anything starts if it cannot fit) and reserve
  4. the controller, over the registry in settings.state_dir
  4b. checks of the plan against the cluster: engines reachable from the coordinator's node, the
     state dir shared with the nodes that use it, the storage usable from every trainer node
     (service/fleet/cluster_checks.py; the storage was checked from this process before step 1)
  5. one engine launcher per engine (in its placement group), the rollout worker (on this node;
     it starts the engines through the launchers) and the trainer ranks (in the trainer placement
     groups): engines and trainer start concurrently
  6. the FleetRuntime over both once the trainer is up, attached to the controller, whose reconcile
     now prepares runs; the engines may still be starting (training is served at once, RL runs are
     prepared and samples served once they are up: FleetRuntime.engines_ready)
  7. the REST API, through the `start_api` the caller passes in (api/cli/main.py passes
     api.server.start_api_server; service/ never imports api/)
`Fleet.close()` undoes all of it, in reverse, and is safe to call twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from service.fleet.actors import start_rollout_worker, torch_compile_env
from service.fleet.cluster_checks import (check_engines_reachable, check_shared_state_dir, check_storage,
                                          check_storage_on_nodes, state_dir_users, storage_users)
from service.config.job import JobConfig
from service.config.settings import ServiceSettings, is_loopback_host
from service.control.controller import Controller
from service.fleet.engine_hosts import EngineHosts
from service.fleet.engine_pids import reap_engines_everywhere
from service.loop.fleet_stats import FleetStats
from service.fleet.ray_connect import connect_ray
from service.fleet.node_faults import NodeFaults
from service.fleet.placement import PlacementPlan, cluster_shape_from_ray, placement_group_specs, plan_placement, release_placement_groups, reserve_placement_groups
from service.fleet.rollout_client import RolloutClient
from service.fleet.fleet_runtime import FleetRuntime
from service.fleet.trainer_group import TrainerGroup, with_service_storage

log = logging.getLogger(__name__)

# (controller, settings, fleet_stats) -> a started server with .url and .stop(); api.server.start_api_server
ApiStarter = Callable[[Controller, ServiceSettings, FleetStats], Any]


@dataclass
class Fleet:
    job: JobConfig
    settings: ServiceSettings
    controller: Controller
    runtime: FleetRuntime
    rollout_handle: Any
    trainer: TrainerGroup
    plan: PlacementPlan | None = None  # what runs on which node (printed at start; GET /v1/fleet shows each process's node)
    engine_hosts: EngineHosts | None = None  # each engine's placement group and launcher
    node_faults: NodeFaults | None = None  # places a lost node's engines and trainer groups anew
    api: Any = None
    fleet_stats: FleetStats = field(default_factory=FleetStats)  # fed by the training loop, served by GET /v1/fleet/stats
    started_ray: bool = False
    startup_seconds: dict[str, float] = field(default_factory=dict)
    _closed: bool = False

    @property
    def ray_address(self) -> str:
        """The GCS address of the Ray cluster (operators attach with `ray.init(address=...)`)."""
        return ray.get_runtime_context().gcs_address

    @property
    def api_url(self) -> str | None:
        return self.api.url if self.api is not None else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for what, fn in (
            ("stop API", lambda: self.api is not None and self.api.stop()),
            ("detach runtime", self.controller.detach_runtime),
            ("runtime shutdown", self.runtime.shutdown),  # stops the engines and the trainer
            ("close registry", self.controller.close),
        ):
            try:
                fn()
            except Exception as e:
                log.warning("%s: %s: %s", what, type(e).__name__, e)
        _reap(self.settings.state_dir)
        try:
            ray.kill(self.rollout_handle)
        except Exception:
            pass
        if self.node_faults is not None:
            self.node_faults.close()
        if self.engine_hosts is not None:
            self.engine_hosts.close()
        self.trainer.stop()
        try:
            # the groups in use now (a lost node's may have been replaced: service/fleet/node_faults.py)
            release_placement_groups([g for g in self.trainer.placement_groups or [] if g is not None]
                                     + (self.engine_hosts.live_groups() if self.engine_hosts else []))
        except Exception as e:
            log.warning("releasing placement groups: %s", e)
        if self.started_ray:
            ray.shutdown()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_fleet(job: JobConfig, settings: ServiceSettings, *, start_api: ApiStarter | None = None) -> Fleet:
    """Start everything (module doc); with `start_api`, also the REST API over the controller."""
    times: dict[str, float] = {}
    t0 = time.monotonic()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    check_state_dir_free(settings)  # before anything starts: a second service would only fail later
    check_storage(settings)  # a wrong storage URL or credential fails now, not at the first checkpoint
    started_ray = _init_ray(job, settings)
    times["ray"] = time.monotonic() - t0
    _reap(settings.state_dir)
    groups: list[Any] = []
    rollout_handle: Any = None
    engine_hosts: EngineHosts | None = None
    controller: Controller | None = None
    trainer = TrainerGroup(job.trainer)
    try:
        gpu = job.placement.accelerator == "gpu"
        plan = plan_placement(job.placement, cluster_shape_from_ray())
        for line in plan.lines():
            log.info("placement: %s", line)
        here_ip = ray.util.get_node_ip_address()
        check_engines_reachable(plan, job.engines.host, here_ip)
        groups = reserve_placement_groups(plan, name_prefix="lorafleet")
        trainer_groups = groups[: job.placement.trainer.data_parallel]
        engine_groups = groups[job.placement.trainer.data_parallel :]
        labels = {plan.node_id(n): plan.cluster.node_label(n) for n in range(plan.cluster.nodes)} if plan.cluster else {}
        check_shared_state_dir(settings.state_dir, state_dir_users(plan, job.engines.weight_transfer, here_ip, settings.storage),
                               labels)
        check_storage_on_nodes(settings.storage_location, storage_users(plan, ray.get_runtime_context().get_node_id()), labels)
        controller = Controller(settings, job.capacity)
        specs = placement_group_specs(plan, name_prefix="lorafleet")
        trainer_specs, engine_specs = specs[: len(trainer_groups)], specs[len(trainer_groups) :]
        engine_hosts = EngineHosts(job, settings, engine_groups, [s.node_id for s in engine_specs])
        node_faults = NodeFaults(job, engine_specs, engine_hosts, trainer_specs)
        rollout_handle = start_rollout_worker(job, settings, engine_hosts.launchers)
        rollout = RolloutClient(rollout_handle, engine_restart_timeout_s=job.engines.startup_deadline_s + 60,
                                node_faults=node_faults)
        engines_started = rollout.start_engines()
        trainer = TrainerGroup(with_service_storage(job.trainer, settings.state_dir, settings.storage_location), trainer_groups, cpus_per_rank=job.placement.trainer.cpus_per_rank,
                               gpus_per_rank=1.0 if gpu else 0.0, placer=node_faults.ensure_trainer_groups)
        times["trainer"] = trainer.start()  # builds the model while the engines start
        # The engines go on starting in the background: training (SFT runs, Tinker calls) is served at
        # once; RL runs are prepared and sampling served once they are up (FleetRuntime.engines_ready).
        runtime = FleetRuntime(job, settings, trainer=trainer, rollout=rollout, engines_starting=engines_started)
        controller.attach_runtime(runtime)
        fleet = Fleet(job, settings, controller, runtime, rollout_handle, trainer, plan=plan,
                      engine_hosts=engine_hosts, node_faults=node_faults, started_ray=started_ray, startup_seconds=times)
    except BaseException:
        if rollout_handle is not None:  # the rollout worker stops its engines
            try:
                ray.get(rollout_handle.shutdown.remote(), timeout=60)
            except Exception:
                pass
            try:
                ray.kill(rollout_handle)
            except Exception:
                pass
        if engine_hosts is not None:
            engine_hosts.close()
        if controller is not None:
            controller.close()
        trainer.stop()
        _reap(settings.state_dir)
        if groups:
            try:
                release_placement_groups(groups)
            except Exception:
                pass
        if started_ray:
            ray.shutdown()
        raise
    if start_api is not None:
        try:
            fleet.api = start_api(controller, settings, fleet.fleet_stats)
        except BaseException:
            fleet.close()
            raise
    times["total"] = time.monotonic() - t0
    log.info("service started in %.1f s (%s)", times["total"], ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return fleet


def _reap(state_dir: Path) -> None:
    """Engines a killed service left on any node (service/fleet/engine_pids.py); never fails the caller."""
    try:
        reap_engines_everywhere(state_dir)
    except Exception as e:  # noqa: BLE001 - a cleanup: report, go on
        log.warning("reaping leftover engines: %s: %s", type(e).__name__, e)


class StateDirBusy(RuntimeError):
    """Another lorafleet service holds this state dir's registry."""


# The registry lock is released when the process that held it exits; a service killed
# a moment ago may still be exiting: wait that long before refusing.
STATE_DIR_WAIT_S = 30.0


def check_state_dir_free(settings: ServiceSettings) -> None:
    """Refuse early when another service holds the registry's lock (service/registry/registry.py I6)."""
    import fcntl

    lock_path = settings.db_path.with_name(settings.db_path.name + ".lock")
    deadline = time.monotonic() + STATE_DIR_WAIT_S
    with open(lock_path, "a+") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StateDirBusy(
                        f"state dir {settings.state_dir} is in use by another running lorafleet service (its registry "
                        f"is still locked after {STATE_DIR_WAIT_S:.0f} s); stop that service first, or give this one "
                        "another --state-dir"
                    ) from None
                time.sleep(0.2)
        fcntl.flock(f, fcntl.LOCK_UN)


def _init_ray(job: JobConfig, settings: ServiceSettings) -> bool:
    """Join the cluster RAY_ADDRESS or the job's ray.address names, else start a private local Ray
    (service/fleet/ray_connect.py). True if Ray was initialized here. A private local Ray under a service
    bound to loopback listens on 127.0.0.1 only (docs/operations.md, Ports)."""
    if ray.is_initialized():
        return False
    env = {"env_vars": torch_compile_env()}
    p = job.placement
    # Logical CPUs: what the placement groups reserve (the processes share the real cores).
    need = p.engines.count * p.engines.cpus + p.trainer.world_size * p.trainer.cpus_per_rank
    line = connect_ray(job.ray, local_cpus=max(int(need + 0.999), os.cpu_count() or 1),
                       loopback_service=is_loopback_host(settings.host), runtime_env=env)
    log.info("%s", line)
    return True
