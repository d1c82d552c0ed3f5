"""The API's front process (issue 26: reads never stall training).

The coordinator process runs the training loop and the API (uvicorn in a thread, api/server.py).
Every request's Python work there (HTTP parsing, routing, auth, the answer's bytes) takes the
interpreter from the loop's thread, and the loop's thread gets it back only at the interpreter's
switch interval each time it let it go (every SQLite query and Ray call lets it go). Measured with
1,024 tenants on the 2-core machine: bursts of 100 concurrent reads every 2 s cut the fleet's
tenant-steps per minute to 0.74 of quiet, and the placement's time per round rose from 14 to
24 ms, while the coordinator used 0.3 of a core: the loop waited for the interpreter, not for CPU.

The front is a process of its own (`python -m api.front.read_front`, started by api/server.py): it owns
the public address (settings.host:port; the socket is bound by the coordinator and handed over,
so a port in use fails the start with a clear error) and passes every request to the
coordinator's API, which then listens on a loopback port only. Except for the reads that
dashboards and scrapers poll (`CACHED_GETS`): those are answered from the front's own
`ReadCache` (api/front/read_cache.py: single flight, `ttl_s`, stale while refreshing), so a burst of
100 costs the coordinator at most one request per distinct read, whatever its size.

Invariants:
  F1 an answer is shared only between requests with the same path, query and credential headers
     (Authorization, X-API-Key), so no caller gets an answer built for another credential; only
     200 answers are stored (a 401 or 403 is the coordinator's to say, every time);
  F2 a request with another method than GET, HEAD or OPTIONS clears the cache once its answer is
     back: a caller reads its own writes at once, as without the front. Except the Tinker wire's
     (`TINKER_WIRE`, /api/v1/...): its calls change no run, no page of /v1/adapters and nothing a
     Tinker client reads back through the cached reads (its models have their own routes), only
     counters of /metrics and /v1/fleet/stats, which show them within `ttl_s` as they show training.
     A fleet of Tinker tenants posts many calls a second: clearing on each made every burst of
     reads miss (measured with 128 Tinker tenants among 1,024 runs: p99 2.97 s for the list, 4.45 s
     for /metrics, against 0.30 s without them);
  F3 everything else passes unchanged, streamed both ways: method, path, query, headers (less the
     hop-by-hop ones), body, status; the coordinator does every check (auth, limits, validation).
     The connections to the coordinator are api/front/upstream.py's (O(1) a request however many
     long polls are held);
  F4 the front dies with the coordinator: it exits when its parent process is gone (checked every
     `PARENT_CHECK_S`, and Linux's parent-death signal), so a killed service leaves no listener;
  F5 with a feed of finished futures from the coordinator (`feed_fd`), a Tinker `retrieve_future` whose
     last answer was a parkable try again is held here until its future finishes (api/front/parked_polls.py
     P1-P4): a call queued for a trainer slot costs the coordinator about one poll in `REFRESH_S`
     instead of one every `POLL_HOLD_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from api.front.parked_polls import MAX_POLL_BODY, PARKABLE_HEADER, RETRIEVE_PATH, ParkedPolls, request_id_of
from api.front.read_cache import ReadCache
from api.front.upstream import Upstream, UpstreamError

# The reads a dashboard or a scraper polls: the routes the coordinator caches too (api/app.py, api/ui.py).
CACHED_GETS = frozenset({"/v1/adapters", "/metrics", "/v1/fleet/stats"})
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")  # F1: the headers that say who the caller is
# Headers of one connection, not of the request (RFC 9110 7.6.1), and the ones upstream.py sets itself (host, framing).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
                        b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host"})
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TINKER_WIRE = "/api/v1/"  # F2: writes under it do not clear the cache
PARENT_CHECK_S = 0.5


@dataclass(frozen=True)
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _NotStored(Exception):
    """A read whose answer is not a 200: sent to its own request, never stored (F1)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer


