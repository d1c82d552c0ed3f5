"""api/front/read_cache.py ReadCache: one build per burst, answers no older than ttl_s, a write clears it.

Real asyncio; the builds are coroutines that count themselves and (where a test needs requests to
overlap) wait on an event the test sets. The clock is the test's own where ages matter."""

from __future__ import annotations

import asyncio

import pytest

from api.front.read_cache import ReadCache

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _builder(gate: asyncio.Event | None = None):
    calls = []

    async def build() -> bytes:
        calls.append(1)
        if gate is not None:
            await gate.wait()
        return f"answer {len(calls)}".encode()

    return build, calls


@pytest.mark.parametrize("ttl, most_builds", [(0.0, 2), (1.0, 1)])
def test_a_burst_of_a_hundred_costs_one_or_two_builds(ttl, most_builds):
    async def burst():
        cache, gate = ReadCache(ttl), asyncio.Event()
        build, calls = _builder(gate)
        tasks = [asyncio.create_task(cache.get("k", build)) for _ in range(100)]
        await asyncio.sleep(0)
        gate.set()
        answers = await asyncio.gather(*tasks)
        return calls, answers

    calls, answers = asyncio.run(burst())
    assert 1 <= len(calls) <= most_builds and len(answers) == 100 and set(answers) <= {b"answer 1", b"answer 2"}


def test_answers_are_no_older_than_the_ttl_and_keys_are_apart():
    async def scenario():
        clock = Clock()
        cache = ReadCache(1.0, clock=clock)
        build, calls = _builder()
        assert await cache.get("a", build) == b"answer 1"
        clock.now += 0.9
        assert await cache.get("a", build) == b"answer 1"  # within the ttl: the same bytes
        assert await cache.get("b", build) == b"answer 2"  # another query: its own answer
        clock.now += 0.2
        assert await cache.get("a", build) == b"answer 3"  # older than the ttl: built again
        return calls

    assert len(asyncio.run(scenario())) == 3


def test_a_write_clears_and_an_answer_built_before_it_is_not_kept():
    async def scenario():
        cache, gate = ReadCache(60.0), asyncio.Event()
        build, calls = _builder(gate)
        first = asyncio.create_task(cache.get("k", build))
        await asyncio.sleep(0)
        cache.clear()  # a write while the answer was being built
        gate.set()
        assert await first == b"answer 1"  # its own request gets it
        assert await cache.get("k", build) == b"answer 2"  # but it was not stored for later ones
        cache.clear()
        assert await cache.get("k", build) == b"answer 3"
        return cache.builds

    assert asyncio.run(scenario()) == 3


def test_a_failed_build_is_not_stored_and_the_cache_is_bounded():
    async def scenario():
        cache = ReadCache(60.0, max_entries=3)

        async def bad() -> bytes:
            raise RuntimeError("the controller did not answer")

        with pytest.raises(RuntimeError, match="did not answer"):
            await cache.get("k", bad)
        build, calls = _builder()
        assert await cache.get("k", build) == b"answer 1"
        for key in "abcd":
            await cache.get(key, build)
        assert len(cache._answers) == 3 and "k" not in cache._answers  # oldest out first
        return calls

    assert len(asyncio.run(scenario())) == 5


def test_stale_answers_come_at_once_while_one_new_one_is_built():
    """stale_s: past the ttl but within ttl + stale_s, a burst gets the stored bytes without waiting
    (the build is held by the test's gate) and starts ONE build; the next request after it gets
    the new answer. Past ttl + stale_s, a request waits for a build as without stale_s."""
    async def scenario():
        clock, gate = Clock(), asyncio.Event()
        cache = ReadCache(1.0, clock=clock, stale_s=2.0)
        build, calls = _builder(gate)
        gate.set()
        assert await cache.get("k", build) == b"answer 1"
        gate.clear()
        clock.now += 2.5  # stale, within 1 + 2 s
        answers = await asyncio.gather(*(cache.get("k", build) for _ in range(100)))  # the gate is shut: no wait
        assert answers == [b"answer 1"] * 100
        await asyncio.sleep(0)
        assert len(calls) == 2  # one background build for the whole burst
        gate.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert await cache.get("k", build) == b"answer 2"
        clock.now += 3.5  # older than ttl + stale_s: wait for the new answer
        assert await cache.get("k", build) == b"answer 3"

    asyncio.run(scenario())


def test_nothing_stale_is_sent_after_a_write():
    async def scenario():
        clock = Clock()
        cache = ReadCache(1.0, clock=clock, stale_s=5.0)
        build, calls = _builder()
        assert await cache.get("k", build) == b"answer 1"
        clock.now += 2.0
        cache.clear()  # a register or retire through the API
        assert await cache.get("k", build) == b"answer 2"  # built for this request, not the stale one

    asyncio.run(scenario())


def test_a_failed_background_build_keeps_the_stale_answer_until_it_ages_out():
    async def scenario():
        clock = Clock()
        cache = ReadCache(1.0, clock=clock, stale_s=2.0)
        fail = [False]

        async def build() -> bytes:
            if fail[0]:
                raise RuntimeError("registry busy")
            return b"ok"

        assert await cache.get("k", build) == b"ok"
        fail[0] = True
        clock.now += 1.5
        assert await cache.get("k", build) == b"ok"
        for _ in range(5):
            await asyncio.sleep(0)
        clock.now += 2.0  # past ttl + stale_s: the request builds, and sees the failure
        with pytest.raises(RuntimeError, match="registry busy"):
            await cache.get("k", build)

    asyncio.run(scenario())
