"""`HoldingApp`: an ASGI app that holds calls open, as the coordinator holds a Tinker sample call or a
long poll: for the API front's tests (tests/integration/test_read_front.py) and its pool benchmark
(benchmarks/bench_front_pool.py)."""

from __future__ import annotations

import asyncio
import threading


class HoldingApp:
    """/hold answers only once `release` is set (as a Tinker sample call waits for its engine); any other
    path answers at once. Each answer's body is its path; `held` counts the /hold calls that reached it and
    `ping_connections` the connections (client address and port) the other calls came over."""

    def __init__(self) -> None:
        self.release, self.held, self.ping_connections = threading.Event(), 0, set()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            self.held += 1
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        else:
            self.ping_connections.add(tuple(scope.get("client") or ()))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": scope["path"].encode()})
