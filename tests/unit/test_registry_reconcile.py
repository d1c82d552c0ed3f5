"""Controller + registry: registration checks and reconcile's state machine.

The runtime here is a FAKE (`ScriptedRuntime`): it records calls and raises where
a row tells it to. It stands in for the training loop's runtime only to cause
the faults the controller must survive (a prepare that raises, an export that is
not a PEFT folder); the real runtime is exercised by the service's end-to-end
tests. Everything else (controller, registry, SQLite, checks) is real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config.job import SlotCapacity
from service.config.settings import load_settings
from service.control.controller import Controller
from service.errors import BadValue, Conflict, NoFreeSlot, NotFound
from service.registry.registry import AdapterState as S
from service.control.runtime_protocol import ComponentHealth, Finished, Prepared, RuntimeStats, run_dir
from service.scheduling.scheduler import Scheduler
from service.scheduling.tenant import TenantKind

pytestmark = pytest.mark.unit


class ScriptedRuntime:
    """FAKE runtime (see module doc): `fail_on[(method, name)] = message` makes that call raise. Its
    scheduler is the real one (service/scheduling/scheduler.py) over the controller's registry; the trainer the
    scheduler swaps through is this fake too (swap_out records "evict", swap_in "restore"), and each
    prepared run is a scripted tenant whose steps and readiness the test sets (`steps_in`, `ready_step`)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.calls: list[tuple[str, str]] = []
        self.fail_on: dict[tuple[str, str], str] = {}
        self.bad_export: set[str] = set()
        self.versions: dict[str, int] = {}  # name -> the weight version the controller passed to prepare
        self.steps_in: dict[str, int] = {}  # name -> steps since it came in (what the policy reads); resident runs only
        self.ready_step: dict[str, bool] = {}  # name -> a whole step is ready (default True)
        self.names: dict[str, str] = {}  # registration id -> name
        self.scheduler: Scheduler | None = None

    def attach(self, registry, knobs):
        if self.scheduler is None:  # a clock at 0: the scripted tenants are never idle (only turns evict)
            self.scheduler = Scheduler(registry, _ScriptedTrainer(self), knobs, clock=lambda: 0.0)
        return self.scheduler

    def _call(self, method: str, ref) -> None:
        self.calls.append((method, ref.name))
        if (method, ref.name) in self.fail_on:
            raise RuntimeError(self.fail_on[(method, ref.name)])

    def prepare_adapter(self, ref, weight_version):
        self._call("prepare", ref)
        self.versions[ref.name] = weight_version
        self.steps_in[ref.name] = 0
        self.names[ref.registration_id] = ref.name
        self.scheduler.add(_ScriptedTenant(self, ref.registration_id, ref.name, float(len(self.names))))
        return Prepared(step=ref.checkpoint_step or 0)

    def finish_adapter(self, ref):
        self._call("finish", ref)
        export = run_dir(self.state_dir, ref) / "export"
        export.mkdir(parents=True, exist_ok=True)
        if ref.name not in self.bad_export:
            (export / "adapter_config.json").write_text("{}")
            (export / "adapter_model.safetensors").write_bytes(b"")
        return Finished(export_path=str(export), checkpoint_path=str(run_dir(self.state_dir, ref) / "ckpt"),
                        checkpoint_step=ref.step)

    def release_adapter(self, ref):
        self._call("release", ref)
        self.steps_in.pop(ref.name, None)
        self.scheduler.remove(ref.registration_id)

    def abort(self, ref):
        self._call("abort", ref)
        return 3

    def ready(self):
        return {"trainer": ComponentHealth(True, "1 rank"), "engine-0": ComponentHealth(False, "starting")}

    def stats(self):
        return RuntimeStats(queue_depth={"a": 2})


class _ScriptedTrainer:
    """What the scheduler swaps through (FAKE): evict / restore recorded on the runtime's calls."""

    def __init__(self, rt: ScriptedRuntime) -> None:
        self.rt = rt

    def _ref(self, key: str):
        return type("Ref", (), {"name": self.rt.names[key]})

    def swap_out(self, slot, key):
        self.rt._call("evict", self._ref(key))
        del self.rt.steps_in[self.rt.names[key]]
        return {}

    def swap_in(self, slot, key):
        self.rt._call("restore", self._ref(key))
        self.rt.steps_in[self.rt.names[key]] = 0
        return {}


class _ScriptedTenant:
    """A prepared run as the scheduler sees it (FAKE): its counters are the runtime's scripted ones."""

    kind = TenantKind.SFT
    owner = None

    def __init__(self, rt: ScriptedRuntime, key: str, name: str, order: float) -> None:
        self.rt, self.key, self.name, self.last_active = rt, key, name, order

    @property
    def steps_in(self) -> int:
        return self.rt.steps_in.get(self.name, 0)

    def ready(self) -> bool:
        return self.rt.ready_step.get(self.name, True)

    wants_slot = ready

    def on_evicting(self, slot: int) -> None:
        pass

    def on_evicted(self) -> None:
        pass

    def on_restored(self) -> None:
        pass

    def restore_from(self):  # noqa: ANN201 - a run's state comes back from the swap store
        return None

    def release(self, reason=None) -> None:
        pass


