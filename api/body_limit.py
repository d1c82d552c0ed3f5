"""ASGI middleware: refuse request bodies over a size limit with 413.

Checks the declared Content-Length first (refused before any byte is read)
and also counts the bytes actually received, so a chunked body without a
length cannot get past the limit either. The request is refused before any
route runs, so it changes nothing.
"""

from __future__ import annotations

import json
from typing import Any


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        received = 0
        response_started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not response_started:
                await self._refuse(send, received)

    async def _refuse(self, send: Any, size: int) -> None:
        body = json.dumps(
            {
                "error": "too_large",
                "detail": f"request body of {size} bytes is larger than the {self.max_bytes} bytes allowed (LORAFLEET_MAX_BODY_BYTES)",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
