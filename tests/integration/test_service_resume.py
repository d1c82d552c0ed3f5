"""Resume exactness: a run resumed from a checkpoint continues exactly like the run that wrote it.

Real parts: Ray, the Megatron-Bridge trainer actor (fp32, CPU), the controller and
its SQLite registry, the FleetRuntime and the training loop in batch mode, the
checkpoint files. No engine: the adapter is SFT, whose batches depend only on the
data cursor, which makes the comparison deterministic (an RL run's rollouts are
sampled by a server asynchronously, so its next steps are not reproducible even
uninterrupted).

Run "a" trains 6 steps uninterrupted (checkpoints at 3 and 6). Run "b" is a new
registration with resume_from = a's step-3 checkpoint: its steps 4..6 must give the
same losses and gradient norms as a's steps 4..6, and its final export the same
weights as a's.

A dataset run (num_epoch) on the same world ends at the total_steps it was registered with, its cosine
schedule at its end (service/config_checks.planned_steps). A run over a file past data_check_bytes (rows
estimated at registration) gets its exact total when it starts, and ends there; one whose exact rows give
no whole step fails at start with the registration's reason, the run beside it unaffected.
"""

from __future__ import annotations

import json
import logging

from tests.local_ray import start_ray, stop_ray

import pytest

pytestmark = pytest.mark.integration

STEPS, INTERVAL = 6, 3


@pytest.fixture(scope="module")
def sft_world(tiny_world, tmp_path_factory):
    ray = pytest.importorskip("ray")
    from service.config.job import load_job
    from service.config.settings import load_settings
    from service.control.controller import Controller
    from service.fleet.fleet_runtime import FleetRuntime
    from service.fleet.trainer_group import TrainerGroup
    from service.cli import TINY_JOB

    tmp = tmp_path_factory.mktemp("resume")
    job = load_job(TINY_JOB).model_copy(update={"adapters": []})
    settings = load_settings(state_dir=tmp / "state", data_roots=[tiny_world / "data", tmp])
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = TrainerGroup(job.trainer)
    controller = Controller(settings, job.capacity)
    try:
        trainer.start()
        runtime = FleetRuntime(job, settings, trainer=trainer, rollout=None)
        controller.attach_runtime(runtime)
        yield controller, runtime, tiny_world
    finally:
        controller.close()
        trainer.stop()
        stop_ray()


def _train(controller, runtime):
    from service.loop.training_loop import LoopOptions, run_training_loop
    from service.shutdown import StopSignal

    report = run_training_loop(controller, runtime, LoopOptions(batch_mode=True, max_wait_s=0.1), StopSignal())
    assert report.stopped_by is None
    return report


def _sft(data, **over):
    return {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 0.01, "data": {"path": str(data / "data" / "echo_sft.jsonl")},
            "prompts_per_step": 4, "num_step": STEPS, "checkpoint_interval": INTERVAL, "seed": 7, **over}


