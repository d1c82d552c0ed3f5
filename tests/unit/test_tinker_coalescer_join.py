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
