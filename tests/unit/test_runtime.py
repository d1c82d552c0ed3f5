"""FleetRuntime (service/fleet/fleet_runtime.py) step by step, driven by the real Controller over its SQLite
registry, against FAKES of the trainer and the rollout worker (tests/fleet_fakes.py says what they do).

Covered: a run's lifecycle (prepare with the controller's version, a round, publish, checkpoint,
finish with ONE export write, release), a failed round (nothing counted, SFT rows served again),
a lost trainer (TrainerLost, every run re-prepared from its checkpoint), a failed publish (reported by
check_engines), a dead engine (restarted), staleness from the rollout buffer's stamps, drain,
GET /v1/fleet's process list, and an RL run's exact total_steps over an estimated data file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.tenants.batches import TrainerLost
from service.registry.registry import AdapterState as S
from tests.fleet_fakes import FakeRollout, FakeTrainer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def job(tiny_world):
    from service.cli import TINY_JOB
    from service.config.job import load_job

    job = load_job(TINY_JOB)
    return job.model_copy(update={"adapters": [], "base_model": job.base_model.model_copy(update={"path": str(tiny_world / "model")})})


@pytest.fixture
def fleet(job, tiny_world, tmp_path):
    """(controller, runtime, trainer, rollout, data dir): real Controller and FleetRuntime over the fakes."""
    from service.config.settings import load_settings
    from service.control.controller import Controller
    from service.fleet.fleet_runtime import FleetRuntime

    data = tmp_path / "data"
    data.mkdir()
    for name in ("echo_sft", "digits"):
        rows = (tiny_world / "data" / f"{name}.jsonl").read_text().splitlines()[:24]
        (data / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    settings = load_settings(state_dir=tmp_path / "state", data_roots=[data])
    trainer, rollout = FakeTrainer(), FakeRollout(prompts=6)
    controller = Controller(settings, job.capacity)
    runtime = FleetRuntime(job, settings, trainer=trainer, rollout=rollout)
    controller.attach_runtime(runtime)
    try:
        yield controller, runtime, trainer, rollout, data
    finally:
        controller.close()


def sft(data: Path, **over) -> dict:
    return {"objective": "sft", "rank": 4, "alpha": 8, "data": {"path": str(data / "echo_sft.jsonl")},
            "prompts_per_step": 4, "checkpoint_interval": 0, **over}


def rl(data: Path, **over) -> dict:
    return {"objective": "rl", "rank": 4, "alpha": 8, "data": {"path": str(data / "digits.jsonl")},
            "reward": {"name": "target_share"}, "prompts_per_step": 2, "max_staleness": 1,
            "sampling": {"n_samples_per_prompt": 2, "max_new_tokens": 4}, "checkpoint_interval": 0, **over}


def ready_of(runtime, *registration_ids):
    """The scheduler's gather, over these runs only: (tenant, slot) of each that has a whole step ready."""
    return [(t, slot) for t, slot, _ in runtime.scheduler.residents() if t.key in registration_ids and t.ready()]


def round_of(runtime, *registration_ids):
    """One round (FleetRuntime.train_round) over these runs: their ready steps in one trainer call."""
    return runtime.train_round(ready_of(runtime, *registration_ids))


def one_step(controller, runtime, registration_id: str):
    """One round, publish and record of one run's step, as the loop does."""
    outcome = round_of(runtime, registration_id)
    assert not outcome.empty
    (stepped,) = outcome.stepped
    version = controller.next_version()
    runtime.publish(registration_id, version)
    controller.record_step(registration_id, step=stepped.step, samples=stepped.samples, metrics=stepped.metrics,
                           weight_version=version)
    return stepped