def test_resumed_sft_run_continues_exactly(sft_world):
    from safetensors.torch import load_file

    from trainer.storage.run_checkpoints import load_checkpoint
    from trainer.storage.locations import open_store
    from service.registry.registry import AdapterState

    controller, runtime, data = sft_world
    a = controller.register("a", _sft(data))
    _train(controller, runtime)
    a = controller.get("a")
    assert a.state == AdapterState.COMPLETED and a.step == STEPS, a
    a_steps = controller.metrics("a").steps
    assert [s.step for s in a_steps] == list(range(1, STEPS + 1))

    ckpt_dir = runtime_run_dir(controller, a) / "checkpoints" / "step-000003"
    ckpt = load_checkpoint(open_store(None), ckpt_dir)
    assert (ckpt.state.step, ckpt.state.samples_trained, ckpt.state.registration_id) == (3, 12, a.registration_id)
    assert ckpt.state.data_cursor["consumed"] == 12 and ckpt.state.data_cursor["pending"] == []

    b = controller.register("b", _sft(data, resume_from=str(ckpt_dir)))
    _train(controller, runtime)
    b = controller.get("b")
    assert b.state == AdapterState.COMPLETED and b.step == STEPS and b.samples_trained == STEPS * 4, b
    b_steps = controller.metrics("b").steps
    assert [s.step for s in b_steps] == [4, 5, 6]  # it continued at the checkpoint's step

    for sa, sb in zip(a_steps[3:], b_steps):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert sb.metrics[key] == pytest.approx(sa.metrics[key], rel=1e-6, abs=1e-9), (sa.step, key)
    wa = load_file(f"{a.export_path}/adapter_model.safetensors")
    wb = load_file(f"{b.export_path}/adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-6, f"resumed export differs from the uninterrupted one by {worst}"
    # and the resumed weights really moved from the checkpoint's
    w3 = load_file(f"{ckpt_dir}/adapter/adapter_model.safetensors")
    assert max(float((wb[k] - w3[k]).abs().max()) for k in wb) > 1e-4


def test_an_epoch_run_ends_at_its_planned_total_with_its_schedule_finished(sft_world):
    """A dataset run (num_epoch, no num_step) makes exactly the total_steps it was registered with, and its
    cosine schedule ends at that step (min_lr_ratio x learning_rate). 256 rows x 2 epochs at 96 a step: the
    epochs run on into each other, 512 // 96 = 5 steps, and the last 32 rows (less than a step) are dropped.
    Planned with the old ceil(512 / 96) = 6, the run ended at 5/6 with its learning rate still above the end
    of its schedule (the main job's kinds_sft at 42/43)."""
    from service.registry.registry import AdapterState

    controller, runtime, data = sft_world
    lr, min_ratio = 0.01, 0.1
    controller.register("epochs", _sft(data, num_step=None, num_epoch=2, prompts_per_step=96, lr_schedule="cosine",
                                       warmup_steps=1, min_lr_ratio=min_ratio, learning_rate=lr))
    _train(controller, runtime)
    ref = controller.get("epochs")
    steps = controller.metrics("epochs").steps
    assert ref.state == AdapterState.COMPLETED and [s.step for s in steps] == [1, 2, 3, 4, 5], ref
    assert ref.samples_trained == 5 * 96
    assert steps[-1].metrics["learning_rate"] == pytest.approx(min_ratio * lr, rel=1e-6)  # the schedule's last step
    assert ref.step == ref.total_steps  # the progress the tenant sees ends at its total


def _estimated_file(path, short_rows: int, long_rows: int) -> int:
    """A JSONL file whose first CHECK_BYTES hold only short rows and whose rest holds long ones, so the
    registration's estimate (rows in the prefix scaled by the file's size) is far above its real row
    count. Returns the real count (non-blank lines: the data source's definition)."""
    short = "".join(json.dumps({"prompt": f"p{i}", "completion": f" c{i}"}) + "\n" for i in range(short_rows))
    long = "".join(json.dumps({"prompt": f"q{i} " + " ".join(f"w{j}" for j in range(24)),
                               "completion": " " + " ".join(f"v{j}" for j in range(24))}) + "\n" for i in range(long_rows))
    assert len(short) > CHECK_BYTES and len(long) > 3 * len(short)  # the checked prefix holds only short rows
    path.write_text(short + long)
    return short_rows + long_rows


CHECK_BYTES = 1024  # data_check_bytes of the registrations below (the smallest allowed)


def test_a_run_over_an_estimated_file_takes_the_exact_total(sft_world, monkeypatch, caplog):
    """A file past data_check_bytes has its rows estimated at registration; the run counts them as it opens
    its data, records the exact total (the progress the tenant sees) and runs its cosine schedule to it:
    it ends at step == the exact total with its learning rate at min_lr_ratio x learning_rate. Without the
    correction it ends at 8 of an estimated ~20 steps, its schedule not finished."""
    from service.registry.registry import AdapterState

    controller, runtime, data = sft_world
    monkeypatch.setattr(controller, "settings", controller.settings.model_copy(update={"data_check_bytes": CHECK_BYTES}))
    big = controller.settings.data_roots[-1] / "estimated_big.jsonl"  # the module's data root (registration confines paths)
    rows = _estimated_file(big, short_rows=40, long_rows=26)
    lr, min_ratio, per_step = 0.01, 0.1, 8
    exact = rows // per_step  # planned_steps' rule by hand: 66 // 8 = 8 (one epoch)
    config = _sft(data, num_step=None, prompts_per_step=per_step, lr_schedule="cosine", warmup_steps=1, min_lr_ratio=min_ratio, learning_rate=lr)
    registered = controller.register("estimated", {**config, "data": {"path": str(big)}})
    assert registered.total_steps > exact + 2, registered.total_steps  # the estimate (rows in the prefix x size / prefix)
    with caplog.at_level(logging.INFO, logger="service.fleet.fleet_runtime"):
        _train(controller, runtime)
    note = f"estimated: total_steps {registered.total_steps} -> {exact} (the file has {rows} rows; registration estimated it)"
    assert note in caplog.messages
    ref = controller.get("estimated")
    steps = controller.metrics("estimated").steps
    assert ref.state == AdapterState.COMPLETED, ref
    assert ref.total_steps == exact, (ref.total_steps, exact)
    assert [s.step for s in steps] == list(range(1, exact + 1)) and ref.step == exact
    assert steps[-1].metrics["learning_rate"] == pytest.approx(min_ratio * lr, rel=1e-6)  # the schedule's last step


def test_an_estimated_file_with_no_whole_step_fails_at_prepare_alone(sft_world, monkeypatch):
    """The exact count gives no whole step (registration's estimate gave some): that run fails at prepare
    with the registration's reason (rows, step size, what is allowed); a run beside it trains to its end."""
    from service.registry.registry import AdapterState

    controller, runtime, data = sft_world
    monkeypatch.setattr(controller, "settings", controller.settings.model_copy(update={"data_check_bytes": CHECK_BYTES}))
    short = controller.settings.data_roots[-1] / "estimated_short.jsonl"
    rows = _estimated_file(short, short_rows=40, long_rows=24)
    per_step = rows + 4  # more than the file has, less than the estimate
    config = _sft(data, num_step=None, prompts_per_step=per_step)
    registered = controller.register("nostep", {**config, "data": {"path": str(short)}})
    assert registered.total_steps >= 1
    controller.register("beside", _sft(data, num_step=2, checkpoint_interval=0))
    _train(controller, runtime)
    failed, beside = controller.get("nostep"), controller.get("beside")
    assert failed.state == AdapterState.FAILED and failed.step == 0, failed
    assert f"a step takes {per_step} rows (prompts_per_step) but estimated_short.jsonl has {rows} row(s) x 1 epoch(s)" in failed.failure_reason, failed.failure_reason
    assert f"allowed: prompts_per_step at most {rows}" in failed.failure_reason, failed.failure_reason
    assert failed.total_steps == registered.total_steps  # nothing recorded for it
    assert beside.state == AdapterState.COMPLETED and beside.step == 2, beside


def runtime_run_dir(controller, ref):
    from service.control.runtime_protocol import run_dir

    return run_dir(controller.settings.state_dir, ref)
