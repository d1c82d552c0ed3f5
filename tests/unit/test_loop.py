"""The training loop (service/loop/training_loop.py) end to end in one process: the real Controller and registry, the real
FleetRuntime, and FAKES of the trainer and the rollout worker (tests/fleet_fakes.py). Batch mode runs every
run to COMPLETED; the faults are planted through the fakes: a failed train call, a trainer lost in a train
call and one lost while idle, a failed publish, an adapter whose steps are all non-finite; and a stop drains.
"""

from __future__ import annotations

import threading
import time

import pytest

from service.loop.training_loop import LoopOptions, run_training_loop
from service.registry.registry import AdapterState as S
from service.shutdown import StopSignal
from tests.fleet_fakes import FakeRankDied
from tests.unit.test_runtime import fleet, job, rl, sft  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]  # a broken loop hangs in batch mode: fail instead

FAST = LoopOptions(batch_mode=True, max_wait_s=0.01, engine_check_s=1e-6, max_round_errors=3)  # checks every round


def run(controller, runtime, opts=FAST, stop=None, on_round=None):
    report = run_training_loop(controller, runtime, opts, stop or StopSignal(), on_round=on_round)
    return report


def steps_of(controller, name):
    return [s.step for s in controller.metrics(name).steps]


def test_batch_mode_trains_every_run_to_completed(fleet):
    controller, runtime, trainer, rollout, data = fleet
    controller.register("a", sft(data, num_step=3, checkpoint_interval=2))
    controller.register("b", rl(data))  # 6 prompts, 2 per step: 3 steps, then its data is used up
    report = run(controller, runtime)
    assert report.stopped_by is None and report.steps == 6 and report.train_calls == 3  # mixed calls
    for name in ("a", "b"):
        ref = controller.get(name)
        assert ref.state == S.COMPLETED and ref.step == 3 and steps_of(controller, name) == [1, 2, 3]
        assert ref.export_path and ref.export_path.endswith("export")
    assert controller.get("a").checkpoint_path.endswith("step-000003")  # the final one (2 was the interval's)
    assert [c for c in rollout.calls if c[0] == "publish_version"] == [
        ("publish_version", "b", v) for v in sorted(s.weight_version for s in controller.metrics("b").steps)]
    # G3: the served version moved to the last step's once that publish settled (the next round)
    assert controller.get("b").weight_version == max(s.weight_version for s in controller.metrics("b").steps)
    assert trainer.slots == {}  # every slot released


def test_a_failed_train_call_is_retried_and_counts_nothing(fleet):
    controller, runtime, trainer, _, data = fleet
    controller.register("a", sft(data, num_step=2))
    trainer.fail_next = RuntimeError("planted: one train call fails")
    report = run(controller, runtime)
    assert any("round failed (1 in a row): RuntimeError: planted" in e for e in report.events)
    assert controller.get("a").state == S.COMPLETED and steps_of(controller, "a") == [1, 2]


def test_rounds_failing_in_a_row_end_the_loop(fleet):
    controller, runtime, trainer, _, data = fleet
    controller.register("a", sft(data, num_step=2))

    class Always(RuntimeError):
        pass

    def fail_every_call(*_):
        raise Always("planted: the trainer refuses every batch")

    trainer.train = fail_every_call
    with pytest.raises(Always):
        run(controller, runtime, FAST.model_copy(update={"max_round_errors": 2}))
    assert controller.get("a").step == 0


def test_a_trainer_lost_in_a_train_call_is_restarted_and_runs_resume_from_checkpoints(fleet):
    controller, runtime, trainer, _, data = fleet
    controller.register("a", sft(data, num_step=5, checkpoint_interval=2))

    def kill_after_step_3():
        if controller.get("a").step == 3 and trainer.starts == 1:
            trainer.kill()

    # no periodic check after the first round: the dead rank is found by the next train call
    report = run(controller, runtime, FAST.model_copy(update={"engine_check_s": 3600.0}), on_round=kill_after_step_3)
    assert any("trainer died during a train call" in e and "restarting the trainer" in e for e in report.events)
    assert trainer.starts == 2
    ref = controller.get("a")
    assert ref.state == S.COMPLETED and ref.step == 5 and steps_of(controller, "a") == [1, 2, 3, 4, 5]
    recorded = controller.metrics("a").steps
    # step 3 (after the checkpoint at 2) was dropped and trained again after the restart
    assert recorded[2].recorded_at > recorded[1].recorded_at