class FrontApp:
    """The front's ASGI app over the coordinator's API at `upstream` (http://127.0.0.1:PORT)."""

    def __init__(self, upstream: str, ttl_s: float, stale_s: float, parked: ParkedPolls | None = None) -> None:
        self.cache = ReadCache(ttl_s, stale_s=stale_s)
        # Connections to the app (api/front/upstream.py: O(1) per request however many long polls are
        # held; idle ones dropped after 2 s, long before the app's server drops them: api.server.API_KEEP_ALIVE_S).
        self.app = Upstream(upstream, idle_expiry_s=2.0, connect_timeout_s=10.0)
        self.parked = parked  # F5: a queued Tinker call's repeat polls held here (api/front/parked_polls.py)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # no websockets here; lifespan is off
            return
        method, path = scope["method"], scope["path"]
        try:
            if method == "GET" and path in CACHED_GETS:
                await _send_answer(send, await self._cached_read(scope))
            elif method == "POST" and path == RETRIEVE_PATH and self.parked is not None and self.parked.alive \
                    and _sized_under(scope, MAX_POLL_BODY):  # read whole here; anything else streams as it is (F3)
                await self._retrieve_future(scope, receive, send)
            else:
                await self._pass(scope, receive, send)
        finally:
            if method not in READ_ONLY_METHODS and not path.startswith(TINKER_WIRE):
                self.cache.clear()  # F2

    async def _cached_read(self, scope: dict) -> Answer:
        key = (scope["path"], scope.get("query_string", b""), _credentials(scope))
        try:
            return await self.cache.get(key, lambda: self._read(scope))
        except _NotStored as refused:
            return refused.answer
        except UpstreamError as err:
            return _unavailable(err)

    async def _read(self, scope: dict) -> Answer:
        answer = await self._ask("GET", scope)
        if answer.status != 200:
            raise _NotStored(answer)
        return answer

    async def _ask(self, method: str, scope: dict, body: bytes | None = None) -> Answer:
        """The coordinator's whole answer to the request of `scope` (its body given here, read already)."""
        r = await self.app.request(method, _target(scope), _forwarded(scope["headers"]), _chunks(body) if body is not None else None)
        try:
            return Answer(r.status_code, _forwarded(r.headers), await r.read())
        finally:
            await r.aclose()

    async def _pass(self, scope: dict, receive: Any, send: Any) -> None:
        headers = _forwarded(scope["headers"])
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        try:
            response = await self.app.request(scope["method"], _target(scope), headers, _body(receive) if has_body else None)
        except UpstreamError as err:
            await _send_answer(send, _unavailable(err))
            return
        except ConnectionAbortedError:  # the client left while sending its body: nobody to answer
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": _forwarded(response.headers)})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _retrieve_future(self, scope: dict, receive: Any, send: Any) -> None:
        """F5: a Tinker poll, parked while the coordinator's last answer for it is a parkable try again."""
        try:
            body = b"".join([chunk async for chunk in _body(receive)])
        except ConnectionAbortedError:
            return
        rid, credentials = request_id_of(body), _credentials(scope)
        parked = self.parked.parked_answer(credentials, rid) if rid is not None else None
        if parked is not None and not await self.parked.wait(rid):
            await _send_answer(send, Answer(parked.status, _client_headers(parked.headers), parked.body))
            return
        try:
            answer = await self._ask("POST", scope, body)
        except UpstreamError as err:
            answer = _unavailable(err)
        if rid is not None:
            self.parked.note(credentials, rid, answer.status, answer.headers, answer.body)
        await _send_answer(send, Answer(answer.status, _client_headers(answer.headers), answer.body))

    async def close(self) -> None:
        if self.parked is not None:
            await self.parked.close()
        await self.app.aclose()


def _target(scope: dict) -> str:
    query = scope.get("query_string", b"")
    return scope.get("raw_path", scope["path"].encode()).decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")


def _credentials(scope: dict) -> tuple[bytes, ...]:
    found = {k.lower(): v for k, v in scope["headers"] if k.lower() in CREDENTIAL_HEADERS}
    return tuple(found.get(k, b"") for k in CREDENTIAL_HEADERS)


