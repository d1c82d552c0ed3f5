"""The rollout worker as the coordinator uses it: `RolloutClient`, one typed method per remote method
of rollout/worker_actor.py's RolloutWorker (an async actor: each call is one coroutine on its loop).

Blocking methods wait through service/fleet/remote.py `call` with a timeout chosen per method
(tenant-facing reads are short); `start_engines`, `publish_version` and `begin_restart_engine`
return a handle on the call (a Ray ObjectRef; an engine moved off a lost node: a Future of the
coordinator's move, service/fleet/node_faults.py) so the caller can go on while the engines start, load
weights, restart or move (`finished` tells which are done without waiting, `outcome` gives the
result or raises).
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import ray

from rollout.data import DataCursor
from rollout.groups import RolloutGroup
from rollout.engines.weights import AdapterWeights
from rollout.messages import AdapterRollout, AdapterStats, EngineHealth
from service.fleet.remote import call, call_async

if TYPE_CHECKING:
    from service.fleet.node_faults import NodeFaults

DEFAULT_TIMEOUT_S = 120.0


class RolloutClient:
    def __init__(self, handle: Any, *, engine_restart_timeout_s: float = 600.0, node_faults: NodeFaults | None = None) -> None:
        """`node_faults`: where engines whose launcher was lost with its node are placed anew (None: restarts only)."""
        self.handle = handle
        self.engine_restart_timeout_s = engine_restart_timeout_s
        self.node_faults = node_faults

    def start_engines(self) -> Any:
        """Launch the engines and start generating; an ObjectRef of list[EngineHealth]."""
        return self.handle.start.remote()

    def add_adapter(self, spec: AdapterRollout, weights: AdapterWeights) -> AdapterStats:
        return call(self.handle.add_adapter.remote(spec, weights), 300.0, f"rollout add_adapter({spec.name})")

    def remove_adapter(self, name: str) -> int:
        return call(self.handle.remove_adapter.remote(name), DEFAULT_TIMEOUT_S, f"rollout remove_adapter({name})")

    def publish_version(self, name: str, version: int, weights: AdapterWeights) -> Any:
        """Hand new weights to the worker; an ObjectRef that resolves once every engine loaded them
        (the worker applies one adapter's publishes, and any later remove/abort of it, in order)."""
        return self.handle.publish_version.remote(name, version, weights)

    def abort_adapter(self, name: str, *, pause: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        return int(call(self.handle.abort_adapter.remote(name, pause), timeout_s, f"rollout abort_adapter({name})"))

    def pop_groups(self, name: str, max_groups: int) -> list[RolloutGroup]:
        return call(self.handle.pop_groups.remote(name, max_groups), DEFAULT_TIMEOUT_S, f"rollout pop_groups({name})")

    def data_cursor(self, name: str) -> DataCursor:
        return call(self.handle.data_cursor.remote(name), DEFAULT_TIMEOUT_S, f"rollout data_cursor({name})")

    def stats(self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> AdapterStats:
        return call(self.handle.stats.remote(name), timeout_s, f"rollout stats({name})")

    def all_stats(self, timeout_s: float = 5.0) -> dict[str, AdapterStats]:
        return call(self.handle.stats.remote(None), timeout_s, "rollout stats")

    def engine_health(self, timeout_s: float = 30.0) -> list[EngineHealth]:
        return call(self.handle.engine_health.remote(), timeout_s, "rollout engine_health")

    async def engine_health_async(self, timeout_s: float = 30.0) -> list[EngineHealth]:
        """`engine_health` awaited on the caller's event loop (the API's: it starts no thread)."""
        return await call_async(self.handle.engine_health.remote(), timeout_s, "rollout engine_health")

    def begin_restart_engine(self, index: int) -> Any:
        """Start restarting managed engine `index`; an ObjectRef of its EngineHealth once it is back
        and every adapter's current version is loaded on it. The caller does not wait: training goes
        on while an engine restarts (issue 14 F6). The restart gives up on its own after the engine's
        startup deadline (engines.startup_deadline_s), so the ref always finishes. An engine whose
        launcher is gone (its node was lost) is moved to a node with room instead (service/fleet/node_faults.py:
        a Future; NoPlacement raised here when none has been in service for placement.node_loss_wait_s)."""
        if self.node_faults is not None:
            return self.node_faults.begin_engine_restart(index, self.handle)
        return self.handle.restart_engine.remote(index)

    def restart_engine(self, index: int) -> EngineHealth:
        """Restart engine `index` and wait for it (tools and tests; the service uses begin_restart_engine)."""
        return call(self.begin_restart_engine(index), self.engine_restart_timeout_s, f"rollout restart_engine({index})")

    def processes(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """{"worker": pid, "engines": [pid or None per engine]} (GET /v1/fleet)."""
        return call(self.handle.processes.remote(), timeout_s, "rollout processes")

    def shutdown(self, timeout_s: float = 120.0) -> None:
        call(self.handle.shutdown.remote(), timeout_s, "rollout shutdown")

    @staticmethod
    def finished(refs: list[Any]) -> set[Any]:
        """Which of `refs` (publishes, engine restarts and moves) have finished, without waiting."""
        futures = {r for r in refs if isinstance(r, concurrent.futures.Future)}
        object_refs = [r for r in refs if r not in futures]
        done: set[Any] = {f for f in futures if f.done()}
        if object_refs:
            ready, _ = ray.wait(object_refs, num_returns=len(object_refs), timeout=0)
            done.update(ready)
        return done

    @staticmethod
    def outcome(ref: Any, what: str = "rollout publish_version") -> Any:
        """The result of a finished call (publish, engine restart or move), or raise its error."""
        if isinstance(ref, concurrent.futures.Future):
            return ref.result(timeout=0)
        return call(ref, 0.0, what)
