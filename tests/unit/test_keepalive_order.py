"""Our HTTP clients' idle connections against the servers they talk to.

An idle connection must leave a client's pool before the server closes it: otherwise a request sent
after a pause as long as both timeouts goes out on a connection the server is closing and fails with
ReadError (CI's DPO recipe lost a step's reference log-probs so, with the engine client's expiry and
SGLang's keep-alive both at 5 s). The two clocks start apart (the server's when it sent the answer,
the client's when its busy loop read it: about 3 s later once in a full test run, so a 2 s expiry
against SGLang's 5 s still failed), so each pair we own both ends of is checked with a margin of at
least 30 s; the front, a client of the coordinator's API, likewise."""

from __future__ import annotations

import asyncio

import pytest

from api.cli.client import LorafleetClient
from api.server import ApiServer
from rollout.config import EngineConfig
from rollout.engines.client import KEEPALIVE_EXPIRY_S, EngineClient
from rollout.engines.sglang_cpu import build_server_launch

MARGIN_S = 30.0  # the longest a client's loop may read an answer late without reusing a closing connection

pytestmark = pytest.mark.unit


def _api_keep_alive_s() -> float:
    """The coordinator's API server's keep-alive, read from the uvicorn config ApiServer builds."""
    return ApiServer(app=None)._server.config.timeout_keep_alive


def test_the_engine_client_drops_idle_connections_long_before_the_engine_server(monkeypatch):
    from sglang.srt.environ import envs  # the engine server's keep-alive (uvicorn's timeout_keep_alive)

    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE", raising=False)
    launch = build_server_launch(EngineConfig(), "some/model", 1234, device="cuda")  # the launcher's env, either device
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", launch.env["SGLANG_TIMEOUT_KEEP_ALIVE"])
    server_keep_alive_s = envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()  # as the server process reads it

    async def pool_expiry() -> float:
        client = EngineClient("http://127.0.0.1:9")
        try:
            return client._http._transport._pool._keepalive_expiry
        finally:
            await client.aclose()

    expiry = asyncio.run(pool_expiry())
    assert expiry == KEEPALIVE_EXPIRY_S
    assert expiry + MARGIN_S <= server_keep_alive_s, (expiry, server_keep_alive_s)


def test_the_cli_client_drops_idle_connections_long_before_the_api_server():
    server_keep_alive_s = _api_keep_alive_s()
    client = LorafleetClient("http://127.0.0.1:9")
    try:
        expiry = client._http._transport._pool._keepalive_expiry
    finally:
        client.close()
    assert expiry + MARGIN_S <= server_keep_alive_s, (expiry, server_keep_alive_s)


def test_the_front_drops_idle_connections_long_before_the_coordinators_api():
    from api.front.read_front import FrontApp

    server_keep_alive_s = _api_keep_alive_s()
    expiry = FrontApp("http://127.0.0.1:9", ttl_s=1.0, stale_s=0.0).app.idle_expiry_s
    assert 0 < expiry and expiry + MARGIN_S <= server_keep_alive_s, (expiry, server_keep_alive_s)
