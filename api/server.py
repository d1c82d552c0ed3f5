"""Serve the app with uvicorn in a background thread: `ApiServer`.

Used by `lorafleet serve` / batch mode (the API beside the training loop) and
by the integration tests. Port 0 binds a free port; `url` reports the real one.
`stop()` always returns within its timeout; use it as a context manager so the
server stops even when the caller fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from api.tinker.resolved_feed import ResolvedFeed
from service.config.settings import ServiceSettings, is_loopback_host

log = logging.getLogger(__name__)

# How long the API keeps an idle connection (uvicorn's own default is 5 s). Its clients that lorafleet
# runs (the API front's upstream, the CLI) drop theirs after 2 s; the margin covers a busy client that
# reads an answer late (the same reason and number as the engines': rollout/engines/client.py).
API_KEEP_ALIVE_S = 60


class ApiServer:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, token_configured: bool = False, log_level: str = "warning",
                 on_stop: list[Callable[[], Awaitable[Any]]] | None = None) -> None:
        """``on_stop``: coroutines awaited on the serving loop when ``stop()`` is called, before the
        server exits (uvicorn runs with lifespan off, so the app's own shutdown events never fire);
        default: the app's ``state.on_stop`` list, if it has one. The app's ``state.on_start`` list
        (if any) is awaited on the serving loop once it listens (``start()`` returns after them)."""
        state = getattr(app, "state", None)
        self.on_stop = list(on_stop if on_stop is not None else getattr(state, "on_stop", None) or [])
        self.on_start = list(getattr(state, "on_start", None) or [])
        if not is_loopback_host(host) and not token_configured:
            raise ValueError(f"refusing to bind {host!r} without an API token (set LORAFLEET_API_TOKEN)")
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=API_KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.host = host

    def start(self, timeout_s: float = 30.0) -> ApiServer:
        self._thread = threading.Thread(target=self._server.run, name="lorafleet-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the API server exited during start-up (port in use?)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the API server did not start within {timeout_s} s")
            time.sleep(0.02)
        loop = self._server.servers[0].get_loop() if self.on_start else None
        for hook in self.on_start:
            asyncio.run_coroutine_threadsafe(hook(), loop).result(timeout_s)
        return self

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.on_stop and self._server.started and self._thread is not None and self._thread.is_alive():
            loop = self._server.servers[0].get_loop()
            for hook in self.on_stop:
                try:
                    asyncio.run_coroutine_threadsafe(hook(), loop).result(timeout_s)
                except Exception as err:  # noqa: BLE001 - stopping goes on
                    log.warning("API stop hook failed: %s: %s", type(err).__name__, err)
            self.on_stop = []
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(2.0)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def http_url(host: str, port: int) -> str:
    """The URL of a server on host:port (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_api_server(controller: Any, settings: ServiceSettings, fleet_stats: Any = None) -> ApiServer | FrontedApi:
    """The REST API over `controller` on settings.host:port, started (what `lorafleet serve` runs);
    `fleet_stats` (service.loop.fleet_stats.FleetStats, fed by the training loop) backs GET /v1/fleet/stats.
    With settings.api_front (the default) a front process owns settings.host:port and the app listens
    on a loopback port behind it (api/front/read_front.py: the polled reads answered off the loop's
    interpreter)."""
    from api.app import create_app

    if not settings.api_front:
        app = create_app(controller, settings, fleet_stats)
        server = ApiServer(app, settings.host, settings.port, token_configured=settings.api_token is not None,
                           on_stop=app.state.on_stop)
        return server.start()
    from api.front.read_front import bind_public

    # The front caches the reads (read_cache_s / read_stale_s); behind it the app only merges concurrent
    # builds, so an answer is never stale twice over.
    app = create_app(controller, settings.model_copy(update={"read_cache_s": 0.0, "read_stale_s": 0.0}), fleet_stats)
    sock = bind_public(settings.host, settings.port)  # a port in use fails here, naming the setting
    return start_fronted(app, sock, settings.read_cache_s, settings.read_stale_s, http_url(settings.host, sock.getsockname()[1]))


def start_fronted(app: Any, sock: Any, read_cache_s: float, read_stale_s: float, url: str) -> FrontedApi:
    """`app` on a loopback port behind a front process on the bound socket `sock` (handed over: closed
    here), and, when the app serves the Tinker API (`app.state.tinker_futures`), the feed of its finished
    futures to the front (F5 in api/front/read_front.py: the front holds a queued call's repeat polls)."""
    from api.front.read_front import start_front

    try:
        inner = ApiServer(app, "127.0.0.1", 0, on_stop=app.state.on_stop).start()
        futures = getattr(app.state, "tinker_futures", None)
        feed_r, feed_w = os.pipe() if futures is not None else (None, None)
        try:
            front = start_front(sock, inner.url, read_cache_s, read_stale_s, feed_fd=feed_r,
                                park_hold_s=futures.poll_s if futures is not None else None)
        except BaseException:
            inner.stop()
            for fd in (feed_r, feed_w):
                if fd is not None:
                    os.close(fd)
            raise
        if futures is not None:
            os.close(feed_r)  # the front holds it now
            futures.feed = ResolvedFeed(feed_w)
        return FrontedApi(inner, front, url, futures.feed if futures is not None else None)
    finally:
        sock.close()  # the front holds it now


class FrontedApi:
    """The API behind its front process (api/front/read_front.py): `url` is the front's, `stop()` stops both."""

    def __init__(self, inner: ApiServer, front: subprocess.Popen, url: str, feed: ResolvedFeed | None = None) -> None:
        self.inner, self.front, self.url, self.feed = inner, front, url, feed

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.front.poll() is None:  # the front first: no request reaches a stopping app
            self.front.terminate()
            try:
                self.front.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.front.kill()
                self.front.wait(5)
        self.inner.stop(timeout_s)
        if self.feed is not None:  # after the app's loop stopped: nothing announces any more
            self.feed.close()