def reconcile(controller, rt: ScriptedRuntime):
    """The loop's steps 1a and 1b: the scheduler's placement (runs it could not keep are failed), then
    the controller's reconcile; its changes."""
    if rt.scheduler is not None:
        rt.scheduler.place()
        for registration_id, reason in rt.scheduler.take_failures().items():
            controller.fail(registration_id, reason)
    return controller.reconcile()


@pytest.fixture
def world(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "rl.jsonl").write_text("".join(f'{{"prompt": "p{i}", "label": "0123"}}\n' for i in range(10)))
    settings = load_settings(state_dir=tmp_path / "state", data_roots=[data])
    controller = Controller(settings, SlotCapacity(num_slots=2, max_rank=16))
    yield controller, data
    controller.close()


def cfg(data: Path, **over):
    return {"data": {"path": str(data / "rl.jsonl")}, "reward": {"name": "target_share"}, **over}


def test_register_checks_and_total_steps(world):
    controller, data = world
    ref = controller.register("a", cfg(data, num_epoch=2, prompts_per_step=3))
    # 10 rows x 2 epochs = 20 rows make 6 whole steps of 3; the last 2 rows are dropped, not a 7th, partial
    # step (planned_steps: the plan is the steps the run takes)
    assert (ref.state, ref.slot, ref.total_steps) == (S.PENDING, 0, 6)
    assert ref.config.data.path == str((data / "rl.jsonl").resolve())
    with pytest.raises(BadValue, match="rank 32 is above the service's max rank 16; allowed: 1..16"):
        controller.register("b", cfg(data, rank=32))
    with pytest.raises(BadValue, match="adapter name 'a::b' is not allowed"):
        controller.register("a::b", cfg(data))
    with pytest.raises(BadValue, match=r"config.num_step: Input should be greater than or equal to 1"):
        controller.register("b", cfg(data, num_step=0))
    with pytest.raises(Conflict, match="in use by a live run"):
        controller.register("a", cfg(data))
    with pytest.raises(BadValue, match=r"config.prompts_per_step: a step takes 11 rows .* rl.jsonl has 10 row\(s\) x 1 epoch\(s\) "
                                       r"\(num_epoch\) = 10, so the run would end without a single step; allowed: prompts_per_step at most 10"):
        controller.register("b", cfg(data, prompts_per_step=11))
    assert [r.name for r in controller.list()] == ["a"]  # refused calls changed nothing


def test_no_runtime_reconcile_does_nothing(world):
    controller, data = world
    controller.register("a", cfg(data))
    controller.retire("a")
    assert controller.reconcile() == []
    assert controller.get("a").state == S.RETIRING
    assert controller.abort("a") == 0
    ready = controller.ready()
    assert ready["ready"] is False and "no runtime attached" in ready["components"]["runtime"]["detail"]


def test_reconcile_lifecycle_and_slot_reuse(world, tmp_path):
    controller, data = world
    rt = ScriptedRuntime(tmp_path / "state")
    controller.attach_runtime(rt)
    a = controller.register("a", cfg(data))
    b = controller.register("b", cfg(data))
    changes = reconcile(controller, rt)
    assert [(c.name, c.from_state, c.to_state) for c in changes] == [("a", S.PENDING, S.ACTIVE), ("b", S.PENDING, S.ACTIVE)]
    # the controller assigned each run's first version, passed it in and recorded it (never reused)
    assert controller.get("a").weight_version == rt.versions["a"] != rt.versions["b"] == controller.get("b").weight_version
    assert controller.abort("a") == 3
    queued = controller.register("c", cfg(data))  # beyond the slots: accepted, waits in the queue
    assert (queued.state, queued.slot, queued.queue_position) == (S.PENDING, None, 1)
    assert reconcile(controller, rt) == [] and controller.get("c").queue_position == 1  # nothing freed: it waits
    controller.record_step(a.registration_id, step=1, samples=16, metrics={"loss": 0.5, "reward_mean": 0.2})
    controller.retire("a")
    with pytest.raises(Conflict, match="already retiring"):
        controller.retire("a")
    changes = reconcile(controller, rt)
    assert [(c.name, c.to_state) for c in changes] == [("a", S.CLEANUP), ("a", S.COMPLETED)]
    done = controller.get("a")
    assert done.slot is None and done.step == 1 and Path(done.export_path, "adapter_config.json").is_file()
    assert controller.get("c").queue_position == 1  # a's slot is released first; the next pass binds it
    assert [(ch.name, ch.to_state) for ch in reconcile(controller, rt)] == [("c", S.ACTIVE)]
    c = controller.get("c")  # a's slot, its own version
    assert c.slot == a.slot and c.queue_position is None and c.slot_version > b.slot_version
    assert rt.calls == [("prepare", "a"), ("prepare", "b"), ("abort", "a"), ("finish", "a"), ("release", "a"), ("prepare", "c")]
    with pytest.raises(Conflict, match="already ended"):
        controller.retire("a")
    with pytest.raises(NotFound):
        controller.abort("zz")


