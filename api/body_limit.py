"""ASGI middleware: refuse request bodies over a size limit with 413.

Checks the declared Content-Length first (refused before any byte is read)
and also counts the bytes actually received, so a chunked body without a
length cannot get past the limit either. The request is refused before any
route runs, so it changes nothing.
"""

from __future__ import annotations

import json
from typing import Any


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int, path_limits: dict[str, int] | None = None, *,
                 setting: str = "LORAFLEET_MAX_BODY_BYTES", path_setting: str = "LORAFLEET_TINKER_MAX_BODY_BYTES") -> None:
        """``path_limits``: exact request paths with a limit of their own (the Tinker API's
        forward_backward carries token arrays: LORAFLEET_TINKER_MAX_BODY_BYTES)."""
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})
        self.setting, self.path_setting = setting, path_setting  # named in the 413 body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        if limit != self.max_bytes:
            await BodySizeLimit(self.app, limit, setting=self.path_setting)(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        received = 0
        refused = False  # our 413 went out; whatever the app sends afterwards is dropped

        async def counting_receive() -> dict:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Answer 413 now and tell the app the client went away: the route
                    # never sees a body, so nothing changes. (Raising here would be
                    # turned into a 400 by the framework's body parsing.)
                    refused = True
                    await self._refuse(send, received, declared=False)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send: Any, size: int, declared: bool = True) -> None:
        what = f"request body of {size} bytes" if declared else f"request body ({size}+ bytes, no length given)"
        body = json.dumps(
            {
                "error": "too_large",
                "detail": f"{what} is larger than the {self.max_bytes} bytes allowed ({self.setting})",
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
