"""The MoE job file: lora_experts reaches the trainer, and a CPU job cannot ask to serve expert LoRA."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

JOB = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe" / "job.yaml"


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


def _job_text(moe_world) -> str:
    return JOB.read_text().replace("../../.cache/tiny_moe", str(moe_world))


def test_example_job_loads_and_passes_lora_experts_through(moe_world, tmp_path):
    from service.config import load_job

    (tmp_path / "job.yaml").write_text(_job_text(moe_world))
    job = load_job(tmp_path / "job.yaml")
    hyper = {a.name: a.config.slot_hyper_params(total_steps=None) for a in job.adapters}
    assert {name: h.lora_experts for name, h in hyper.items()} == {"digits": False, "vowels": False, "echo_sft": True}


def test_rl_expert_lora_on_a_cpu_placement_is_refused(moe_world, tmp_path):
    from service.config import ConfigError, load_job

    text = _job_text(moe_world).replace("      lora_experts: false", "      lora_experts: true", 1)
    (tmp_path / "job.yaml").write_text(text)
    with pytest.raises((ConfigError, ValueError), match="RL adapters digits train expert LoRA .* set lora_experts: false"):
        load_job(tmp_path / "job.yaml")
