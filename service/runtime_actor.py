"""The runtime as a named Ray actor (`lorafleet-runtime`) and the proxies that call it.

`FleetRuntime` (service/runtime_impl.py) holds the state of every prepared run;
it lives in this one actor so that the controller actor (reconcile) and the
training loop (driver) act on the same object. The actor is threaded
(max_concurrency > 1) so tenant calls (abort, ready, stats) are answered while
the loop waits on a train call; FleetRuntime guards its run table with a lock.

`RemoteCalls` turns an actor handle into plain blocking calls with a timeout
(`proxy.train(batch)` = `ray.get(handle.train.remote(batch), timeout=...)`), and
re-raises an actor-side exception as itself (Ray wraps it), so callers catch
`TrainerLost`, `Conflict`, ... as usual. `RuntimeProxy` is the Runtime protocol
over it, picklable, for `Controller.attach_runtime` inside the controller actor.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError

from service.config import JobConfig, ServiceSettings
from service.registry import AdapterRef
from service.runtime import ComponentHealth, Finished, Prepared, RuntimeStats

RUNTIME_ACTOR_NAME = "lorafleet-runtime"
RUNTIME_MAX_CONCURRENCY = 8
DEFAULT_CALL_TIMEOUT_S = 3600.0
# Per-method timeouts for calls that must stay quick (tenant-facing).
QUICK_CALLS = {"abort": 60.0, "ready": 15.0, "stats": 10.0}


class RemoteCalls:
    """Blocking calls on an actor: `RemoteCalls(handle).method(*args)`; actor errors come back unwrapped."""

    def __init__(self, handle: Any, timeout_s: float = DEFAULT_CALL_TIMEOUT_S, quick: dict[str, float] | None = None) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.quick = dict(quick or {})

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        remote = getattr(self.handle, method)
        timeout = self.quick.get(method, self.timeout_s)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return ray.get(remote.remote(*args, **kwargs), timeout=timeout)
            except RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, BaseException):
                    raise cause from None
                raise

        call.__name__ = method
        return call

    def __reduce__(self):
        return (RemoteCalls, (self.handle, self.timeout_s, self.quick))


class RuntimeProxy:
    """The Runtime protocol (service/runtime.py) over the runtime actor."""

    def __init__(self, handle: Any) -> None:
        self._calls = RemoteCalls(handle, quick=QUICK_CALLS)

    def prepare_adapter(self, ref: AdapterRef) -> Prepared:
        return self._calls.prepare_adapter(ref)

    def finish_adapter(self, ref: AdapterRef) -> Finished:
        return self._calls.finish_adapter(ref)

    def release_adapter(self, ref: AdapterRef) -> None:
        self._calls.release_adapter(ref)

    def abort(self, ref: AdapterRef) -> int:
        return self._calls.abort(ref)

    def ready(self) -> dict[str, ComponentHealth]:
        return self._calls.ready()

    def stats(self) -> RuntimeStats:
        return self._calls.stats()


def start_runtime_actor(job: JobConfig, settings: ServiceSettings, *, trainer: Any, rollout: Any, controller: Any,
                        namespace: str, wait: bool = True) -> Any:
    """Start the named runtime actor over trainer, rollout worker and controller (their handles;
    they may still be starting: the runtime calls them only when the loop or reconcile does)."""
    from service.runtime_impl import FleetRuntime

    handle = ray.remote(FleetRuntime).options(
        name=RUNTIME_ACTOR_NAME,
        namespace=namespace,
        num_cpus=0,  # coordination only: never holds a CPU the trainer or the engines need
        max_concurrency=RUNTIME_MAX_CONCURRENCY,
        max_restarts=0,
    ).remote(job, settings, trainer=trainer, rollout=rollout, controller=controller)
    if wait:
        ray.get(handle.runs.remote(), timeout=300)
    return handle
