"""The MoE example job end to end on CPU: `lorafleet run examples/tiny_moe/job.yaml`.

Real everything, as the main-job test (test_service_main_job.py): the CLI process,
Ray, one SGLang CPU server (attention-only LoRA targets: SGLang 0.5.23 has no CPU
path for expert LoRA), the Megatron-Bridge trainer on the tiny Qwen3-MoE. Checked
afterwards from the registry: every adapter COMPLETED with all its steps; the SFT
adapter's export carries expert LoRA in PEFT's format (target_parameters) and the RL
adapters' exports are attention-only; every export loads with peft onto the HF MoE
base and changes its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.cli_jobs import LORAFLEET, check_exports_load_with_peft, reaped_job_dir, rows
from tests.paths import REPO

# Opt-in (-m slow, CI budget: the whole MoE job is over 2 minutes on 2 cores). The default tier keeps
# the MoE trainer against its references (test_moe_trainer.py) and SGLang serving expert LoRA
# against HF (test_moe_sglang.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = REPO / "examples" / "tiny_moe" / "job.yaml"


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()



@pytest.fixture
def job_dir(tmp_path):
    with reaped_job_dir(tmp_path, "tiny_moe") as folder:
        yield folder


def test_moe_job_trains_expert_lora_to_completion(moe_world, job_dir):
    t0 = time.monotonic()
    env = {**os.environ, "COLUMNS": "120", "LORAFLEET_DATA_ROOTS": str(moe_world / "data")}
    proc = subprocess.run([*LORAFLEET, "run", str(JOB)], cwd=job_dir, capture_output=True, text=True,
                          timeout=1200, env=env)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    print(f"MoE job wall time {wall:.1f} s\n{proc.stdout}")

    db = job_dir / "runs" / "tiny_moe" / "registry.sqlite3"
    runs = {r["name"]: r for r in rows(db, "SELECT * FROM runs")}
    expected_steps = {"digits": 8, "vowels": 8, "echo_sft": 12}
    assert set(runs) == set(expected_steps)
    for name, run in runs.items():
        assert run["state"] == "COMPLETED", (name, run["failure_reason"])
        assert run["step"] == expected_steps[name]

    for name, run in runs.items():
        cfg = json.loads((Path(run["export_path"]) / "adapter_config.json").read_text())
        assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"], name
        if name == "echo_sft":
            assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        else:
            assert "target_parameters" not in cfg, name
    check_exports_load_with_peft(moe_world / "model", {n: r["export_path"] for n, r in runs.items()})