def test_one_adapter_failing_leaves_the_others(world, tmp_path):
    controller, data = world
    rt = ScriptedRuntime(tmp_path / "state")
    rt.fail_on[("prepare", "a")] = "init_from weights have the wrong shape"
    rt.bad_export.add("b")
    controller.attach_runtime(rt)
    controller.register("a", cfg(data))
    controller.register("b", cfg(data))
    reconcile(controller, rt)
    a = controller.get("a")
    assert a.state == S.FAILED and a.slot is None
    assert a.failure_reason == "prepare_adapter failed: RuntimeError: init_from weights have the wrong shape"
    assert controller.get("b").state == S.ACTIVE
    controller.retire("b")
    reconcile(controller, rt)
    b = controller.get("b")
    assert b.state == S.FAILED and "lacks ['adapter_config.json', 'adapter_model.safetensors']" in b.failure_reason
    assert ("release", "a") in rt.calls and ("release", "b") in rt.calls
    assert controller.registry.free_slots() == [0, 1]


def test_restart_reprepares_live_runs(world, tmp_path):
    controller, data = world
    rt = ScriptedRuntime(tmp_path / "state")
    controller.attach_runtime(rt)
    a = controller.register("a", cfg(data))
    controller.register("never", cfg(data))
    controller.retire("never")  # retired before it trained: completes without export
    reconcile(controller, rt)
    controller.record_checkpoint(a.registration_id, "/ckpt/a", step=4)
    settings, capacity = controller.settings, controller.capacity
    controller.close()

    again = Controller(settings, capacity)
    try:
        rt2 = ScriptedRuntime(tmp_path / "state")
        again.attach_runtime(rt2)
        assert again.get("never").state == S.COMPLETED and again.get("never").export_path is None
        assert reconcile(again, rt2) == []  # ACTIVE stays ACTIVE, but its slot is restored
        assert rt2.calls == [("prepare", "a")]
        assert again.get("a").step == 4  # resumed from the checkpoint the runtime reported
    finally:
        again.close()


def test_fail_from_the_loop_releases_on_next_pass(world, tmp_path):
    controller, data = world
    rt = ScriptedRuntime(tmp_path / "state")
    controller.attach_runtime(rt)
    a = controller.register("a", cfg(data))
    reconcile(controller, rt)
    controller.fail(a.registration_id, "reward crashed 5 times in a row")
    reconcile(controller, rt)
    assert rt.calls == [("prepare", "a"), ("release", "a")]
    snap = controller.snapshot()
    assert snap.free_slots == 2 and snap.runtime.queue_depth == {"a": 2}


def test_queue_bound_and_retiring_a_queued_run(world, tmp_path):
    """Registrations beyond the slots queue FIFO up to max_live_runs (409 beyond, with the bound);
    a queued run retired before it trained completes without touching the runtime and leaves the queue."""
    _, data = world
    settings = load_settings(state_dir=tmp_path / "state2", data_roots=[data])
    controller = Controller(settings, SlotCapacity(num_slots=1, max_rank=16, max_live_runs=3))
    try:
        rt = ScriptedRuntime(tmp_path / "state2")
        controller.attach_runtime(rt)
        for name in ("a", "b", "c"):
            controller.register(name, cfg(data))
        with pytest.raises(NoFreeSlot, match="max_live_runs is 3"):
            controller.register("d", cfg(data))
        reconcile(controller, rt)
        assert [(r.name, r.state, r.slot, r.queue_position) for r in controller.list()] == [
            ("a", S.ACTIVE, 0, None), ("b", S.PENDING, None, 1), ("c", S.PENDING, None, 2)]
        controller.retire("b")
        reconcile(controller, rt)
        assert controller.get("b").state == S.COMPLETED and controller.get("b").export_path is None
        assert controller.get("c").queue_position == 1
        controller.register("d", cfg(data))  # b's place in the bound is free again
        controller.fail(controller.get("a").registration_id, "planted failure")
        reconcile(controller, rt)
        assert [(r.name, r.state, r.slot, r.queue_position) for r in controller.list()] == [
            ("a", S.FAILED, None, None), ("b", S.COMPLETED, None, None), ("c", S.ACTIVE, 0, None), ("d", S.PENDING, None, 1)]
        assert rt.calls == [("prepare", "a"), ("release", "b"), ("release", "a"), ("prepare", "c")]  # b: a no-op release
    finally:
        controller.close()