def _forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError("the client went away while sending its body")
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def _sized_under(scope: dict, limit: int) -> bool:
    """Whether the request says its body's length (Content-Length) and it is at most `limit` bytes."""
    for k, v in scope["headers"]:
        if k.lower() == b"content-length":
            return v.isdigit() and int(v) <= limit
    return False


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _client_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An answer's headers less the front's own (the parkable mark is between the coordinator and the front)."""
    return [(k, v) for k, v in headers if k.lower() != PARKABLE_HEADER]


async def _send_answer(send: Any, answer: Answer) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


def _unavailable(err: Exception) -> Answer:
    """503 in the body shape of every error (api.models.ErrorOut) when the coordinator does not answer."""
    body = json.dumps({"error": "unavailable", "detail": f"the service's API did not answer ({type(err).__name__}: {err}); "
                                                         "it may be starting or stopping: try again"}).encode()
    return Answer(503, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body)


# --- the process ------------------------------------------------------------------------------

def start_front(sock: socket.socket, upstream: str, ttl_s: float, stale_s: float, *, feed_fd: int | None = None,
                park_hold_s: float | None = None) -> subprocess.Popen:
    """Start the front on the bound socket `sock` (handed over: the caller closes its copy) in front of
    `upstream`; it serves once its interpreter is up (connections wait in the socket's backlog).
    `feed_fd`: the read end of the coordinator's feed of finished futures (F5; the caller closes its
    copy), and `park_hold_s` how long a parked poll is held: the coordinator's own hold (its
    POLL_HOLD_S), which must come with the feed."""
    if feed_fd is not None and park_hold_s is None:
        raise ValueError("a front with the coordinator's feed needs park_hold_s, the coordinator's poll hold")
    fd = sock.fileno()
    argv = [sys.executable, "-m", "api.front.read_front", "--fd", str(fd), "--upstream", upstream,
            "--ttl-s", str(ttl_s), "--stale-s", str(stale_s), "--parent", str(os.getpid())]
    if feed_fd is not None:
        argv += ["--feed-fd", str(feed_fd), "--park-hold-s", str(park_hold_s)]
    return subprocess.Popen(argv, pass_fds=[fd] + ([feed_fd] if feed_fd is not None else []), preexec_fn=_die_with_parent,
                            stdin=subprocess.DEVNULL)


def bind_public(host: str, port: int) -> socket.socket:
    """The public listening socket, bound here so that a port in use fails the start (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as err:
        raise OSError(err.errno, f"the API cannot listen on {host}:{port} ({err.strerror}): another process holds "
                                 "that port; choose another with LORAFLEET_PORT (the setting 'port'), or 0 for any "
                                 "free port") from None


def _die_with_parent() -> None:
    """F4 in the child before exec: Linux sends SIGTERM when the parent dies (elsewhere: the pid watch alone)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="lorafleet's API front (api/front/read_front.py); started by `lorafleet serve`.")
    ap.add_argument("--fd", type=int, required=True, help="the listening socket, handed over by the coordinator")
    ap.add_argument("--upstream", required=True, help="the coordinator's API (a loopback URL)")
    ap.add_argument("--ttl-s", type=float, default=1.0)
    ap.add_argument("--stale-s", type=float, default=2.0)
    ap.add_argument("--parent", type=int, required=True, help="exit when this process is gone")
    ap.add_argument("--feed-fd", type=int, default=None, help="the coordinator's feed of finished futures (F5)")
    ap.add_argument("--park-hold-s", type=float, default=None, help="how long a parked poll is held (F5): the coordinator's "
                    "poll hold; needed with --feed-fd")
    args = ap.parse_args(argv)
    if args.feed_fd is not None and args.park_hold_s is None:
        ap.error("--feed-fd needs --park-hold-s (the coordinator's poll hold)")
    sock = socket.socket(fileno=args.fd)
    parked = ParkedPolls(args.feed_fd, args.park_hold_s) if args.feed_fd is not None else None
    app = FrontApp(args.upstream, args.ttl_s, args.stale_s, parked)
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def watch_parent() -> None:
        while not server.should_exit:
            if os.getppid() != args.parent:  # F4: re-parented, the coordinator is gone
                server.should_exit = True
            await asyncio.sleep(PARENT_CHECK_S)

    async def serve() -> None:
        gc.collect()  # what the front holds once up lives as long as it does: left out of later collections
        gc.freeze()  # (service/modes.py freeze_startup_objects says why; the front imports nothing of it)
        watcher = asyncio.get_running_loop().create_task(watch_parent())
        if parked is not None:
            await parked.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()
            await app.close()

    # uvicorn's own choice of loop (uvloop where installed), as the coordinator's API gets from uvicorn's run():
    # asyncio.run alone gave the front the pure-Python selector loop, whose socket reads and writes were a
    # fifth of its busy time with 1,024 Tinker tenants (py-spy, issue 41's benchmark).
    asyncio.run(serve(), loop_factory=config.get_loop_factory())


if __name__ == "__main__":
    main()