def test_a_trainer_lost_while_idle_is_restarted(fleet):
    controller, runtime, trainer, _, _ = fleet
    stop = StopSignal()
    trainer.kill()  # no run is live: no train call will notice
    reports = []
    opts = LoopOptions(batch_mode=False, max_wait_s=0.01, engine_check_s=0.01)
    loop = threading.Thread(target=lambda: reports.append(run(controller, runtime, opts, stop)))
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while trainer.starts < 2 and loop.is_alive():
            assert time.monotonic() < deadline, "the idle loop did not restart the dead trainer in 60 s"
            stop.wait(0.01)
    finally:
        stop.request("test over")
        loop.join(60)
    [report] = reports
    assert any("a trainer rank is gone; restarting the trainer" in e for e in report.events)
    assert runtime.ready()["trainer"].ok


def test_a_failed_publish_is_logged_and_training_goes_on(fleet):
    controller, runtime, _, rollout, data = fleet
    controller.register("b", rl(data))
    rollout.fail_publish = RuntimeError("planted: engine refused the LoRA")
    report = run(controller, runtime)
    assert any(e.startswith("publish of b v") and "planted" in e for e in report.events)
    assert controller.get("b").state == S.COMPLETED and steps_of(controller, "b") == [1, 2, 3]


def test_an_adapter_whose_steps_are_all_non_finite_fails_and_the_others_go_on(fleet):
    controller, runtime, trainer, _, data = fleet
    bad = controller.register("bad", sft(data, num_step=5))
    controller.register("good", sft(data, num_step=4))
    trainer.nonfinite = {bad.slot}
    run(controller, runtime)
    ref = controller.get("bad")
    assert ref.state == S.FAILED and "3 consecutive steps with a non-finite loss" in ref.failure_reason
    assert controller.get("good").state == S.COMPLETED and steps_of(controller, "good") == [1, 2, 3, 4]


def test_stop_drains_every_live_run_into_a_checkpoint(fleet):
    controller, runtime, _, rollout, data = fleet
    controller.register("a", sft(data, num_step=100))
    controller.register("b", rl(data))
    stop = StopSignal()

    def stop_at_step_2():
        if controller.get("a").step >= 2:
            stop.request("test: SIGTERM")

    report = run(controller, runtime, LoopOptions(batch_mode=False, max_wait_s=0.01, engine_check_s=0.01), stop,
                 on_round=stop_at_step_2)
    assert report.stopped_by == "test: SIGTERM"
    for name in ("a", "b"):
        ref = controller.get(name)
        assert ref.state == S.ACTIVE and ref.checkpoint_step == ref.step and ref.checkpoint_path, ref
    assert ("abort_adapter", "b", True) in rollout.calls


def test_runs_that_can_never_step_fail_and_the_others_go_on(fleet):
    """runtime.fatal_runs -> controller.fail: an SFT run whose every row is over its length limit, and an RL
    run whose rollout reports a fatal_reason (planted in the fake: the engines kept refusing its requests)."""
    controller, runtime, _, rollout, data = fleet
    controller.register("too_long", {**sft(data, num_step=3), "data": {"path": str(data / "echo_sft.jsonl"), "max_sample_tokens": 1}})  # no echo row fits in 1 token
    bad = controller.register("refused", rl(data))
    controller.register("good", sft(data, num_step=2))
    rollout.fatal["refused"] = "planted: the engines refused 20 requests in a row (HTTP 400)"
    run(controller, runtime)
    ref = controller.get("too_long")
    assert ref.state == S.FAILED and "max_sample_tokens" in ref.failure_reason and ref.step == 0
    ref = controller.get("refused")
    assert ref.state == S.FAILED and ref.failure_reason.startswith("planted: the engines refused")
    assert ref.registration_id == bad.registration_id
    assert controller.get("good").state == S.COMPLETED and steps_of(controller, "good") == [1, 2]


def test_step_metrics_carry_tokens_and_the_data_sources_skip_counts(fleet):
    controller, runtime, _, _, data = fleet
    rows = (data / "echo_sft.jsonl").read_text().splitlines()
    (data / "mixed.jsonl").write_text("\n".join(['{"prompt": "' + "word " * 400 + '", "completion": "x"}'] + rows[:8]) + "\n")
    controller.register("a", {**sft(data, num_step=2), "data": {"path": str(data / "mixed.jsonl"), "max_sample_tokens": 256}})
    controller.register("b", rl(data))
    run(controller, runtime)
    a, b = controller.metrics("a").steps, controller.metrics("b").steps
    assert [s.metrics["rows_skipped_too_long"] for s in a] == [1.0, 1.0] and a[0].metrics["rows_skipped_oversized"] == 0.0
    assert all(s.metrics["tokens"] > 0 for s in a + b) and "kl_mean" not in a[0].metrics
    assert all("kl_mean" in s.metrics and s.metrics["rows_skipped_too_long"] == 0.0 for s in b)