def test_turns_evict_and_restore_through_one_slot(world, tmp_path):
    """One slot, two runs: the resident gives its slot up after turn_steps (swapped out, still
    ACTIVE, residency evicted, queued); the waiter is prepared; then the first is restored (not
    prepared again). A failing swap-out fails that run only. Retiring an evicted run restores it
    to finish it."""
    _, data = world
    settings = load_settings(state_dir=tmp_path / "state3", data_roots=[data])
    controller = Controller(settings, SlotCapacity(num_slots=1, max_rank=16, turn_steps=2))
    try:
        rt = ScriptedRuntime(tmp_path / "state3")
        controller.attach_runtime(rt)
        controller.register("a", cfg(data))
        controller.register("b", cfg(data))
        reconcile(controller, rt)
        assert [(r.name, r.residency, r.queue_position) for r in controller.list()] == [("a", "resident", None), ("b", "queued", 1)]
        rt.steps_in["a"] = 1
        reconcile(controller, rt)  # a's turn is not used up
        assert controller.get("a").slot == 0 and rt.calls == [("prepare", "a")]
        rt.steps_in["a"] = 2
        reconcile(controller, rt)
        a, b = controller.get("a"), controller.get("b")
        assert (a.state, a.residency, a.slot, a.queue_position) == (S.ACTIVE, "evicted", None, 1)
        assert (b.state, b.residency, b.slot) == (S.ACTIVE, "resident", 0)
        rt.ready_step["a"] = False  # evicted with no step ready: it does not push b out
        rt.steps_in["b"] = 5
        reconcile(controller, rt)
        assert controller.get("b").slot == 0
        rt.ready_step["a"] = True
        reconcile(controller, rt)
        assert controller.get("a").slot == 0 and controller.get("b").residency == "evicted"
        assert rt.calls == [("prepare", "a"), ("evict", "a"), ("prepare", "b"), ("evict", "b"), ("restore", "a")]
        # retiring the evicted b: it comes back for its final checkpoint once a's turn is over
        controller.retire("b")
        rt.steps_in["a"] = 2
        reconcile(controller, rt)
        assert controller.get("b").state == S.COMPLETED and controller.get("a").residency == "evicted"
        assert rt.calls[-4:] == [("evict", "a"), ("restore", "b"), ("finish", "b"), ("release", "b")]
        # a swap-out that fails (disk full while spilling) fails that run only
        controller.register("c", cfg(data))
        reconcile(controller, rt)  # a restored (head of the queue)
        rt.fail_on[("evict", "a")] = "SwapError: no space left on device"
        rt.steps_in["a"] = 2
        reconcile(controller, rt)
        a = controller.get("a")
        assert a.state == S.FAILED and a.failure_reason == "evict failed: RuntimeError: SwapError: no space left on device"
        reconcile(controller, rt)
        assert controller.get("c").state == S.ACTIVE and controller.get("c").slot == 0
    finally:
        controller.close()


def test_restart_while_evicted_prepares_from_the_checkpoint(world, tmp_path):
    """The swap store does not outlive the process: after a restart an evicted run waits in the
    queue like any other and, once bound, is prepared again from its last checkpoint (not restored)."""
    _, data = world
    settings = load_settings(state_dir=tmp_path / "state4", data_roots=[data])
    capacity = SlotCapacity(num_slots=1, max_rank=16, turn_steps=1)
    controller = Controller(settings, capacity)
    rt = ScriptedRuntime(tmp_path / "state4")
    controller.attach_runtime(rt)
    a = controller.register("a", cfg(data))
    controller.register("b", cfg(data))
    reconcile(controller, rt)
    controller.record_checkpoint(a.registration_id, "/ckpt/a", step=3)
    rt.steps_in["a"] = 1
    reconcile(controller, rt)
    assert controller.get("a").residency == "evicted" and controller.get("b").residency == "resident"
    controller.close()

    again = Controller(settings, capacity)
    try:
        rt2 = ScriptedRuntime(tmp_path / "state4")
        again.attach_runtime(rt2)
        reconcile(again, rt2)  # b holds the slot (prepared again); a waits, evicted, first in the queue
        assert rt2.calls == [("prepare", "b")] and again.get("a").queue_position == 1
        rt2.steps_in["b"] = 1
        reconcile(again, rt2)
        assert rt2.calls == [("prepare", "b"), ("evict", "b"), ("prepare", "a")]  # a: prepared, not restored
        assert again.get("a").step == 3 and again.get("a").slot == 0
    finally:
        again.close()
