"""service/fleet/remote.py: the one way the coordinator waits on an actor, blocking (`call`) and on an
event loop (`call_async`), against a real Ray actor: its answer; an exception raised inside it comes
back as itself; a slow answer is a TimeoutError naming the call; a dead actor is Ray's own error
(`is_actor_lost`)."""

from __future__ import annotations

import asyncio

import pytest

from tests.local_ray import start_ray, stop_ray
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def actor():
    import ray

    start_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Echo:
        def answer(self, value):
            return value

        def fail(self, message):
            raise ValueError(message)

        def hang(self):
            import threading

            threading.Event().wait(60)  # longer than any timeout below

    try:
        yield Echo.options(max_concurrency=4).remote()
    finally:
        stop_ray()


def _both(ref_of, timeout_s: float, what: str):
    """The call through `call` and through `call_async`: (outcome, outcome), each a value or an exception."""
    from service.fleet.remote import call, call_async

    def outcome(run):
        try:
            return run()
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            return e

    return (outcome(lambda: call(ref_of(), timeout_s, what)),
            outcome(lambda: asyncio.run(call_async(ref_of(), timeout_s, what))))


def test_an_answer_an_error_inside_and_a_timeout(actor):
    assert _both(lambda: actor.answer.remote(7), 30, "echo answer") == (7, 7)
    for got in _both(lambda: actor.fail.remote("bad input (planted)"), 30, "echo fail"):
        assert type(got) is ValueError and str(got) == "bad input (planted)"
    for got in _both(lambda: actor.hang.remote(), 0.5, "echo hang"):
        assert isinstance(got, TimeoutError) and "echo hang did not answer within 0.5 s" in str(got)


def test_a_dead_actor_is_rays_own_error(actor):
    import ray

    from service.fleet.remote import is_actor_lost

    @ray.remote(num_cpus=0)
    class Doomed:
        def answer(self):
            return 1

    doomed = Doomed.remote()
    assert ray.get(doomed.answer.remote(), timeout=30) == 1
    ray.kill(doomed)  # asynchronous: a call sent just after may still reach the actor and be answered

    def dead() -> bool:
        try:
            ray.get(doomed.answer.remote(), timeout=30)
            return False
        except Exception:  # noqa: BLE001 - any failure: the kill has landed; what it is, is checked below
            return True

    wait_until(dead, "the killed actor stops answering", timeout_s=60, interval_s=0.1)
    for got in _both(lambda: doomed.answer.remote(), 30, "doomed answer"):
        assert is_actor_lost(got), repr(got)
