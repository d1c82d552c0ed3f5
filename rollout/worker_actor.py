"""The RolloutWorker Ray actor: owns the SGLang engines, the engine pool and the rollout loop.

Create it with ``RolloutWorker.options(...).remote(engine_cfg, rollout_cfg, model_path, launchers=[...])``
(the service does that in service/fleet/actors.py: the worker on the coordinator's node, one
EngineLauncher per engine in that engine's placement group, rollout/engines/engine_launcher.py),
then ``await worker.start.remote()``; the service calls it through the typed
service/fleet/rollout_client.py. It is an async actor: all methods run on one asyncio
loop, so the rollout loop keeps going between calls and no call waits for
training. Engines on other nodes are reached over HTTP at the URL their launcher reports.

Interface for the service (all async):
  start() -> list[EngineHealth]                    start the engines (launchers, or its own, or connect to engine_urls), start the loop
  add_adapter(spec: AdapterRollout, weights: AdapterWeights) -> AdapterStats
  remove_adapter(name) -> int                      requests aborted
  publish_version(name, version, weights) -> str   'loaded', or 'superseded' (never served: a newer version won)
  abort_adapter(name, pause=False) -> int          requests aborted; prompts re-queued
  resume_adapter(name) -> None
  pop_groups(name, max_groups) -> list[RolloutGroup]
  data_cursor(name) -> DataCursor
  stats(name=None) -> AdapterStats | dict[str, AdapterStats]
  engine_health() -> list[EngineHealth]
  restart_engine(index) -> EngineHealth            managed engines only (EngineLost: its launcher is gone)
  adopt_engine(index, launcher) -> EngineHealth    a new launcher for engine `index` (placed elsewhere by the coordinator)
  processes() -> {"worker": pid, "node_id", "node_ip", "engines": [EngineInfo | None]} (GET /v1/fleet)
  shutdown() -> None                               abort everything, stop engines
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import ray

from rollout.engines.client import EngineClient
from rollout.config import EngineConfig, RolloutConfig
from rollout.engines.engine import EngineProcess
from rollout.engines.engine_handles import LauncherEngine, LocalEngine, ManagedEngine, local_node
from rollout.engines.engine_launcher import EngineInfo
from rollout.engines.pool import EnginePool
from rollout.engines.weights import AdapterWeights, PendingFolder
from rollout.messages import AdapterRollout, AdapterStats, EngineHealth, RolloutError
from rollout.worker import RolloutCore

log = logging.getLogger(__name__)


class RolloutWorkerImpl:
    """The actor's body (usable without Ray, e.g. in tests: `await RolloutWorkerImpl(...).start()`)."""

    def __init__(self, engine_cfg: EngineConfig, rollout_cfg: RolloutConfig, model_path: str | Path,
                 engine_urls: list[str] | None = None, log_dir: str | None = None,
                 engines: list[EngineProcess] | None = None, launchers: list | None = None):
        """Engines, first match: `launchers` (EngineLauncher actor handles, one per engine: the service),
        `engines` (started EngineProcess objects to adopt: the worker watches and restarts them but does
        not stop them at shutdown), `engine_urls` (external servers: no restart), else the worker launches
        engine_cfg.num_engines servers itself."""
        if sum(x is not None for x in (engines, engine_urls, launchers)) > 1:
            raise RolloutError("give at most one of launchers, engines and engine_urls")
        self.engine_cfg = engine_cfg
        self.rollout_cfg = rollout_cfg
        self.model_path = str(model_path)
        self.engine_urls = engine_urls
        self.log_dir = log_dir
        # Managed engines (empty when connected to external engine_urls), index = engine index.
        self.engines: list[ManagedEngine]
        if launchers is not None:
            self.engines = [LauncherEngine(i, h) for i, h in enumerate(launchers)]
        elif engines is not None:
            self.engines = [LocalEngine(e, owned=False) for e in engines]
        elif engine_urls is None:
            self.engines = [LocalEngine(EngineProcess(i, engine_cfg, self.model_path, log_dir=log_dir), owned=True)
                            for i in range(engine_cfg.num_engines)]
        else:
            self.engines = []
        self._start_engines = launchers is not None or (engines is None and engine_urls is None)
        self.pool: EnginePool | None = None
        self.core: RolloutCore | None = None
        self._monitor: asyncio.Task | None = None

    def _client(self, url: str) -> EngineClient:
        c = self.engine_cfg
        return EngineClient(url, request_timeout_s=c.request_timeout_s, admin_timeout_s=c.admin_timeout_s,
                            max_connections=self.rollout_cfg.max_inflight_total + 16, tp_size=c.tp)

    async def start(self) -> list[EngineHealth]:
        from transformers import AutoTokenizer

        if self._start_engines:
            results = await asyncio.gather(*(e.start() for e in self.engines), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                await asyncio.gather(*(e.stop() for e in self.engines), return_exceptions=True)
                raise errors[0]
            urls = [e.last.url for e in self.engines]
        elif self.engines:
            urls = [e.last.url for e in self.engines]
        else:
            urls = list(self.engine_urls)
        self.pool = EnginePool([self._client(u) for u in urls], weight_transfer=self.engine_cfg.weight_transfer)
        await self.pool.refresh_capabilities()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        self.core = RolloutCore(self.pool, tokenizer, self.rollout_cfg)
        await self.core.start()
        self._monitor = asyncio.get_running_loop().create_task(self._watch_engines())
        return await self.engine_health()

    async def _watch_engines(self, interval_s: float = 1.0) -> None:
        """Every second: mark a managed engine whose process died (or whose launcher is gone) as
        unroutable at once (its requests fail and re-queue), and take back into routing an engine
        that a connection error took out but that answers /health again (``EnginePool.readmit``)."""
        while True:
            await asyncio.sleep(interval_s)
            if self.engines:
                await asyncio.gather(*(e.probe() for e in self.engines), return_exceptions=True)
            for i in range(self.pool.num_engines):
                managed = self.engines[i] if self.engines else None
                if managed is not None and not managed.last.alive:
                    if self.pool.healthy(i):
                        self.pool.mark_unhealthy(i)
                    continue  # dead: the service restarts it (restart_engine) or places a new one (adopt_engine)
                if not self.pool.healthy(i):
                    try:
                        await self.pool.readmit(i)
                    except Exception as err:  # noqa: BLE001 - the watcher must outlive any one probe
                        log.warning("engine %d: re-admission failed: %s", i, err)

    def _need(self) -> RolloutCore:
        if self.core is None:
            raise RolloutError("the rollout worker is not started: call start() first")
        return self.core

    async def add_adapter(self, spec: AdapterRollout, weights: AdapterWeights) -> AdapterStats:
        return await self._need().add_adapter(spec, weights)

    async def remove_adapter(self, name: str) -> int:
        return await self._need().remove_adapter(name)

    async def publish_version(self, name: str, version: int, weights: AdapterWeights | PendingFolder) -> str:
        return await self._need().publish_version(name, version, weights)

    async def abort_adapter(self, name: str, pause: bool = False) -> int:
        return await self._need().abort_adapter(name, pause=pause)

    async def resume_adapter(self, name: str) -> None:
        self._need().resume_adapter(name)

    async def pop_groups(self, name: str, max_groups: int):
        return self._need().pop_groups(name, max_groups)

    async def data_cursor(self, name: str):
        return self._need().data_cursor(name)

    async def stats(self, name: str | None = None):
        core = self._need()
        if name is not None:
            return core.stats(name)
        return {n: core.stats(n) for n in core.adapters()}

    async def engine_health(self) -> list[EngineHealth]:
        pool = self.pool
        out = []
        for i in range(pool.num_engines):
            if self.engines:
                info = self.engines[i].last
                alive, url, starts, pid, node_id, node_ip = info.alive, info.url, info.starts, info.pid, info.node_id, info.node_ip
            else:
                url = self.engine_urls[i]
                alive, starts, pid, node_id, node_ip = await pool.client(i).health(), 1, None, "", ""
            out.append(EngineHealth(index=i, url=url, alive=alive, routable=pool.healthy(i),
                                    inflight=pool.inflight_by_engine()[i], starts=starts, pid=pid, node_id=node_id,
                                    node_ip=node_ip))
        return out

    def _managed(self, index: int) -> ManagedEngine:
        if not self.engines:
            raise RolloutError("restarting an engine needs engines this worker manages (it was given engine_urls)")
        if not 0 <= index < len(self.engines):
            raise RolloutError(f"no engine {index}; engines are 0..{len(self.engines) - 1}")
        return self.engines[index]

    async def restart_engine(self, index: int) -> EngineHealth:
        """Restart a managed engine and load every adapter's current version on it. Raises EngineLost
        (rollout/engines/engine_handles.py) when its launcher is gone: the coordinator places a new one."""
        e = self._managed(index)
        self.pool.mark_unhealthy(index)
        info = await e.restart()
        await self.pool.replace_engine(index, self._client(info.url))
        return (await self.engine_health())[index]

    async def adopt_engine(self, index: int, launcher) -> EngineHealth:
        """Engine `index` from now on runs under `launcher` (an EngineLauncher the coordinator placed on
        a node with room, after the old one was lost with its node): start it, load every adapter's
        current version on it (republished), route to it."""
        old = self._managed(index)
        self.pool.mark_unhealthy(index)
        new = LauncherEngine(index, launcher)
        info = await new.start()
        self.engines[index] = new
        if not old.lost:
            await old.stop()
        await self.pool.replace_engine(index, self._client(info.url))
        return (await self.engine_health())[index]

    async def processes(self) -> dict:
        """This worker's process id and node, and each managed engine's EngineInfo (None: external)."""
        node_id, node_ip = local_node()
        engines: list[EngineInfo | None] = ([e.last for e in self.engines] if self.engines
                                            else [None] * len(self.engine_urls or []))
        return {"worker": os.getpid(), "node_id": node_id, "node_ip": node_ip, "engines": engines}

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        if self.core is not None:
            await self.core.stop()
        if self.pool is not None:
            await self.pool.aclose()
        await asyncio.gather(*(e.stop() for e in self.engines), return_exceptions=True)


# The Ray actor: one, on the coordinator's node (service/fleet/actors.py); its engines run under launchers.
RolloutWorker = ray.remote(RolloutWorkerImpl)