def test_lifecycle_of_one_sft_run(fleet):
    controller, runtime, trainer, _, data = fleet
    ref = controller.register("a", sft(data))
    [change] = controller.reconcile()
    assert (change.from_state, change.to_state) == (S.PENDING, S.ACTIVE)
    ref = controller.get("a")
    assert runtime.runs() == [ref.registration_id]
    assert trainer.slots[ref.slot] == {"registration": ref.registration_id, "step": 0}
    assert ref.weight_version is not None and runtime._run(ref.registration_id).weight_version == ref.weight_version

    outcome = round_of(runtime, ref.registration_id)
    assert len(outcome.samples) == 4 and {s.registration for s in outcome.samples} == {ref.registration_id}
    assert [(s.step, s.samples) for s in outcome.stepped] == [(1, 4)] and outcome.failed == {}
    assert outcome.stepped[0].metrics["loss"] == 1.0

    folder = runtime.checkpoint(ref.registration_id)
    assert Path(folder, "run_state.json").is_file() and Path(folder, "trainer", "slot.json").is_file()

    controller.retire("a")
    exports_before = sum(c[0] == "export_peft" for c in trainer.calls)
    changes = controller.reconcile()
    assert [(c.from_state, c.to_state) for c in changes] == [(S.RETIRING, S.CLEANUP), (S.CLEANUP, S.COMPLETED)]
    done = controller.get("a")
    # nothing trained since the checkpoint above: retirement keeps it as the final one (write_checkpoint) and
    # writes no PEFT export again; the checkpoint's is linked as the run's export folder
    assert sum(c[0] == "export_peft" for c in trainer.calls) == exports_before
    assert done.checkpoint_path == folder
    export, final = Path(done.export_path), Path(done.checkpoint_path) / "adapter"
    assert export.name == "export" and os.path.samefile(export / "adapter_model.safetensors", final / "adapter_model.safetensors")
    assert runtime.runs() == [] and ref.slot not in trainer.slots  # released


def test_a_failed_train_call_counts_nothing_and_serves_the_same_rows_again(fleet):
    controller, runtime, trainer, _, data = fleet
    ref = controller.register("a", sft(data))
    controller.reconcile()
    first = ready_of(runtime, ref.registration_id)
    offered = first[0][0]._ready[1]  # the step the run offers: its samples, taken from its data
    trainer.fail_next = RuntimeError("CUDA out of memory (planted)")
    with pytest.raises(RuntimeError, match="planted"):
        runtime.train_round(first)
    assert trainer.slots[ref.slot]["step"] == 0
    again = round_of(runtime, ref.registration_id)
    assert [s.tokens for s in again.samples] == [s.tokens for s in offered]  # given back, served first
    assert [s.step for s in again.stepped] == [1]


def test_a_lost_trainer_raises_trainer_lost_and_runs_resume_from_their_checkpoints(fleet):
    controller, runtime, trainer, rollout, data = fleet
    a = controller.register("a", sft(data))
    b = controller.register("b", rl(data))
    controller.reconcile()
    for _ in range(2):
        for reg in (a.registration_id, b.registration_id):
            s = one_step(controller, runtime, reg)
            controller.record_checkpoint(reg, runtime.checkpoint(reg), s.step)
    one_step(controller, runtime, a.registration_id)  # step 3 of a: not checkpointed

    trainer.kill()
    with pytest.raises(TrainerLost, match="FakeRankDied"):
        round_of(runtime, a.registration_id)
    assert runtime.trainer_lost()
    lost = runtime.restart_trainer()
    assert sorted(lost) == sorted([a.registration_id, b.registration_id]) and runtime.runs() == []
    assert ("remove_adapter", "b") in rollout.calls
    controller.attach_runtime(runtime)  # what the loop does: the controller re-prepares every live run
    controller.reconcile()
    assert sorted(runtime.runs()) == sorted([a.registration_id, b.registration_id])
    assert [c for c in trainer.calls if c[0] == "load_slot_state"] == [
        ("load_slot_state", a.slot, a.registration_id), ("load_slot_state", b.slot, b.registration_id)]
    assert trainer.slots[a.slot]["step"] == 2 and controller.get("a").step == 2  # back at the checkpoint
    assert [r.step for r in controller.metrics("a").steps] == [1, 2]  # step 3 dropped, to be redone
    assert one_step(controller, runtime, a.registration_id).step == 3