def test_the_loop_feeds_fleet_stats_and_the_training_log(fleet, tmp_path):
    """Every committed step goes to TensorBoard with the registry's values; every trained round to FleetStats
    (the dashboard) and the `_fleet` run; the totals agree with the loop's report and the step records."""
    from service.loop.fleet_stats import FleetStats
    from service.loop.tb_log import FLEET_RUN, TrainingLog, run_dir, tensorboard_dir
    from tests.unit.test_tb_log import read_scalars

    controller, runtime, _, _, data = fleet
    a = controller.register("a", sft(data, num_step=3))
    controller.register("b", rl(data))
    stats = FleetStats()
    with TrainingLog(tmp_path / "tb_state", use_wandb=False) as training_log:
        report = run_training_loop(controller, runtime, FAST, StopSignal(), fleet_stats=stats, training_log=training_log)
    snap = stats.snapshot()
    steps = controller.metrics("a").steps + controller.metrics("b").steps
    assert snap["rounds"] == report.train_calls == 3 and snap["steps"] == report.steps == len(steps) == 6
    assert snap["samples"] == report.samples and snap["trained_tokens"] == sum(s.metrics["tokens"] for s in steps)
    assert 0 < snap["rollout_tokens"] < snap["trained_tokens"]  # only the RL run's samples carry rollout log-probs
    scalars = read_scalars(run_dir(tmp_path / "tb_state", "a", a.registration_id))
    assert scalars["loss"] == [(s.step, pytest.approx(s.metrics["loss"])) for s in controller.metrics("a").steps]
    fleet_scalars = read_scalars(tensorboard_dir(tmp_path / "tb_state") / FLEET_RUN)
    assert [v for _, v in fleet_scalars["round/steps"]] == [2.0, 2.0, 2.0]


# --- a lost node's groups that find no room (service/fleet/node_faults.py raises NoPlacement; the hook in the loop) ---


def test_no_room_for_a_lost_nodes_engines_stops_the_loop_and_drains_every_run(fleet):
    """The engines' re-placement gave up (no engine in service for placement.node_loss_wait_s): FAKE of that
    verdict (the real one needs a cluster without room: tests/integration/test_node_faults_ray.py). The loop
    stops with the reason and drains: every live run checkpointed, still ACTIVE (resumable)."""
    from service.errors import NoPlacement

    controller, runtime, _, rollout, data = fleet
    controller.register("a", sft(data, num_step=100))
    controller.register("b", rl(data))
    rounds = []

    def lose_the_engine_node_at_step_2():
        rounds.append(1)
        # at the first round that took either run to step 2 (b's third step would complete it)
        if max(controller.get(n).step for n in ("a", "b")) >= 2 and rollout.engine_alive:
            rollout.engine_alive = False

            def no_room(index):
                raise NoPlacement("planted: no alive node has room for lorafleet-engine0")

            rollout.begin_restart_engine = no_room

    # engine_check_s far below a round's length: the check runs at the start of every iteration, so the
    # round after the loss is never run before the check sees it (with 0.01 s a fast round could slip in)
    report = run(controller, runtime, LoopOptions(batch_mode=False, max_wait_s=0.01, engine_check_s=1e-6),
                 on_round=lose_the_engine_node_at_step_2)
    assert report.stopped_by == "no room after a node was lost: planted: no alive node has room for lorafleet-engine0"
    assert any(e.startswith("stopping: planted: no alive node has room") for e in report.events)
    for name in ("a", "b"):
        ref = controller.get(name)
        assert ref.state == S.ACTIVE and ref.checkpoint_step == ref.step and ref.checkpoint_path, ref


def test_no_room_for_the_trainer_stops_the_loop_saying_why(fleet):
    """The trainer's node was lost and its re-placement found no room (FAKE of that verdict, as above): the loop
    stops with the reason instead of failing rounds until it gives up; the run stays ACTIVE with the checkpoint
    it had (the trainer that held its newer state is gone)."""
    from service.errors import NoPlacement

    controller, runtime, trainer, _, data = fleet
    controller.register("a", sft(data, num_step=100, checkpoint_interval=2))

    def no_room():
        raise NoPlacement("planted: the trainer cannot be restarted: no alive node has room for lorafleet-trainer-dp0")

    def lose_the_trainer_node_at_step_3():
        if controller.get("a").step >= 3 and not trainer.dead:
            trainer.restart = no_room
            trainer.kill()

    report = run(controller, runtime, LoopOptions(batch_mode=False, max_wait_s=0.01, engine_check_s=0.01),
                 on_round=lose_the_trainer_node_at_step_3)
    assert report.stopped_by.startswith("no room after a node was lost: planted: the trainer cannot be restarted")
    ref = controller.get("a")
    assert ref.state == S.ACTIVE and ref.checkpoint_step == 2 and ref.checkpoint_path
