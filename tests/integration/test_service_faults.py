"""Faults the running service survives (slow tier: each costs a restart of a real part).

One `lorafleet serve` process, real faults, no stand-ins:
  * the SGLang engine process group is SIGKILLed: the service restarts the engine,
    republishes every adapter's current weights, and the RL adapter keeps training;
  * a trainer rank's process is killed (ray.kill through the runtime actor, as an
    operator attached to the cluster would): the service restarts the trainer and
    every live run continues from its last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.integration.service_world import call_runtime_actor, retire_and_wait, rl, running_service, sft, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("faults"), tiny_world) as svc:
        yield svc
        assert svc.stop() == 0, svc.log_tail()


def test_dead_engine_is_restarted_and_adapters_republished(service, tiny_world):
    with service.client() as c:
        c.register("e-rl", rl(tiny_world))
        wait_for(c, "e-rl", lambda r: r["step"] >= 2, "2 steps")
        engine = c.ready()["components"]["engine-0"]
        assert engine["ok"] and "starts=1" in engine["detail"]
        pids = json.loads((service.state_dir / "engines.json").read_text())["pids"]
        assert pids
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        killed_at = time.time()
        step_at_kill = c.get("e-rl")["step"]
        ref = wait_for(c, "e-rl", lambda r: r["step"] >= step_at_kill + 3, "3 steps after the engine died", timeout_s=420)
        engine = c.ready()["components"]["engine-0"]
        assert engine["ok"] and "starts=2" in engine["detail"], engine
        assert ref["state"] == "ACTIVE"
        steps = c.metrics("e-rl")["steps"]
        assert [s["step"] for s in steps] == list(range(1, ref["step"] + 1))
        later = [s for s in steps if s["recorded_at"] > killed_at + 1]
        assert later and all(s["metrics"]["foreign_samples_dropped"] == 0 for s in later)
        assert "engine 0 was dead: restarted" in service.log_path.read_text()
        retire_and_wait(c, "e-rl")


def test_dead_trainer_is_restarted_and_runs_continue_from_checkpoints(service, tiny_world):
    interval = 2
    with service.client() as c:
        c.register("f-sft", sft(tiny_world, checkpoint_interval=interval))
        c.register("f-rl", rl(tiny_world, checkpoint_interval=interval))
        for n in ("f-sft", "f-rl"):
            wait_for(c, n, lambda r: (r["checkpoint_step"] or 0) >= interval, "a checkpoint")
        call_runtime_actor(service, "kill_trainer_rank", 0)
        killed_at = time.time()
        for n in ("f-sft", "f-rl"):
            ckpt = c.get(n)["checkpoint_step"]
            ref = wait_for(c, n, lambda r, k=ckpt: r["step"] >= k + 3 and r["updated_at"] > killed_at + 1,
                           "3 steps past its checkpoint after the trainer died", timeout_s=300)
            steps = c.metrics(n)["steps"]
            assert [s["step"] for s in steps] == list(range(1, ref["step"] + 1))
            after = [s["step"] for s in steps if s["recorded_at"] > killed_at]
            assert after and after[0] % interval == 1 and after[0] > 1, (n, after)  # from a checkpoint, not from scratch
        trainer = c.ready()["components"]["trainer"]
        assert trainer["ok"] and ("starts=2" in trainer["detail"] or "busy" in trainer["detail"]), trainer
        assert "restarting the trainer" in service.log_path.read_text()
        retire_and_wait(c, "f-sft", "f-rl")
