"""What tenants see of server paths: never the server's layout (issue 14, F8).

The registry and the runtime keep real, absolute paths (they open the files);
everything the API sends goes through `PublicPaths` first:

  * a path inside a data root is shown relative to that root (``digits.jsonl``,
    ``sub/x.jsonl``), which is also how a tenant names it when registering (relative
    paths are taken against the first data root);
  * a path inside the state dir is shown relative to it (``runs/<name>-<id>/export``):
    the run's own folder, not where the service keeps it;
  * a root itself is shown as ``<data root>`` or ``<state dir>``;
  * any other absolute path is cut to ``…/<last part>``.

Redaction is on text, so it covers paths wherever they appear: fields of a
record, a FAILED reason, an error detail. Roots are matched longest first (a
data root inside the state dir, or the reverse, gets the closer one), both as
given and with symlinks resolved (checks store resolved paths).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# An absolute path not already rewritten: '/' + parts, not inside a URL ('http://h:1/x' has
# '/' after ':' or '/'), not a relative path's inner '/'. Only paths whose first part is a
# top-level folder of this machine are cut, so route paths in messages ("/v1/adapters") stay.
_ABSOLUTE = re.compile(r"(?<![\w.:/~-])/([^\s'\"/,;:()\[\]{}<>]+)((?:/[^\s'\"/,;:()\[\]{}<>]+)*)")


class PublicPaths:
    def __init__(self, data_roots: Iterable[Path], state_dir: Path) -> None:
        pairs: list[tuple[str, str]] = []  # (absolute prefix, what the root itself is shown as)
        for root in data_roots:
            pairs += [(p, "<data root>") for p in _spellings(root)]
        pairs += [(p, "<state dir>") for p in _spellings(state_dir)]
        # Longest prefix first: the closest root wins.
        self._roots = sorted(set(pairs), key=lambda p: len(p[0]), reverse=True)
        try:
            self._top_level = frozenset(os.listdir("/"))
        except OSError:
            self._top_level = frozenset()

    @classmethod
    def from_settings(cls, settings: Any) -> PublicPaths:
        return cls(settings.data_roots, settings.state_dir)

    def text(self, text: str) -> str:
        """`text` with every absolute path replaced by its public form (see the module doc)."""
        if "/" not in text:
            return text
        for prefix, shown in self._roots:
            # "<root>/x" -> "x"; the root alone -> its label; "<root>x" (another folder) untouched.
            text = re.sub(re.escape(prefix) + r"(?:(/)|(?![\w.-]))", lambda m, label=shown: "" if m.group(1) else label, text)
        return _ABSOLUTE.sub(self._cut, text)

    def _cut(self, m: re.Match) -> str:
        if m.group(1) not in self._top_level:
            return m.group(0)
        return "…/" + (m.group(0).rsplit("/", 1)[-1])

    def value(self, value: Any) -> Any:
        """A JSON-like value with `text` applied to every string in it (keys included)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def json_bytes(self, body: bytes) -> bytes:
        """A JSON body with `value` applied; bodies that are not JSON pass unchanged."""
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        return json.dumps(self.value(payload), separators=(",", ":"), ensure_ascii=False).encode()


def _spellings(root: Path) -> list[str]:
    """The root as given (made absolute) and resolved, without a trailing '/'; '/' itself is never a root prefix."""
    out = []
    for p in (Path(root).absolute(), Path(root).resolve()):
        s = os.path.normpath(str(p))
        if s != "/":
            out.append(s)
    return out


PUBLIC_HEADER = b"x-lorafleet-public"  # on a response whose body went through json_bytes already


class PublicPathsMiddleware:
    """ASGI middleware: every JSON response body goes through `PublicPaths.json_bytes`.

    JSON responses of this API are small (records, lists, errors), so the body is
    buffered; other media types (the Prometheus text, the docs page) stream through. A
    response that carries PUBLIC_HEADER was made public when it was built (a list page built
    once for a burst of readers, api/front/read_cache.py): it passes as it is, the header removed."""

    def __init__(self, app: Any, paths: PublicPaths) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                if PUBLIC_HEADER in headers:
                    await send({**message, "headers": [(k, v) for k, v in message["headers"] if k != PUBLIC_HEADER]})
                    return
                if headers.get(b"content-type", b"").split(b";")[0].strip() == b"application/json":
                    start = message  # held until the whole body is here
                    return
                await send(message)
                return
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = self.paths.json_bytes(b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers") or [] if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)