def test_a_failed_publish_is_settled_with_a_republish_and_reported_once(fleet):
    controller, runtime, _, rollout, data = fleet
    b = controller.register("b", rl(data))
    controller.reconcile()
    assert runtime.settle_publishes() == []
    rollout.fail_publish = RuntimeError("engine refused the LoRA (planted)")
    stepped = one_step(controller, runtime, b.registration_id)
    [p] = runtime.settle_publishes()
    assert p.error is not None and "planted" in p.error and p.republish  # the run's newest version: publish it again
    assert runtime.settle_publishes() == []  # reported once
    for _ in range(3):  # failures in a row: republished up to REPUBLISH_AT_MOST times, then left to the next step
        runtime.publish(b.registration_id, controller.next_version())
        [p] = runtime.settle_publishes()
    assert not p.republish and stepped.step == 1
    rollout.fail_publish = None
    one_step(controller, runtime, b.registration_id)
    [p] = runtime.settle_publishes()
    assert p.error is None


def test_the_registry_says_served_only_once_the_publish_finished(fleet):
    """Issue 18 item 4: the step's version is recorded at once, the run's weight_version (what the engines
    serve) only when the publish settled."""
    from tests.fleet_fakes import FakeRef

    controller, runtime, _, rollout, data = fleet
    b = controller.register("b", rl(data))
    controller.reconcile()
    before = controller.get("b").weight_version
    held = FakeRef(done=False)
    rollout.publish_version = lambda name, version, weights: held  # a publish the engines have not finished
    (s,) = round_of(runtime, b.registration_id).stepped
    version = controller.next_version()
    assert runtime.publish(b.registration_id, version) is True  # the engines load it in the background
    controller.record_step(b.registration_id, step=s.step, samples=s.samples, metrics=s.metrics, weight_version=version, served=False)
    assert controller.get("b").weight_version == before and controller.metrics("b").steps[-1].weight_version == version
    assert runtime.settle_publishes() == [] and runtime.publisher.in_flight() == 1
    held.done = True
    [p] = runtime.settle_publishes()
    controller.mark_served(p.registration_id, p.version)
    assert controller.get("b").weight_version == version
    controller.mark_served(p.registration_id, before)  # a late report never moves it back
    assert controller.get("b").weight_version == version


def test_a_dead_engine_is_restarted(fleet):
    _, runtime, _, rollout, _ = fleet
    rollout.engine_alive = False
    assert not runtime.ready()["engine-0"].ok
    assert runtime.check_engines() == ["engine 0 was dead: restarting it; training goes on, generation waits for an engine"]
    [event] = runtime.check_engines()  # the restart (finished at once here) is reported by the next check
    assert event.startswith("engine 0 was dead: restarted") and rollout.engine_starts == 2
    assert runtime.ready()["engine-0"].ok
    assert runtime.check_engines() == []


def test_training_goes_on_while_an_engine_restarts(fleet):
    """Issue 14 F6: check_engines starts the restart and returns; SFT runs and RL runs with groups
    already generated step while it is in flight; the engine is restarted once, not at every check."""
    controller, runtime, _, rollout, data = fleet
    a = controller.register("a", sft(data))
    b = controller.register("b", rl(data))
    controller.reconcile()
    rollout.engine_alive, rollout.hold_restart = False, True
    [event] = runtime.check_engines()
    assert "restarting it" in event and runtime.health.restarting_engines() == [0]
    assert not runtime.ready()["engine-0"].ok and "(restarting)" in runtime.ready()["engine-0"].detail
    one_step(controller, runtime, a.registration_id)
    one_step(controller, runtime, b.registration_id)  # groups generated before the engine died
    assert controller.get("a").step == 1 and controller.get("b").step == 1
    assert runtime.check_engines() == []  # still restarting: not restarted again
    assert [c for c in rollout.calls if c[0] == "restart_engine"] == [("restart_engine", 0)]
    rollout.finish_restart()
    [event] = runtime.check_engines()
    assert event.startswith("engine 0 was dead: restarted") and runtime.health.restarting_engines() == []
    assert runtime.ready()["engine-0"].ok


