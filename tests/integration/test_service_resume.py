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
schedule at its end (service/config_checks.planned_steps).
"""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray

import pytest

pytestmark = pytest.mark.integration

STEPS, INTERVAL = 6, 3


@pytest.fixture(scope="module")
def sft_world(tiny_world, tmp_path_factory):
    ray = pytest.importorskip("ray")
    from service.config import load_job, load_settings
    from service.controller import Controller
    from service.runtime_impl import FleetRuntime
    from service.trainer_group import TrainerGroup
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
    from service.loop import LoopOptions, run_training_loop
    from service.shutdown import StopSignal

    report = run_training_loop(controller, runtime, LoopOptions(batch_mode=True, max_wait_s=0.1), StopSignal())
    assert report.stopped_by is None
    return report


def _sft(data, **over):
    return {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 0.01, "data": {"path": str(data / "data" / "echo_sft.jsonl")},
            "prompts_per_step": 4, "num_step": STEPS, "checkpoint_interval": INTERVAL, "seed": 7, **over}


def test_resumed_sft_run_continues_exactly(sft_world):
    from safetensors.torch import load_file

    from service.checkpoints import load_checkpoint
    from service.registry import AdapterState

    controller, runtime, data = sft_world
    a = controller.register("a", _sft(data))
    _train(controller, runtime)
    a = controller.get("a")
    assert a.state == AdapterState.COMPLETED and a.step == STEPS, a
    a_steps = controller.metrics("a").steps
    assert [s.step for s in a_steps] == list(range(1, STEPS + 1))

    ckpt_dir = runtime_run_dir(controller, a) / "checkpoints" / "step-000003"
    ckpt = load_checkpoint(ckpt_dir)
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
    from service.registry import AdapterState

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


def runtime_run_dir(controller, ref):
    from service.runtime import run_dir

    return run_dir(controller.settings.state_dir, ref)
