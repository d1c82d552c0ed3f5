"""The RolloutWorker Ray actor: owns the SGLang engines, the engine pool and the rollout loop.

Create it with ``RolloutWorker.options(...).remote(engine_cfg, rollout_cfg, model_path)``
(the service does that in service/actors.py, with the placement of service/placement.py),
then ``await worker.start.remote()``; the service calls it through the typed
service/rollout_client.py. It is an async actor: all methods run on one asyncio
loop, so the rollout loop keeps going between calls and no call waits for
training.

Interface for the service (all async):
  start() -> list[EngineHealth]                    launch engines (or connect to engine_urls), start the loop
  add_adapter(spec: AdapterRollout, weights: AdapterWeights) -> AdapterStats
  remove_adapter(name) -> int                      requests aborted
  publish_version(name, version, weights) -> str   'loaded', or 'superseded' (never served: a newer version won)
  abort_adapter(name, pause=False) -> int          requests aborted; prompts re-queued
  resume_adapter(name) -> None
  pop_groups(name, max_groups) -> list[RolloutGroup]
  data_cursor(name) -> DataCursor
  stats(name=None) -> AdapterStats | dict[str, AdapterStats]
  engine_health() -> list[EngineHealth]
  restart_engine(index) -> EngineHealth            managed engines only
  processes() -> {"worker": pid, "engines": [pid]} process ids (the operator's GET /v1/fleet)
  shutdown() -> None                               abort everything, stop engines
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import ray

from rollout.client import EngineClient
from rollout.config import EngineConfig, RolloutConfig
from rollout.engine import EngineProcess
from rollout.pool import EnginePool
from rollout.weights import AdapterWeights, PendingFolder
from rollout.worker import AdapterRollout, AdapterStats, EngineHealth, RolloutCore, RolloutError

log = logging.getLogger(__name__)


class RolloutWorkerImpl:
    """The actor's body (usable without Ray, e.g. in tests: `await RolloutWorkerImpl(...).start()`)."""

    def __init__(self, engine_cfg: EngineConfig, rollout_cfg: RolloutConfig, model_path: str | Path,
                 engine_urls: list[str] | None = None, log_dir: str | None = None,
                 engines: list[EngineProcess] | None = None):
        """Engines, first match: `engines` (started EngineProcess objects to adopt: the worker
        watches and restarts them but does not stop them at shutdown), `engine_urls` (external
        servers: no restart), else the worker launches engine_cfg.num_engines servers itself."""
        if engines is not None and engine_urls is not None:
            raise RolloutError("give engines or engine_urls, not both")
        self.engine_cfg = engine_cfg
        self.rollout_cfg = rollout_cfg
        self.model_path = str(model_path)
        self.engine_urls = engine_urls
        self.log_dir = log_dir
        self.engines: list[EngineProcess] = list(engines or [])  # empty when connected to external engine_urls
        self._owns_engines = engines is None
        self.pool: EnginePool | None = None
        self.core: RolloutCore | None = None
        self._monitor: asyncio.Task | None = None

    def _client(self, url: str) -> EngineClient:
        c = self.engine_cfg
        return EngineClient(url, request_timeout_s=c.request_timeout_s, admin_timeout_s=c.admin_timeout_s,
                            max_connections=self.rollout_cfg.max_inflight_total + 16, tp_size=c.tp)

    async def start(self) -> list[EngineHealth]:
        from transformers import AutoTokenizer

        if self.engines:
            urls = [e.url for e in self.engines]
        elif self.engine_urls is None:
            self.engines = [EngineProcess(i, self.engine_cfg, self.model_path, log_dir=self.log_dir)
                            for i in range(self.engine_cfg.num_engines)]
            try:
                for e in self.engines:
                    await asyncio.to_thread(e.start)
                await asyncio.gather(*(asyncio.to_thread(e.wait_ready) for e in self.engines))
            except BaseException:
                for e in self.engines:
                    e.stop()
                raise
            urls = [e.url for e in self.engines]
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
        """Every second: mark a managed engine whose process died as unroutable at once (its
        requests fail and re-queue), and take back into routing an engine that a connection
        error took out but that answers /health again (``EnginePool.readmit``)."""
        while True:
            await asyncio.sleep(interval_s)
            for i in range(self.pool.num_engines):
                managed = self.engines[i] if self.engines else None
                if managed is not None and not managed.is_alive():
                    if self.pool.healthy(i):
                        self.pool.mark_unhealthy(i)
                    continue  # dead: the service restarts it (restart_engine)
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
                e = self.engines[i]
                alive, url, starts = e.is_alive(), e.url if e.port else "", e.starts
            else:
                url = self.engine_urls[i]
                alive, starts = await pool.client(i).health(), 1
            out.append(EngineHealth(index=i, url=url, alive=alive, routable=pool.healthy(i),
                                    inflight=pool.inflight_by_engine()[i], starts=starts))
        return out

    async def restart_engine(self, index: int) -> EngineHealth:
        """Restart a managed engine and load every adapter's current version on it."""
        if not self.engines:
            raise RolloutError("restart_engine needs engines this worker launched (it was given engine_urls)")
        if not 0 <= index < len(self.engines):
            raise RolloutError(f"no engine {index}; engines are 0..{len(self.engines) - 1}")
        self.pool.mark_unhealthy(index)
        e = self.engines[index]
        await asyncio.to_thread(e.restart)
        await self.pool.replace_engine(index, self._client(e.url))
        return (await self.engine_health())[index]

    async def processes(self) -> dict:
        """This worker's process id and each managed engine's (None: external or not running)."""
        return {"worker": os.getpid(), "engines": [e.pid for e in self.engines] if self.engines else [None] * len(self.engine_urls or [])}

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        if self.core is not None:
            await self.core.stop()
        if self.pool is not None:
            await self.pool.aclose()
        if self._owns_engines:
            for e in self.engines:
                await asyncio.to_thread(e.stop)


# The Ray actor. One per rollout node; resources come from service.placement.
RolloutWorker = ray.remote(RolloutWorkerImpl)
