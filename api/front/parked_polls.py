"""Tinker polls held by the front (issue 41): a queued call's repeat polls never reach the coordinator.

A Tinker call queued for a trainer slot can wait many minutes with a thousand tenants, and its
client polls `retrieve_future` all that time (each poll held `POLL_HOLD_S`, then sent again). Every
poll that reaches the coordinator's app takes its interpreter from the training loop. So the front
holds ("parks") the repeat polls itself:

  P1 a poll is parked only after the coordinator answered try again for that request id, to those
     credentials (F1: the same Authorization and X-API-Key headers), with the parkable header: its
     promise to announce the id on the feed when the future finishes (api/tinker/resolved_feed.py);
  P2 a parked poll waits until the id is announced, then is passed to the coordinator (whose answer,
     the result, is the client's); or, after `hold_s` (the coordinator's own hold), it is answered the
     coordinator's last try-again answer for it;
  P3 an answer is reused for at most `refresh_s`; after that the poll is passed again, so a waiting
     client's queue state and reason are at most that old (the coordinator answers them afresh);
  P4 what the front is unsure of it passes: the feed's RESET (ids may have been lost) forgets every
     parked answer and wakes every parked poll; once the feed ends (the coordinator is gone) nothing
     is parked any more. An id announced before its answer was noted (the two race) is remembered
     (`recent`), so the poll is passed, not parked.

The feed is a pipe from the coordinator (one line per finished watched future: its request id).
The front imports nothing of the product, so the protocol's names live here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

PARKABLE_HEADER = b"x-lorafleet-parkable"  # on a try_again answer: its id will be announced on the feed (P1)
RESET = b"*"  # on the feed: ids may have been lost (P4)
RETRIEVE_PATH = "/api/v1/retrieve_future"
MAX_POLL_BODY = 64 * 1024  # a retrieve_future body is a request id and a flag; a larger (or unsized) one streams past
REFRESH_S = 300.0  # P3: how old a reused try-again answer (its queue state and reason) may be
MAX_PARKED = 200_000  # answers kept at most (oldest dropped: their next poll is passed); ~1 KB each
MAX_RECENT = 65_536  # finished ids kept for P4's race


@dataclass
class _Parked:
    credentials: tuple  # whose answer it is (F1): only the future's owner gets a parkable one
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    at: float  # time.monotonic() of the coordinator's answer


class ParkedPolls:
    """The front's parked polls over the feed read from `feed_fd` (the pipe's read end)."""

    def __init__(self, feed_fd: int, hold_s: float, refresh_s: float = REFRESH_S) -> None:
        self.feed_fd, self.hold_s, self.refresh_s = feed_fd, hold_s, refresh_s
        self.alive = False  # True while the feed is read (P4)
        self._answers: OrderedDict[str, _Parked] = OrderedDict()  # request id -> the coordinator's last try again
        self._waiting: dict[str, asyncio.Event] = {}  # request id -> the event its parked polls wait on
        self._recent: OrderedDict[str, None] = OrderedDict()  # ids announced lately (P4's race)
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(self.feed_fd, "rb", buffering=0))
        self.alive = True
        self._reader = loop.create_task(self._read(reader), name="front-parked-polls-feed")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                rid = line.strip().decode("ascii", errors="replace")
                if rid == RESET.decode():
                    self._reset()
                elif rid:
                    self._finished(rid)
        finally:  # P4: the coordinator is gone (or this task was stopped)
            self.alive = False
            self._reset()

    def _finished(self, rid: str) -> None:
        self._recent[rid] = None
        if len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
        self._answers.pop(rid, None)
        event = self._waiting.pop(rid, None)
        if event is not None:
            event.set()

    def _reset(self) -> None:
        self._answers.clear()
        for event in self._waiting.values():
            event.set()
        self._waiting.clear()

    # --- one poll ------------------------------------------------------------------------------

    def parked_answer(self, credentials: tuple, rid: str) -> _Parked | None:
        """The answer a poll of `rid` with `credentials` may wait on (P1, P3), or None: pass it."""
        parked = self._answers.get(rid)  # never a finished id's: `_finished` drops it, `note` refuses it
        if parked is None or parked.credentials != credentials or not self.alive:
            return None
        if time.monotonic() - parked.at >= self.refresh_s:  # P3
            del self._answers[rid]
            return None
        return parked

    async def wait(self, rid: str) -> bool:
        """P2: True when `rid` finished (or the front must ask again: P4) within `hold_s`; False after it."""
        event = self._waiting.get(rid)
        if event is None:
            event = self._waiting[rid] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), self.hold_s)
        except TimeoutError:
            if self._waiting.get(rid) is event:  # its next poll waits on a new one (none kept for a client that left)
                del self._waiting[rid]
            return False
        return True

    def note(self, credentials: tuple, rid: str, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The coordinator's answer to a passed poll: kept when it is a parkable try again (P1)."""
        if status != 200 or not any(k.lower() == PARKABLE_HEADER for k, _ in headers) or rid in self._recent:
            return
        self._answers[rid] = _Parked(credentials, status, headers, body, time.monotonic())
        self._answers.move_to_end(rid)
        if len(self._answers) > MAX_PARKED:
            self._answers.popitem(last=False)


def request_id_of(body: bytes) -> str | None:
    """The request id of a retrieve_future body (JSON), or None when it is not one."""
    try:
        rid = json.loads(body).get("request_id")
    except (ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) and rid else None
