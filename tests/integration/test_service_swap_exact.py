"""Turns through one slot are exact, and a failed swap fails only its run (issue 15).

Real parts: Ray, the Megatron-Bridge trainer actor (fp32, CPU) with a host-memory budget of
1 KiB (so every evicted slot spills to disk), the controller and its SQLite registry, the
FleetRuntime and the training loop in batch mode. SFT runs, whose batches depend only on their
data cursor, so runs are deterministic (as in test_service_resume.py).

1. Runs x and y share one slot with turn_steps = 1: after every step the resident is swapped out
   (spilled) and the other swapped in. Each must end bit-identical (every step's loss and
   gradient norm, the final export) to the same run trained alone, resident the whole time; and
   nothing is left in the trainer's swap store.
2. A full disk while spilling (a real ENOSPC: run p's spill file is a link to /dev/full, as in
   test_trainer_swap.py): p's first eviction fails p (FAILED, the SwapError as its reason; its
   slot as it was) and the other run trains on to COMPLETED.
"""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray
from tests.trainer_probes import swapped

import logging
import os

import pytest

pytestmark = pytest.mark.integration

STEPS = 4


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    ray = pytest.importorskip("ray")
    from service.cli import TINY_JOB
    from service.config.job import load_job
    from service.fleet.trainer_group import TrainerGroup

    tmp = tmp_path_factory.mktemp("swap_exact")
    job = load_job(TINY_JOB).model_copy(update={"adapters": []})
    cfg = job.trainer.model_copy(update={"swap_host_budget_mb": 1 / 1024, "swap_spill_dir": str(tmp / "swap")})
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = TrainerGroup(cfg)
    try:
        trainer.start()
        yield job, trainer, tmp, tiny_world
    finally:
        trainer.stop()
        stop_ray()


def _controller(world, name: str, turn_steps: int):
    from service.config.settings import load_settings
    from service.control.controller import Controller
    from service.fleet.fleet_runtime import FleetRuntime

    job, trainer, tmp, data = world
    settings = load_settings(state_dir=tmp / name, data_roots=[data / "data", tmp])
    capacity = job.capacity.model_copy(update={"num_slots": 1, "turn_steps": turn_steps})
    controller = Controller(settings, capacity)
    runtime = FleetRuntime(job, settings, trainer=trainer, rollout=None)
    controller.attach_runtime(runtime)
    return controller, runtime


def _train(controller, runtime):
    from service.loop.training_loop import LoopOptions, run_training_loop
    from service.shutdown import StopSignal

    report = run_training_loop(controller, runtime, LoopOptions(batch_mode=True, max_wait_s=0.1), StopSignal())
    assert report.stopped_by is None


def _sft(data, seed: int):
    return {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 0.01, "data": {"path": str(data / "data" / "echo_sft.jsonl")},
            "prompts_per_step": 4, "num_step": STEPS, "checkpoint_interval": 0, "seed": seed}


def _result(controller, name):
    from safetensors.torch import load_file

    ref = controller.get(name)
    steps = [(s.step, s.metrics["loss"], s.metrics["grad_norm"]) for s in controller.metrics(name).steps]
    return ref, steps, load_file(f"{ref.export_path}/adapter_model.safetensors")


def test_turns_through_one_slot_are_bit_exact(world, caplog):
    from service.registry.registry import AdapterState

    _, trainer, _, data = world
    caplog.set_level(logging.INFO, logger="service.scheduling")  # the scheduler and its placement (slot_moves)
    turns, rt = _controller(world, "turns", turn_steps=1)
    try:
        turns.register("x", _sft(data, seed=7))
        turns.register("y", _sft(data, seed=8))
        _train(turns, rt)
        got = {n: _result(turns, n) for n in ("x", "y")}
    finally:
        turns.close()
    evictions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted ")]
    assert len(evictions) >= 2 * (STEPS - 1) - 1 and all("(disk," in m for m in evictions), evictions  # every one spilled
    assert swapped(trainer) == {"keys": [], "host_bytes": 0, "spilled": []}  # nothing left behind

    for name, seed in (("x", 7), ("y", 8)):
        alone, rt2 = _controller(world, f"alone_{name}", turn_steps=1)
        try:
            alone.register(name, _sft(data, seed=seed))
            _train(alone, rt2)
            ref_alone, steps_alone, w_alone = _result(alone, name)
        finally:
            alone.close()
        ref, steps, w = got[name]
        assert ref.state == ref_alone.state == AdapterState.COMPLETED and ref.step == STEPS
        assert steps == steps_alone, name  # every step's loss and gradient norm, bit for bit
        assert w.keys() == w_alone.keys() and all((w[k] == w_alone[k]).all() for k in w), f"{name}: export differs"
    assert any(not (got["x"][2][k] == got["y"][2][k]).all() for k in got["x"][2])  # two different runs


def test_disk_full_while_spilling_fails_that_run_only(world):
    from service.registry.registry import AdapterState

    _, trainer, tmp, data = world
    spill = tmp / "swap"
    spill.mkdir(exist_ok=True)
    controller, rt = _controller(world, "fault", turn_steps=1)
    full = spill / "not-made-yet"
    try:
        p = controller.register("p", _sft(data, seed=1))
        full = spill / f"{p.registration_id}.rank0.tmp"
        os.symlink("/dev/full", full)
        controller.register("q", _sft(data, seed=2))
        _train(controller, rt)
        p, q = controller.get("p"), controller.get("q")
        assert p.state == AdapterState.FAILED and p.step == 1, p
        assert p.failure_reason.startswith("evict failed: SwapError: spilling slot snapshot") and "No space left on device" in p.failure_reason, p
        assert q.state == AdapterState.COMPLETED and q.step == STEPS, q
        assert swapped(trainer)["keys"] == []
    finally:
        controller.close()
        full.unlink(missing_ok=True)
