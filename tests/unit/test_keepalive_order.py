"""Our HTTP clients' idle connections against the servers they talk to.

An idle connection must leave a client's pool before the server closes it: otherwise a request sent
after a pause as long as both timeouts goes out on a connection the server is closing and fails with
ReadError (CI's DPO recipe lost a step's reference log-probs so, with the engine client's expiry and
SGLang's keep-alive both at 5 s). Each pair is checked with a margin: the client's expiry at most half
the server's keep-alive."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn

from api.cli.client import LorafleetClient
from rollout.engines.client import KEEPALIVE_EXPIRY_S, EngineClient

pytestmark = pytest.mark.unit


def test_the_engine_client_drops_idle_connections_before_the_engine_server():
    from sglang.srt.environ import envs  # the engine server's keep-alive (uvicorn's timeout_keep_alive)

    server_keep_alive_s = envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()

    async def pool_expiry() -> float:
        client = EngineClient("http://127.0.0.1:9")
        try:
            return client._http._transport._pool._keepalive_expiry
        finally:
            await client.aclose()

    expiry = asyncio.run(pool_expiry())
    assert expiry == KEEPALIVE_EXPIRY_S
    assert expiry <= server_keep_alive_s / 2, (expiry, server_keep_alive_s)


def test_the_cli_client_drops_idle_connections_before_the_api_server():
    server_keep_alive_s = uvicorn.Config(app=None).timeout_keep_alive  # api/server.py and the front keep uvicorn's
    client = LorafleetClient("http://127.0.0.1:9")
    try:
        expiry = client._http._transport._pool._keepalive_expiry
    finally:
        client.close()
    assert expiry <= server_keep_alive_s / 2, (expiry, server_keep_alive_s)


def test_the_front_drops_idle_connections_before_the_coordinators_api():
    from api.front.read_front import FrontApp

    server_keep_alive_s = uvicorn.Config(app=None).timeout_keep_alive  # api/server.py keeps uvicorn's
    expiry = FrontApp("http://127.0.0.1:9", ttl_s=1.0, stale_s=0.0).app.idle_expiry_s
    assert 0 < expiry <= server_keep_alive_s / 2, (expiry, server_keep_alive_s)
