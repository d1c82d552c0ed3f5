"""How the API calls the controller: `ControllerClient`, one async method per controller operation.

The controller (service/control/controller.py) is a plain object in the same process; its
blocking work (SQLite, runtime calls such as abort / ready) runs in a worker thread
so the event loop keeps serving, with a deadline (settings.controller_timeout_s).
Typed errors (NotFound, Conflict, ...) come back as themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from service.control.controller import Controller, MetricsSnapshot, RunMetrics
from service.registry.registry import AdapterRef
from service.control.runtime_protocol import ProcessInfo


class ControllerUnavailable(Exception):
    """The controller did not answer in time (HTTP 503)."""


class ControllerClient:
    def __init__(self, controller: Controller, timeout_s: float) -> None:
        self._controller = controller
        self._timeout_s = timeout_s

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wait_for(anyio.to_thread.run_sync(fn, *args), self._timeout_s)
        except TimeoutError:
            raise ControllerUnavailable(f"the controller did not answer {fn.__name__} within {self._timeout_s:g} s") from None

    # `tenant`: the caller's tenant, None for the admin (api/rest_auth.py); the controller filters by it.

    async def register(self, name: str, config: Any, tenant: str | None = None) -> AdapterRef:
        return await self._run(self._controller.register, name, config, tenant)

    async def list(self, state: Any = None, tenant: str | None = None) -> list[AdapterRef]:
        return await self._run(self._controller.list, state, tenant)

    async def list_page(self, query: Any, tenant: str | None = None) -> Any:
        return await self._run(self._controller.list_page, query, tenant)

    async def get(self, name: str, tenant: str | None = None) -> AdapterRef:
        return await self._run(self._controller.get, name, tenant)

    async def runs(self, name: str, tenant: str | None = None) -> list[AdapterRef]:
        return await self._run(self._controller.runs, name, tenant)

    async def get_run(self, registration_id: str, tenant: str | None = None) -> AdapterRef:
        return await self._run(self._controller.get_run, registration_id, tenant)

    async def metrics(self, name: str, tenant: str | None = None) -> RunMetrics:
        return await self._run(self._controller.metrics, name, tenant)

    async def run_metrics(self, registration_id: str, tenant: str | None = None) -> RunMetrics:
        return await self._run(self._controller.run_metrics, registration_id, tenant)

    async def retire(self, name: str, tenant: str | None = None) -> AdapterRef:
        return await self._run(self._controller.retire, name, None, tenant)

    async def abort(self, name: str, tenant: str | None = None) -> int:
        return await self._run(self._controller.abort, name, tenant)

    async def health(self) -> dict[str, Any]:
        return await self._run(self._controller.health)

    async def ready(self) -> dict[str, Any]:
        return await self._run(self._controller.ready)

    async def snapshot(self) -> MetricsSnapshot:
        return await self._run(self._controller.snapshot)

    async def processes(self) -> list[ProcessInfo]:
        return await self._run(self._controller.processes)
