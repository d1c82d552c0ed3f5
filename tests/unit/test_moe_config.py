"""The MoE job file: lora_experts reaches the trainer, and a CPU job cannot ask to serve expert LoRA."""

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

JOB = REPO / "examples" / "tiny_moe" / "job.yaml"


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


def _job_text(moe_world) -> str:
    return JOB.read_text().replace("../../.cache/tiny_moe", str(moe_world))


def test_example_job_loads_and_passes_lora_experts_through(moe_world, tmp_path):
    from service.config.job import load_job

    (tmp_path / "job.yaml").write_text(_job_text(moe_world))
    job = load_job(tmp_path / "job.yaml")
    hyper = {a.name: a.config.slot_hyper_params(total_steps=None) for a in job.adapters}
    assert {name: h.lora_experts for name, h in hyper.items()} == {"digits": False, "vowels": False, "echo_sft": True}


def test_rl_expert_lora_on_a_cpu_placement_is_refused(moe_world, tmp_path):
    from service.config.job import load_job
    from service.config.settings import ConfigError

    text = _job_text(moe_world).replace("      lora_experts: false", "      lora_experts: true", 1)
    (tmp_path / "job.yaml").write_text(text)
    with pytest.raises((ConfigError, ValueError), match="RL adapters digits train expert LoRA .* set lora_experts: false"):
        load_job(tmp_path / "job.yaml")


def test_rest_registration_refuses_rl_expert_lora_on_a_cpu_placement_and_changes_nothing(moe_world, tmp_path):
    """The REST path (POST /v1/adapters -> Controller.register -> check_adapter_config) holds the job file's
    rule: an RL adapter with lora_experts: true on an MoE base on cpu is refused, naming the field, and no
    run is recorded; lora_experts: false, or an SFT adapter with expert LoRA, registers."""
    from service.config.job import load_job
    from service.config.settings import load_settings
    from service.control.controller import Controller
    from service.errors import BadValue

    (tmp_path / "job.yaml").write_text(_job_text(moe_world))
    job = load_job(tmp_path / "job.yaml")
    assert job.capacity.rl_expert_lora is False  # derived: MoE base, cpu placement
    digits = next(a for a in job.adapters if a.name == "digits").config
    sft_cfg = next(a for a in job.adapters if a.name == "echo_sft").config
    settings = load_settings(state_dir=tmp_path / "state", data_roots=[moe_world / "data", tmp_path])
    controller = Controller(settings, job.capacity)
    try:
        with pytest.raises(BadValue, match="lora_experts: true on an rl adapter .* allowed: lora_experts: false") as err:
            controller.register("rl-experts", digits.model_copy(update={"lora_experts": True}).model_dump(mode="json"))
        assert err.value.field == "config.lora_experts"
        assert controller.list() == []  # nothing recorded
        assert controller.register("rl-attention", digits.model_dump(mode="json")).state == "PENDING"
        assert controller.register("sft-experts", sft_cfg.model_dump(mode="json")).state == "PENDING"
    finally:
        controller.close()


def test_a_dense_base_or_a_gpu_placement_keeps_rl_expert_lora_allowed(moe_world, tmp_path):
    from service.cli import TINY_JOB
    from service.config.job import load_job

    (tmp_path / "job.yaml").write_text(_job_text(moe_world))
    moe = load_job(tmp_path / "job.yaml")
    assert moe.model_copy(update={"placement": moe.placement.model_copy(update={"accelerator": "gpu"})}).capacity.rl_expert_lora
    assert load_job(TINY_JOB).capacity.rl_expert_lora  # dense tiny base
