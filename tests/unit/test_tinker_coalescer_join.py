"""The coalescer's side of joining the service loop's train calls (api/tinker/coalescer.py):
what the loop may take, the per-model order across both takers, and the bounded wait.

The trainer here is a recording function (which calls ran, in which pass): the rules under
test are queue rules; the numerics of a joined step are proven in
tests/integration/test_tinker_joined_step.py and the whole path on a live service in
tests/integration/test_tinker_serve.py. Real asyncio loop, real FutureStore; the loop's
thread is a real thread."""

from __future__ import annotations

import asyncio

import pytest

from api.tinker.coalescer import Coalescer, Op
from api.tinker.futures import FutureStore, Outcome
from tests.waiting import wait_until
from trainer.tinker_ops import Call, CallResult

DEADLINE_S = 60.0


class World:
    def __init__(self, loop_active: bool, join_wait_s: float):
        self.store = FutureStore(poll_s=DEADLINE_S)
        self.passes: list[list[str]] = []  # the coalescer's own forward_backward passes (call tags)
        self.ran: list[str] = []  # other operations, in run order
        self.coalescer = Coalescer(self._fb, self.store, window_s=0.01)
        self.active = loop_active
        self.coalescer.join_loop(lambda: self.active, join_wait_s)

    def _fb(self, calls: list[Call]) -> list[CallResult]:
        self.passes.append([c.loss_fn for c in calls])
        return [CallResult(metrics={"tag": 0.0}) for _ in calls]

    def fb(self, model: str, tag: str) -> str:
        rid = self.store.create("t", model)
        call = Call(slot=0, data=[], loss_fn=tag)
        self.coalescer.submit(Op(model, rid, call=call, to_outcome=lambda r, tag=tag: Outcome(json={"fb": tag})))
        return rid

    def single(self, model: str, tag: str) -> str:
        rid = self.store.create("t", model)

        def run(tag=tag):
            self.ran.append(tag)
            return Outcome(json={"op": tag})

        self.coalescer.submit(Op(model, rid, run=run))
        return rid

    async def result(self, rid: str) -> dict:
        out = await self.store.retrieve("t", rid)
        assert out is not None, f"{rid} not resolved within {DEADLINE_S} s"
        return out.json

    async def take_on_thread(self) -> list[Op]:
        return await asyncio.to_thread(self.coalescer.take_forward_backward)


def run_async(coro_fn):
    async def main():
        world = await coro_fn()
        await world.coalescer.stop()

    asyncio.run(main())


def test_loop_takes_head_runs_only_and_the_model_waits_for_its_results():
    async def scenario():
        w = World(loop_active=True, join_wait_s=DEADLINE_S)  # the loop is training: calls are left for it
        a1, a2, a3 = w.fb("A", "a1"), w.fb("A", "a2"), w.single("A", "a3-optim")
        a4 = w.fb("A", "a4")
        b1 = w.fb("B", "b1")
        taken = await w.take_on_thread()
        assert [op.call.loss_fn for op in taken] == ["a1", "a2", "b1"]  # never past A's optim_step
        assert await w.take_on_thread() == []  # A and B are busy until their results come back
        c1 = w.single("C", "c1")  # another model's operation runs meanwhile ...
        assert await w.result(c1) == {"op": "c1"}
        assert "a3-optim" not in w.ran  # ... but not A's optim_step: its forward_backwards are still riding
        await asyncio.to_thread(w.coalescer.deliver, taken, [CallResult() for _ in taken])
        assert [await w.result(r) for r in (a1, a2, b1)] == [{"fb": "a1"}, {"fb": "a2"}, {"fb": "b1"}]
        assert await w.result(a3) == {"op": "a3-optim"}  # now, in order
        w.active = False  # the loop goes idle: A's next forward_backward runs in the coalescer's own round
        assert await w.result(a4) == {"fb": "a4"}
        assert w.passes == [["a4"]]
        stats = w.coalescer.stats()
        assert (stats["joined_steps"], stats["joined_calls"], stats["mixed_steps"], stats["forward_backward_calls"]) == (1, 3, 2, 4)
        return w

    run_async(scenario)


def test_failed_loop_step_fails_its_riders_only():
    async def scenario():
        w = World(loop_active=True, join_wait_s=DEADLINE_S)
        a1 = w.fb("A", "a1")
        taken = await w.take_on_thread()
        b1 = w.single("B", "b1")
        await asyncio.to_thread(w.coalescer.fail, taken, "RuntimeError: trainer rank died")
        got = await w.result(a1)
        assert got["category"] == "server" and "trainer rank died" in got["error"]
        assert await w.result(b1) == {"op": "b1"}
        assert w.coalescer.stats()["joined_steps"] == 0
        return w

    run_async(scenario)


@pytest.mark.parametrize("loop_active, join_wait_s", [(False, DEADLINE_S), (True, 0.2)])
def test_calls_never_wait_on_an_idle_loop(loop_active, join_wait_s):
    """Idle loop: the coalescer's own round runs the calls. Busy loop that does not come back:
    the coalescer runs them once join_wait_s has passed."""

    async def scenario():
        w = World(loop_active=loop_active, join_wait_s=join_wait_s)
        rids = [w.fb("A", "a1"), w.fb("B", "b1")]
        assert [await w.result(r) for r in rids] == [{"fb": "a1"}, {"fb": "b1"}]
        assert sorted(t for p in w.passes for t in p) == ["a1", "b1"]
        assert w.coalescer.stats()["joined_steps"] == 0
        return w

    run_async(scenario)