def test_a_failed_engine_restart_is_reported_and_tried_again(fleet):
    _, runtime, _, rollout, _ = fleet
    rollout.engine_alive, rollout.hold_restart = False, True
    runtime.check_engines()
    [ref] = rollout.restart_refs
    ref.error, ref.done = RuntimeError("server not ready in 300 s (planted)"), True
    events = runtime.check_engines()
    assert "its restart failed" in events[0] and "planted" in events[0], events
    assert events[1].startswith("engine 0 was dead: restarting it"), events  # the same check starts another
    assert [c for c in rollout.calls if c[0] == "restart_engine"] == [("restart_engine", 0)] * 2


def test_rl_staleness_is_the_rollout_buffers_stamp(fleet):
    controller, runtime, _, rollout, data = fleet
    rollout.ahead = 6  # every prompt generated at once, by the weights the run was prepared with
    b = controller.register("b", rl(data))
    controller.reconcile()
    first = one_step(controller, runtime, b.registration_id)
    assert first.metrics["staleness_mean"] == 0.0  # generated by the weights it was prepared with
    # groups already generated (v_prepare) are one publish behind now: usable (max_staleness 1), stamped 1
    second = one_step(controller, runtime, b.registration_id)
    assert second.metrics["staleness_mean"] == 1.0
    # and two publishes behind: dropped by the buffer, never trained
    assert round_of(runtime, b.registration_id).empty and rollout.adapters["b"].buffer.dropped_stale == 2


def test_drain_pauses_generation_and_checkpoints_every_live_run(fleet):
    controller, runtime, _, rollout, data = fleet
    a = controller.register("a", sft(data))
    b = controller.register("b", rl(data))
    controller.reconcile()
    one_step(controller, runtime, a.registration_id)
    drained = runtime.drain()
    assert sorted(drained) == sorted([a.registration_id, b.registration_id])
    assert drained[a.registration_id][1] == 1 and drained[b.registration_id][1] == 0
    assert all(Path(folder, "run_state.json").is_file() for folder, _ in drained.values())
    assert ("abort_adapter", "b", True) in rollout.calls and rollout.adapters["b"].paused


def test_processes_lists_every_component_with_its_pid(fleet):
    controller, runtime, trainer, _, _ = fleet
    procs = {p.name: (p.role, p.pid) for p in controller.processes()}
    assert procs == {"coordinator": ("coordinator", os.getpid()), "trainer-rank-0": ("trainer", 4242),
                     "rollout-worker": ("rollout", 4343), "engine-0": ("engine", 4444)}
    nodes = {p.name: (p.node_id, p.node_ip) for p in controller.processes()}  # each process with the node it reports
    assert nodes["trainer-rank-0"][0] == "f" * 56 and nodes["rollout-worker"] == ("a" * 56, "10.0.0.5")
    assert nodes["engine-0"] == ("b" * 56, "10.0.0.6")
    trainer.stop("stopped (test)")
    assert [p.name for p in controller.processes()] == ["coordinator", "rollout-worker", "engine-0"]


def test_prepare_uses_the_version_the_controller_assigns(fleet):
    controller, runtime, _, rollout, data = fleet
    before = controller.next_version()
    b = controller.register("b", rl(data))
    controller.reconcile()
    ref = controller.get("b")
    assert ref.weight_version > before
    assert ("add_adapter", "b", ref.weight_version) in rollout.calls  # the rollout starts at that version


def test_a_retire_racing_the_loops_prepare_still_retires(fleet):
    """The tenant asks to retire a PENDING run while the loop prepares it (PENDING -> ACTIVE between the
    controller's read and its change, as the fleet load test hit with fast handoff loads): it retires,
    no 409. The interleaving is forced by running the loop's reconcile inside the first transition call."""
    controller, _, _, _, data = fleet
    controller.register("r", sft(data))
    real = controller.registry.transition
    calls = []

    def loop_prepares_first(*args, **kwargs):
        if not calls:
            controller.reconcile()  # the loop's step, just before the retire's compare-and-set
        calls.append(kwargs.get("expect"))
        return real(*args, **kwargs)

    controller.registry.transition = loop_prepares_first
    try:
        assert controller.retire("r").state == S.RETIRING
    finally:
        controller.registry.transition = real
    assert calls[0] == S.PENDING and calls[-1] == S.ACTIVE  # refused once (it had become ACTIVE), then retired as ACTIVE


