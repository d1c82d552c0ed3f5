"""The EngineLauncher Ray actor: one SGLang engine, started on the node of its reserved bundle.

The service places one launcher per engine in that engine's placement group (service/fleet/actors.py
`start_engine_launchers`, planned by service/fleet/placement.py): Ray gives the launcher the bundle's
GPUs (CUDA_VISIBLE_DEVICES), and the SGLang server it starts inherits them, so every engine runs
on its own GPUs on the node the planner chose. The rollout worker (rollout/worker_actor.py) routes
requests to the engine's URL and asks its launcher to restart it; the coordinator creates a new
launcher elsewhere when a launcher is lost with its node.

Invariants:
  * every start, restart and stop of the server runs on ONE thread that lives as long as this
    process (`_spawner`), and the server is started with die_with_parent (rollout/engines/engine.py): the
    engine dies with its launcher, so a launcher lost with its raylet leaves no engine behind;
  * `info()` answers at any time, also while a start or restart is under way (the actor has a
    thread for it), from fields the spawner thread sets.

`engines.host: node` binds the server to this node's address as Ray knows it (reachable from a
rollout worker on another node); any other value is used as given.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import ray
from pydantic import BaseModel, ConfigDict

from rollout.config import EngineConfig
from rollout.engines.engine import EngineProcess

NODE_HOST = "node"  # engines.host value: bind to this node's Ray address


class EngineInfo(BaseModel):
    """What a launcher reports about its engine."""

    model_config = ConfigDict(frozen=True)

    index: int
    url: str  # "" while not started
    pid: int | None
    alive: bool  # the server process runs
    starts: int
    node_id: str
    node_ip: str


class EngineLauncherImpl:
    """The actor's body (see the module docstring)."""

    def __init__(self, index: int, cfg: EngineConfig, model_path: str | Path, log_dir: str | None = None):
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        if cfg.host == NODE_HOST:
            cfg = cfg.model_copy(update={"host": self.node_ip})
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)  # on this node (the state dir may not be shared)
        self.engine = EngineProcess(index, cfg, model_path, log_dir=log_dir, die_with_parent=True)
        # One thread for the server's whole life (module invariant): PR_SET_PDEATHSIG fires when the
        # thread that forked ends, and a pool thread ends only when this process does.
        self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-spawner")

    def _on_spawner(self, fn, *args):
        return self._spawner.submit(fn, *args).result()

    def start(self) -> EngineInfo:
        """Start the server and wait until it generates (EngineStartError with its log's tail otherwise)."""
        self._on_spawner(self._start_and_wait)
        return self.info()

    def _start_and_wait(self) -> None:
        self.engine.start()
        self.engine.wait_ready()

    def restart(self) -> EngineInfo:
        """Stop the server (if it runs), start it again, wait until ready."""
        self._on_spawner(self.engine.restart)
        return self.info()

    def stop(self) -> None:
        self._on_spawner(self.engine.stop)

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(index=e.index, url=e.url if e.port is not None else "", pid=e.pid, alive=e.is_alive(),
                          starts=e.starts, node_id=self.node_id, node_ip=self.node_ip)

    def launcher_pid(self) -> int:
        return os.getpid()


# A threaded actor: info() runs beside a start or restart (the spawner thread serializes those).
EngineLauncher = ray.remote(max_concurrency=4)(EngineLauncherImpl)
