"""Start and stop the whole service: `start_fleet(job, settings)` -> `Fleet`.

Order (each step waits for the one before, except engines and trainer, which
start side by side because both are slow):
  1. Ray: join the cluster named by RAY_ADDRESS, else start a local one
  2. leftover engines of a previous process that was killed are reaped (pid file)
  3. placement: plan (refused before anything starts if it cannot fit) and reserve
  4. controller actor (named), over the registry in settings.state_dir
  5. rollout worker (in the engine placement group; it launches the SGLang engines)
     and trainer ranks (in the trainer placement groups), concurrently
  6. runtime actor (named) over trainer, rollout worker and controller; attached
     to the controller, whose reconcile now prepares runs
  7. the REST API (service mode and, optionally, batch mode)
`Fleet.close()` undoes all of it, in reverse, and is safe to call twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.config import JobConfig, ServiceSettings
from service.controller_actor import DEFAULT_NAMESPACE, start_controller_actor
from service.placement import cluster_shape_from_ray, plan_placement, release_placement_groups, reserve_placement_groups
from service.runtime_actor import RemoteCalls, RuntimeProxy, start_runtime_actor
from service.trainer_group import TrainerGroup

log = logging.getLogger(__name__)

ENGINE_PIDS_FILE = "engines.json"


@dataclass
class Fleet:
    job: JobConfig
    settings: ServiceSettings
    namespace: str
    controller_handle: Any
    runtime_handle: Any
    rollout_handle: Any
    trainer: TrainerGroup
    placement_groups: list[Any]
    api: Any = None
    started_ray: bool = False
    startup_seconds: dict[str, float] = field(default_factory=dict)
    _closed: bool = False

    @property
    def controller(self) -> RemoteCalls:
        return RemoteCalls(self.controller_handle, timeout_s=self.settings.controller_timeout_s * 10)

    @property
    def runtime(self) -> RemoteCalls:
        return RemoteCalls(self.runtime_handle)

    @property
    def runtime_proxy(self) -> RuntimeProxy:
        return RuntimeProxy(self.runtime_handle)

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
        if self.api is not None:
            self.api.stop()
        for what, fn in (
            ("detach runtime", lambda: ray.get(self.controller_handle.detach_runtime.remote(), timeout=30)),
            ("runtime shutdown", lambda: ray.get(self.runtime_handle.shutdown.remote(), timeout=180)),
            ("close registry", lambda: ray.get(self.controller_handle.close.remote(), timeout=30)),
        ):
            try:
                fn()
            except Exception as e:
                log.warning("%s: %s: %s", what, type(e).__name__, e)
        reap_engines(self.settings.state_dir)
        for handle in (self.runtime_handle, self.rollout_handle, self.controller_handle):
            try:
                ray.kill(handle)
            except Exception:
                pass
        self.trainer.stop()
        try:
            release_placement_groups(self.placement_groups)
        except Exception as e:
            log.warning("releasing placement groups: %s", e)
        if self.started_ray:
            ray.shutdown()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_fleet(job: JobConfig, settings: ServiceSettings, *, serve_api: bool, namespace: str = DEFAULT_NAMESPACE) -> Fleet:
    from rollout.worker_actor import RolloutWorker

    times: dict[str, float] = {}
    t0 = time.monotonic()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    check_state_dir_free(settings)  # before anything starts: a second service would only fail later
    started_ray = _init_ray(job)
    times["ray"] = time.monotonic() - t0
    reap_engines(settings.state_dir)
    groups: list[Any] = []
    handles: list[Any] = []
    trainer = TrainerGroup(job.trainer)
    try:
        gpu = job.placement.accelerator == "gpu"
        plan = plan_placement(job.placement, cluster_shape_from_ray() if gpu else None)
        groups = reserve_placement_groups(plan, name_prefix=f"lorafleet-{namespace}")
        trainer_groups = groups[: job.placement.trainer.data_parallel]
        engine_groups = groups[job.placement.trainer.data_parallel :]
        controller = start_controller_actor(settings, job.capacity, namespace=namespace)
        handles.append(controller)
        # One rollout worker launches every engine; it sits in engine 0's placement group
        # (on GPU with several engines, each engine's devices must be visible to it).
        engine_log_dir = settings.state_dir / "engines"
        rollout = RolloutWorker.options(
            num_cpus=job.placement.engines.cpus,
            num_gpus=job.placement.engines.tensor_parallel if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=engine_groups[0], placement_group_bundle_index=0),
            max_restarts=0,
        ).remote(job.engines, job.rollout_config(settings), job.base_model.path, log_dir=str(engine_log_dir))
        handles.append(rollout)
        t1 = time.monotonic()
        engines_started = rollout.start.remote()
        runtime = start_runtime_actor(job, settings, trainer=None, rollout=rollout, controller=RemoteCalls(controller, timeout_s=60),
                                      namespace=namespace, wait=False)
        handles.append(runtime)
        trainer = TrainerGroup(job.trainer, trainer_groups, cpus_per_rank=job.placement.trainer.cpus_per_rank,
                               gpus_per_rank=1.0 if gpu else 0.0)
        times["trainer"] = trainer.start()  # builds the model while the engines start
        ray.get(runtime.set_trainer.remote(trainer), timeout=300)
        engines = ray.get(engines_started, timeout=job.engines.startup_deadline_s + 120)
        times["engines"] = time.monotonic() - t1
        record_engines(settings.state_dir, [e.url for e in engines])
        ray.get(controller.attach_runtime.remote(RuntimeProxy(runtime)), timeout=60)
        fleet = Fleet(job, settings, namespace, controller, runtime, rollout, trainer, groups, started_ray=started_ray,
                      startup_seconds=times)
    except BaseException:
        if len(handles) > 1:  # the rollout worker stops its engines
            try:
                ray.get(handles[1].shutdown.remote(), timeout=60)
            except Exception:
                pass
        for h in handles:
            try:
                ray.kill(h)
            except Exception:
                pass
        trainer.stop()
        reap_engines(settings.state_dir)
        if groups:
            try:
                release_placement_groups(groups)
            except Exception:
                pass
        if started_ray:
            ray.shutdown()
        raise
    if serve_api:
        try:
            fleet.api = start_api(controller, settings)
        except BaseException:
            fleet.close()
            raise
    times["total"] = time.monotonic() - t0
    log.info("service started in %.1f s (%s)", times["total"], ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return fleet


class StateDirBusy(RuntimeError):
    """Another lorafleet service holds this state dir's registry."""


