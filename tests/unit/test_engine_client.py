"""The engine client's connection pool against SGLang's server (rollout/engines/client.py).

An idle connection must leave the client's pool before the engine's server closes it: otherwise a
request sent after a pause as long as both timeouts goes out on a connection the server is closing and
fails with ReadError (CI's DPO recipe lost a step's reference log-probs so, with both at 5 s)."""

from __future__ import annotations

import asyncio

import pytest

from rollout.engines.client import KEEPALIVE_EXPIRY_S, EngineClient

pytestmark = pytest.mark.unit


def test_idle_connections_leave_the_pool_before_the_engine_closes_them():
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
    assert expiry <= server_keep_alive_s / 2, (expiry, server_keep_alive_s)  # a margin for a busy event loop
