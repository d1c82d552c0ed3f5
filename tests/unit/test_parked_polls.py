"""The front's parked polls (api/front/parked_polls.py P1-P4) and the coordinator's feed that wakes them
(api/tinker/resolved_feed.py), over a real pipe and a real event loop. End to end, through a front
process and the Tinker routes: tests/integration/test_front_parked_polls.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from api.front.parked_polls import PARKABLE_HEADER, ParkedPolls, request_id_of
from api.tinker.resolved_feed import ResolvedFeed

ALICE, BOB = (b"", b"tml-alice"), (b"", b"tml-bob")
TRY_AGAIN = b'{"type": "try_again", "request_id": "r1", "queue_state": "paused_capacity"}'
PARKABLE = [(b"content-type", b"application/json"), (PARKABLE_HEADER, b"1")]


@contextlib.asynccontextmanager
async def _parked(hold_s: float = 30.0, refresh_s: float = 300.0) -> AsyncIterator[tuple[ParkedPolls, ResolvedFeed]]:
    """The front's side on a pipe's read end and the coordinator's feed on its write end."""
    r, w = os.pipe()
    polls = ParkedPolls(r, hold_s, refresh_s)
    await polls.start()
    feed = ResolvedFeed(w)
    try:
        yield polls, feed
    finally:
        feed.close()
        await polls.close()


def test_a_parked_poll_wakes_when_its_future_is_announced():
    async def go():
        async with _parked() as (polls, feed):
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)
            assert polls.parked_answer(ALICE, "r1").body == TRY_AGAIN  # P1
            waiting = asyncio.ensure_future(polls.wait("r1"))
            await asyncio.sleep(0)  # let it start waiting
            feed.announce("r1")
            assert await asyncio.wait_for(waiting, 10) is True  # woken, long before its 30 s hold
            assert polls.parked_answer(ALICE, "r1") is None  # finished: the next poll is passed

    asyncio.run(go())


def test_a_parked_poll_is_answered_its_try_again_after_the_hold():
    async def go():
        async with _parked(hold_s=0.05) as (polls, feed):
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)
            assert await polls.wait("r1") is False
            assert polls.parked_answer(ALICE, "r1") is not None  # still parked: the next poll waits again

    asyncio.run(go())


def test_only_a_parkable_try_again_to_the_same_credentials_is_parked():
    async def go():
        async with _parked() as (polls, feed):
            polls.note(ALICE, "r1", 200, [(b"content-type", b"application/json")], TRY_AGAIN)  # no promise (P1)
            polls.note(ALICE, "r2", 404, PARKABLE, b'{"detail": "unknown request id"}')
            assert polls.parked_answer(ALICE, "r1") is None and polls.parked_answer(ALICE, "r2") is None
            polls.note(ALICE, "r3", 200, PARKABLE, TRY_AGAIN)
            assert polls.parked_answer(BOB, "r3") is None  # F1: another key's poll is passed (the coordinator says 404)
            assert polls.parked_answer(ALICE, "r3") is not None

    asyncio.run(go())


def test_an_answer_older_than_the_refresh_is_asked_again():
    async def go():
        async with _parked(refresh_s=0.0) as (polls, feed):
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)
            assert polls.parked_answer(ALICE, "r1") is None  # P3

    asyncio.run(go())


def test_an_id_announced_before_its_answer_was_noted_is_not_parked():
    async def go():
        async with _parked() as (polls, feed):
            feed.announce("r1")
            async def read():
                while "r1" not in polls._recent:  # the feed is read on this loop
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(read(), 10)
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)  # the try again crossed the finish (P4)
            assert polls.parked_answer(ALICE, "r1") is None

    asyncio.run(go())


def test_a_reset_and_the_feeds_end_wake_every_parked_poll_and_forget_the_answers():
    async def go():
        async with _parked() as (polls, feed):
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)
            polls.note(BOB, "r2", 200, PARKABLE, TRY_AGAIN)
            waiting = [asyncio.ensure_future(polls.wait(r)) for r in ("r1", "r2")]
            await asyncio.sleep(0)
            os.write(feed.fd, b"*\n")  # RESET: ids may have been lost
            assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [True, True]
            assert polls.parked_answer(ALICE, "r1") is None and polls.alive
            polls.note(ALICE, "r1", 200, PARKABLE, TRY_AGAIN)
            waiting = asyncio.ensure_future(polls.wait("r1"))
            await asyncio.sleep(0)
            feed.close()  # the coordinator is gone
            assert await asyncio.wait_for(waiting, 10) is True
            assert not polls.alive and polls.parked_answer(ALICE, "r1") is None  # nothing is parked any more

    asyncio.run(go())


def test_a_full_pipe_loses_ids_and_the_next_write_says_reset_first():
    r, w = os.pipe()
    feed = ResolvedFeed(w)
    n = 0
    while not feed.lost:  # nobody reads: the pipe fills
        feed.announce(f"{n:032x}")
        n += 1
    os.set_blocking(r, False)
    drained = b""
    while True:
        try:
            drained += os.read(r, 1 << 16)
        except BlockingIOError:
            break
    assert drained.count(b"\n") == feed.announced == n - 1  # the last did not fit
    feed.announce("after")
    assert not feed.lost and os.read(r, 1 << 16) == b"*\nafter\n"
    os.close(r)
    feed.announce("gone")  # the reader is gone: the feed closes itself
    assert feed.fd is None


def test_request_id_of_a_retrieve_body():
    assert request_id_of(b'{"request_id": "abc", "allow_metadata_only": false}') == "abc"
    assert request_id_of(b"not json") is None and request_id_of(b'["abc"]') is None and request_id_of(b'{"request_id": 3}') is None