# A service that was just killed releases the registry lock when its controller actor
# process exits, a few seconds after the driver: wait that long before refusing.
STATE_DIR_WAIT_S = 30.0


def check_state_dir_free(settings: ServiceSettings) -> None:
    """Refuse early when another service holds the registry's lock (service/registry.py I6)."""
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


def start_api(controller_handle: Any, settings: ServiceSettings) -> Any:
    from api.app import create_app
    from api.server import ApiServer

    server = ApiServer(create_app(controller_handle, settings), settings.host, settings.port,
                       token_configured=settings.api_token is not None)
    return server.start()


def _init_ray(job: JobConfig) -> bool:
    """Join RAY_ADDRESS if set (a cluster started by `ray start`), else start a local Ray. True if started here."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env, log_to_driver=False)
        return True
    p = job.placement
    # Logical CPUs: what the placement groups reserve (the processes share the real cores).
    need = p.engines.count * p.engines.cpus + p.trainer.world_size * p.trainer.cpus_per_rank
    ray.init(num_cpus=max(int(need + 0.999), os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             runtime_env=env)
    return True


# --- engines left behind by a killed process ---------------------------------------------------------
#
# SGLang servers run in their own session (so a stop reaches their children), which
# also means they outlive a service that was killed with SIGKILL. Their ports are
# recorded here at start; the next start (and close) kills what is still listening
# under the SGLang server's command line.


def record_engines(state_dir: Path, urls: list[str]) -> None:
    ports = [int(u.rsplit(":", 1)[1]) for u in urls if u]
    pids = [pid for pid in _sglang_server_pids() if _port_of(pid) in ports]
    (Path(state_dir) / ENGINE_PIDS_FILE).write_text(json.dumps({"ports": ports, "pids": pids}))


def reap_engines(state_dir: Path) -> list[int]:
    path = Path(state_dir) / ENGINE_PIDS_FILE
    if not path.is_file():
        return []
    try:
        recorded = json.loads(path.read_text())
    except ValueError:
        recorded = {}
    ports = set(recorded.get("ports", []))
    killed = []
    for pid in _sglang_server_pids():
        if pid in recorded.get("pids", []) or _port_of(pid) in ports:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.1)
    path.unlink(missing_ok=True)
    if killed:
        log.warning("killed %d SGLang server(s) left by a previous run: %s", len(killed), killed)
    return killed


def _sglang_server_pids() -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rollout.sglang_server" in argv or b"sglang.launch_server" in argv:
            out.append(int(entry.name))
    return out


def _port_of(pid: int) -> int | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for i, a in enumerate(argv[:-1]):
        if a == b"--port":
            try:
                return int(argv[i + 1])
            except ValueError:
                return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
