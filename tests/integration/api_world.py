"""Shared set-up of the API integration tests (test_api_*.py): data roots on disk,
settings, and the real app served by uvicorn on a free loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from api.server import ApiServer
from service.config.job import SlotCapacity
from service.config.settings import ServiceSettings, load_settings

TOKEN = "test-token-5f1c"
MAX_BODY = 8192
CAPACITY = SlotCapacity(num_slots=2, max_rank=16, max_live_runs=3)  # 2 slots, then 1 queued, then 409


@dataclass
class World:
    root: Path  # the one allowed data root
    outside: Path  # a folder outside it
    settings: ServiceSettings

    def rl_config(self, path: str | None = None, **over: Any) -> dict[str, Any]:
        return {"data": {"path": path or str(self.root / "rl.jsonl")}, "reward": {"name": "target_share"}, **over}


def make_world(tmp: Path, **settings: Any) -> World:
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    rows = "".join(f'{{"prompt": "say digits {i}", "label": "0123456789"}}\n' for i in range(12))
    (root / "rl.jsonl").write_text(rows)
    (outside / "secret.jsonl").write_text(rows)
    (root / "escape.jsonl").symlink_to(outside / "secret.jsonl")
    s = load_settings(
        **{"state_dir": tmp / "state", "data_roots": [root], "api_token": TOKEN, "max_body_bytes": MAX_BODY, **settings}
    )
    return World(root, outside, s)


@contextlib.contextmanager
def serve(controller: Any, settings: ServiceSettings, tenant_keys: Any = None) -> Iterator[ApiServer]:
    """The real app on a free loopback port (with `tenant_keys`: tenants on the REST API); stopped even
    when the test fails."""
    app = create_app(controller, settings, tenant_keys=tenant_keys)
    server = ApiServer(app, "127.0.0.1", 0, token_configured=settings.api_token is not None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def served_world(tmp: Path) -> Iterator[tuple[World, ApiServer]]:
    """A fresh world and a Controller (no runtime) behind the real app on loopback;
    server stopped and registry closed even when the test fails."""
    from service.control.controller import Controller

    world = make_world(tmp)
    controller = Controller(world.settings, CAPACITY)
    try:
        with serve(controller, world.settings) as server:
            yield world, server
    finally:
        controller.close()


def client(url: str, token: str | None = TOKEN) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=10.0)
