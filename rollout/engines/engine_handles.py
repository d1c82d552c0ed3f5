"""The engines a rollout worker manages, behind one async interface: `ManagedEngine`.

Two kinds, chosen by the rollout worker (rollout/worker_actor.py):
  * `LocalEngine`: an SGLang server process of this process (rollout/engines/engine.py EngineProcess):
    tests, and a worker that launches its engines itself;
  * `LauncherEngine`: a server started by an EngineLauncher actor (rollout/engines/engine_launcher.py) on
    the node of its reserved bundle: what the service runs, on one node or several.

Invariants:
  * `last` is the engine's state as last seen, never a guess: a launcher that cannot be reached
    (its process or node is gone) is reported not alive with `lost` set; one that is only slow to
    answer (busy starting) keeps its previous state;
  * `restart` raises EngineLost when the launcher is gone: only the coordinator can place a new one
    (service/fleet/node_faults.py), and it hands it over with the rollout worker's adopt_engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.engines.engine import EngineProcess
from rollout.engines.engine_launcher import EngineInfo

PROBE_TIMEOUT_S = 5.0


class EngineLost(RuntimeError):
    """The engine's launcher (and with it the engine) is gone; a new one must be placed."""


def local_node() -> tuple[str, str]:
    """This process's Ray node id and address ('' outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker the node is simply unknown
        pass
    return "", ""


class LocalEngine:
    """An EngineProcess of this process. `owned`: stopped at shutdown (an adopted one is not)."""

    def __init__(self, process: EngineProcess, *, owned: bool) -> None:
        self.process = process
        self.owned = owned
        self.index = process.index
        self.node_id, self.node_ip = local_node()
        self.lost = False

    @property
    def last(self) -> EngineInfo:
        p = self.process
        return EngineInfo(index=p.index, url=p.url if p.port is not None else "", pid=p.pid, alive=p.is_alive(),
                          starts=p.starts, node_id=self.node_id, node_ip=self.node_ip)

    async def start(self) -> EngineInfo:
        await asyncio.to_thread(self.process.start)
        await asyncio.to_thread(self.process.wait_ready)
        return self.last

    async def restart(self) -> EngineInfo:
        await asyncio.to_thread(self.process.restart)
        return self.last

    async def probe(self) -> EngineInfo:
        return self.last

    async def stop(self) -> None:
        if self.owned:
            await asyncio.to_thread(self.process.stop)


class LauncherEngine:
    """An engine started by an EngineLauncher actor (its handle)."""

    def __init__(self, index: int, launcher: Any) -> None:
        self.index = index
        self.launcher = launcher
        self.lost = False
        self._last = EngineInfo(index=index, url="", pid=None, alive=False, starts=0, node_id="", node_ip="")

    @property
    def last(self) -> EngineInfo:
        return self._last

    async def _ask(self, ref: Any, timeout_s: float | None) -> EngineInfo:
        from ray.exceptions import RayActorError

        try:
            info = await (asyncio.wait_for(ref, timeout_s) if timeout_s else ref)
        except RayActorError as e:  # ActorDiedError, ActorUnavailableError: the launcher's process or node is gone
            self.lost = True
            self._last = self._last.model_copy(update={"alive": False})
            raise EngineLost(f"engine {self.index}'s launcher on node {self._last.node_id[:12] or '?'} is gone: "
                             f"{type(e).__name__}") from e
        self._last = info
        return info

    async def start(self) -> EngineInfo:
        return await self._ask(self.launcher.start.remote(), None)

    async def restart(self) -> EngineInfo:
        if self.lost:
            raise EngineLost(f"engine {self.index}'s launcher is gone (its node was lost); a new one must be placed")
        return await self._ask(self.launcher.restart.remote(), None)

    async def probe(self) -> EngineInfo:
        """Refresh `last` (bounded); a launcher busy starting keeps its previous state."""
        if self.lost:
            return self._last
        try:
            return await self._ask(self.launcher.info.remote(), PROBE_TIMEOUT_S)
        except (TimeoutError, EngineLost):
            return self._last

    async def stop(self) -> None:
        if self.lost:
            return
        try:
            await asyncio.wait_for(self.launcher.stop.remote(), 60)
        except Exception:  # noqa: BLE001 - stopping what may already be gone
            pass


ManagedEngine = LocalEngine | LauncherEngine