def test_take_before_start_and_bad_wait():
    w = Coalescer(lambda calls: [], FutureStore())
    assert w.take_forward_backward() == []  # not started: nothing pending, nothing to join
    with pytest.raises(ValueError, match="join_wait_s must be >= 0"):
        w.join_loop(lambda: True, -1.0)


class SlotsFake:
    """A FAKE of the backend's slot side (api/tinker/backend.py admit/is_resident), named as such:
    which models are resident is a set the test changes, and ``admit`` brings a wanted evicted
    model in only when the test has freed a slot for it (else it names it as waiting). What is
    under test is the coalescer's side: the loop never takes a non-resident model's call, and
    admit is told which models are busy (a call riding in the loop's step)."""

    def __init__(self, resident: set[str]):
        self.resident = set(resident)
        self.free_slots = 0
        self.events: list[str] = []  # "in:<model>" when admitted, in order with the passes
        self.busy_seen: list[set[str]] = []

    def admit(self, wanted: set[str], busy: set[str]) -> dict[str, str]:
        self.busy_seen.append(set(busy))
        waiting = {}
        for m in sorted(wanted - self.resident):
            if self.free_slots > 0:
                self.free_slots -= 1
                self.resident.add(m)
                self.events.append(f"in:{m}")
            else:
                waiting[m] = "waiting for a trainer slot: fake"
        return waiting

    def is_resident(self, model: str) -> bool:
        return model in self.resident


def slots_world(fake: SlotsFake) -> World:
    w = World(loop_active=True, join_wait_s=DEADLINE_S)  # the loop trains: resident heads are left for it
    w.coalescer = Coalescer(w._fb, w.store, window_s=0.01, admit=fake.admit, tick_s=0.05, resident=fake.is_resident)
    w.coalescer.join_loop(lambda: w.active, DEADLINE_S)
    return w


def test_loop_never_takes_an_evicted_models_call_admit_brings_it_in_first():
    async def scenario():
        fake = SlotsFake(resident={"R"})
        w = slots_world(fake)
        e1, r1 = w.fb("E", "e1"), w.fb("R", "r1")  # E is evicted, no slot free: it waits
        await asyncio.to_thread(lambda: wait_until(lambda: "E" in w.store.waiting, "E waiting", DEADLINE_S))
        taken = await w.take_on_thread()
        assert [op.call.loss_fn for op in taken] == ["r1"]  # never E's: it holds no slot
        # R rides in the loop's step: the next admit (the tick's) is told it is busy (never evicted)
        n = len(fake.busy_seen)
        await asyncio.to_thread(lambda: wait_until(lambda: len(fake.busy_seen) > n, "a busy set seen", DEADLINE_S))
        assert "R" in fake.busy_seen[n], fake.busy_seen[n]
        assert w.passes == [] and await w.take_on_thread() == []  # E still waits, R still riding
        w.coalescer.deliver(taken, [CallResult(metrics={"tag": 0.0})])
        assert await w.result(r1) == {"fb": "r1"}
        fake.free_slots = 1  # a slot frees: the tick's admit brings E in; the loop may take it from then on
        await asyncio.to_thread(lambda: wait_until(lambda: fake.events == ["in:E"]))
        taken = await w.take_on_thread()
        assert [op.call.loss_fn for op in taken] == ["e1"]
        w.coalescer.deliver(taken, [CallResult(metrics={"tag": 0.0})])
        assert await w.result(e1) == {"fb": "e1"}
        return w

    run_async(scenario)


def test_hold_idle_refuses_models_with_queued_or_taken_calls_and_keeps_takers_off():
    async def scenario():
        fake = SlotsFake(resident={"A", "C", "D", "X"})
        w = slots_world(fake)
        a1 = w.fb("A", "a1")
        taken = await w.take_on_thread()  # A's call rides in the loop's step
        assert [op.call.loss_fn for op in taken] == ["a1"]
        with w.coalescer.hold_idle("A") as idle:
            assert not idle  # riding in the loop: never evicted
        d1 = w.fb("D", "d1")  # left for the loop: queued
        with w.coalescer.hold_idle("D") as idle:
            assert not idle  # a queued call: never evicted
        w.active = False  # from here on the coalescer's own rounds take every head they may
        assert await w.result(d1) == {"fb": "d1"}
        with w.coalescer.hold_idle("C") as idle:
            assert idle  # nothing queued or taken: C may be evicted ...
            c1 = w.fb("C", "c1")  # ... and a call coming in meanwhile is taken by neither taker:
            assert await w.take_on_thread() == []
            x = w.single("X", "x")  # a round after c1 was queued (it would have taken c1 with x)
            assert await w.result(x) == {"op": "x"}
            assert ["c1"] not in w.passes
            fake.resident.discard("C")  # the eviction ends with C out of its slot
        await asyncio.to_thread(lambda: wait_until(lambda: "C" in w.store.waiting))  # no slot free
        fake.free_slots = 1
        assert await w.result(c1) == {"fb": "c1"}  # the tick's admit brought C back in, then it ran
        assert fake.events == ["in:C"] and w.passes[-1] == ["c1"]
        w.coalescer.deliver(taken, [CallResult(metrics={"tag": 0.0})])
        assert await w.result(a1) == {"fb": "a1"}
        return w

    run_async(scenario)


