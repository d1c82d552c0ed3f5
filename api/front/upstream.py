"""The front's connections to the coordinator's API (api/front/read_front.py): HTTP/1.1 over asyncio
streams, with a stack of idle keep-alive connections.

Why not httpx here: httpcore's pool scans every connection it holds at each request's start and end
(expiry checks, a `poll()` of each idle socket, a search for an available one), so a front holding a
thousand Tinker long polls paid O(held) per request: with 1,024 Tinker RL tenants the pool's
bookkeeping was a fifth of the front's busy samples and httpx as a whole over a third (py-spy, issue 41's
benchmark). Here a request takes the newest idle connection or opens one, and gives it back when its
answer was read to the end: O(1) whatever is held, and nothing but the bytes on the wire.

Invariants:
  U1 a connection is reused only after its answer was read to the end in the framing it stated
     (Content-Length, chunked, or none for HEAD, 1xx, 204 and 304) and the answer did not say
     `Connection: close`; any other end (an error, a consumer that stops early) closes it;
  U2 an idle connection is dropped after `idle_expiry_s` (far below the app's keep-alive), and one the
     app closed meanwhile is never reused, so a request never goes out on a connection being closed;
  U3 bodies stream both ways: a request's body is written as it arrives (with its Content-Length, else
     chunked), an answer's is yielded as it is read;
  U4 a write that fails because the app answered early and closed (a refused body) still reads that
     answer, as httpcore does, so the caller gets the app's status and reason, not a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

READ_CHUNK = 64 * 1024
HEAD_LIMIT = 1 << 20  # bytes of an answer's status line and headers
NO_BODY_STATUS = frozenset({204, 304})
# What a broken or non-HTTP answer raises while it is read (each becomes an UpstreamError)
_BROKEN_WIRE = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


class UpstreamError(Exception):
    """The app could not be reached, dropped the connection, or sent an answer that is not HTTP/1.1."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry_s: float) -> bool:
        return (now - self.idle_since < expiry_s and not self.writer.is_closing() and not self.reader.at_eof())

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """An answer whose body is read on demand (`aiter_raw`, `read`); `aclose` ends it (U1)."""

    def __init__(self, pool: Upstream, conn: _Connection, method: str, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code, self.headers = status, headers
        self._pool, self._conn, self._done = pool, conn, False
        fields = {k.lower(): v.lower() for k, v in headers}
        self._keep = b"close" not in fields.get(b"connection", b"")
        if method == "HEAD" or status in NO_BODY_STATUS or 100 <= status < 200:
            self._framing, self._length = "none", 0
        elif b"chunked" in fields.get(b"transfer-encoding", b""):
            self._framing, self._length = "chunked", 0
        elif b"content-length" in fields:
            self._framing, self._length = "length", int(fields[b"content-length"])
        else:
            self._framing, self._length, self._keep = "eof", 0, False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes (transfer framing removed), as they arrive."""
        reader = self._conn.reader
        try:
            if self._framing == "length":
                left = self._length
                while left:
                    chunk = await reader.read(min(left, READ_CHUNK))
                    if not chunk:
                        raise UpstreamError(f"the app closed the connection {left} bytes before the answer's end")
                    left -= len(chunk)
                    yield chunk
            elif self._framing == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the last empty line
                            pass
                        break
                    yield await reader.readexactly(size)
                    if await reader.readexactly(2) != b"\r\n":
                        raise UpstreamError("a chunk of the app's answer does not end in CRLF")
            elif self._framing == "eof":
                while chunk := await reader.read(READ_CHUNK):
                    yield chunk
            self._done = True
        except _BROKEN_WIRE as err:
            raise UpstreamError(f"the app's answer broke off: {type(err).__name__}: {err}") from err

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep:
            self._pool._release(conn)
        else:
            conn.close()


class Upstream:
    """Connections to one app at `url` (http://HOST:PORT)."""

    def __init__(self, url: str, *, idle_expiry_s: float = 2.0, connect_timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"the front's upstream must be http://HOST:PORT, got {url!r}")
        self.host, self.port = parts.hostname, parts.port
        self._host_header = f"{parts.hostname}:{parts.port}".encode()
        self.idle_expiry_s, self.connect_timeout_s = idle_expiry_s, connect_timeout_s
        self._idle: deque[_Connection] = deque()  # oldest left, newest right
        self.opened = 0  # connections opened so far (tests, benchmarks)

    async def _take(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the newest: the least likely to have expired
            if conn.usable(now, self.idle_expiry_s):
                self._trim(now)
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT),
                                                    self.connect_timeout_s)
        except (OSError, TimeoutError) as err:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {type(err).__name__}: {err}") from err
        self.opened += 1
        return _Connection(reader, writer)

    def _trim(self, now: float) -> None:
        """U2: the expired idle connections, all at the old end of the stack."""
        while self._idle and not self._idle[0].usable(now, self.idle_expiry_s):
            self._idle.popleft().close()

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._trim(conn.idle_since)

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                      body: AsyncIterator[bytes] | None = None) -> UpstreamResponse:
        """Send one request and read its answer's status and headers (the body: the answer's `aiter_raw`).
        `headers` carry no hop-by-hop ones (the Host is added here). A `body` is sent with the headers'
        Content-Length when they have one, else chunked (U3)."""
        conn = await self._take()
        sized = any(k.lower() == b"content-length" for k, _ in headers)
        lines = [f"{method} {target} HTTP/1.1".encode(), b"host: " + self._host_header]
        lines += [k + b": " + v for k, v in headers]
        if body is not None and not sized:
            lines.append(b"transfer-encoding: chunked")
        try:
            try:
                conn.writer.write(b"\r\n".join(lines) + b"\r\n\r\n")
                if body is not None:
                    async for chunk in body:
                        if chunk:
                            conn.writer.write(chunk if sized else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            await conn.writer.drain()
                    if not sized:
                        conn.writer.write(b"0\r\n\r\n")
                await conn.writer.drain()
            except ConnectionAbortedError:
                raise  # the caller's client left while sending its body (read_front._body): nobody to answer
            except OSError:
                pass  # U4: the app may have answered and closed; its answer (or EOF) is read below
            head = await conn.reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head[:-4].split(b"\r\n")
            version, status = status_line.split(b" ", 2)[:2]
            if not version.startswith(b"HTTP/1."):
                raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            answer = []
            for line in header_lines:
                name, _, value = line.partition(b":")
                answer.append((name.strip(), value.strip()))
            return UpstreamResponse(self, conn, method, int(status), answer)
        except BaseException as err:
            conn.close()
            if isinstance(err, ConnectionAbortedError):
                raise
            if isinstance(err, _BROKEN_WIRE):
                raise UpstreamError(f"the app did not answer: {type(err).__name__}: {err}") from err
            raise

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