def test_an_rl_run_over_an_estimated_file_gets_the_exact_total_before_its_schedule_is_set(fleet, monkeypatch):
    """An RL run's data source opens in the rollout worker only after init_slot, so the runtime counts the rows
    itself (rollout.data.open_rows) when registration estimated them (a .jsonl past data_check_bytes): the slot's
    schedule gets the exact total and the registry records it. The real trainer's schedule over that total is
    checked end to end for SFT in tests/integration/test_service_resume.py."""
    controller, runtime, trainer, _, data = fleet
    check = 1024
    for owner in (controller, runtime):
        monkeypatch.setattr(owner, "settings", owner.settings.model_copy(update={"data_check_bytes": check}))
    short = "".join(f'{{"prompt": "p{i}", "label": "1"}}\n' for i in range(40))  # the checked prefix: short rows only
    long = "".join(f'{{"prompt": "q{i} {" ".join(str(j) for j in range(60))}", "label": "1"}}\n' for i in range(30))
    assert len(short) > check and len(long) > 3 * len(short)
    (data / "estimated.jsonl").write_text(short + long)
    hypers = []
    real_init = trainer.init_slot
    monkeypatch.setattr(trainer, "init_slot", lambda slot, hyper, *a, **k: (hypers.append(hyper), real_init(slot, hyper, *a, **k))[1])

    registered = controller.register("est", {**rl(data, lr_schedule="cosine"), "data": {"path": str(data / "estimated.jsonl")}})
    exact = 70 // 2  # rows // prompts_per_step (one epoch)
    assert registered.total_steps > exact + 10, registered.total_steps
    controller.reconcile()
    ref = controller.get("est")
    assert ref.state == S.ACTIVE and ref.total_steps == exact, ref
    assert [h.total_steps for h in hypers] == [exact]


def test_a_superseded_publish_is_neither_served_nor_republished(fleet):
    """Latest-wins (issue 28): the rollout worker reports a version that a newer one of the run
    replaced before it was written or loaded as superseded. Settling leaves it out (the loop
    neither marks it served nor publishes it again) and the newer one settles as served."""
    from rollout.messages import PUBLISH_LOADED, PUBLISH_SUPERSEDED
    from service.loop.training_loop import LoopReport, _settle
    from tests.fleet_fakes import FakeRef

    controller, runtime, _, rollout, data = fleet
    b = controller.register("b", rl(data))
    controller.reconcile()
    before = controller.get("b").weight_version
    newer = FakeRef(value=PUBLISH_LOADED, done=False)  # the engines still load the newer version
    answers = iter([FakeRef(value=PUBLISH_SUPERSEDED), newer])
    calls = []

    def publish_version(name, version, weights):
        calls.append(version)
        return next(answers)

    rollout.publish_version = publish_version
    report = LoopReport()
    for _ in range(2):  # two steps, as the loop records them: served only once the publish settles
        (s,) = round_of(runtime, b.registration_id).stepped
        version = controller.next_version()
        assert runtime.publish(b.registration_id, version) is True
        controller.record_step(b.registration_id, step=s.step, samples=s.samples, metrics=s.metrics,
                               weight_version=version, served=False)
    assert runtime.settle_publishes() == []  # the superseded one is left out; the newer one still loads
    assert runtime.publisher.superseded == 1 and runtime.publisher.in_flight() == 1
    assert controller.get("b").weight_version == before  # the superseded version was never served
    newer.done = True
    settled = runtime.settle_publishes()
    assert [(p.version, p.error) for p in settled] == [(calls[1], None)]
    for p in settled:
        _settle(controller, runtime, p, report)  # what the loop does with the outcomes
    assert len(calls) == 2 and report.events == []  # nothing published again, nothing reported as failed
    assert before < calls[0] < calls[1] == controller.get("b").weight_version
