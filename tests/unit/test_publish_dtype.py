"""engines.publish_dtype (issue 18 item 3): the dtype of the handoff folders the trainer writes, auto =
the dtype the engines serve in. Resolved from the one home of the engines' dtype (EngineConfig's
server_dtype_flag, which the launcher passes); the GPU default (SGLang's --dtype auto) is checked
against SGLang's own rule."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError

from rollout.config import SGLANG_DTYPES, EngineConfig, PublishDtype, checkpoint_serving_dtype
from rollout.engines.sglang_cpu import build_server_launch


def _checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_default_is_auto_and_fp32_on_cpu_engines(tmp_path):
    model = _checkpoint(tmp_path, torch_dtype="bfloat16", model_type="qwen3")
    cfg = EngineConfig()
    assert cfg.publish_dtype == "auto"
    # CPU engines serve in float32 whatever the checkpoint's dtype (today's behaviour: logprob parity)
    assert cfg.resolved_publish_dtype("cpu", model) == "float32"
    # on GPU, SGLang's auto: the checkpoint's dtype
    assert cfg.resolved_publish_dtype("cuda", model) == "bfloat16"


@pytest.mark.parametrize("engine_dtype, served", [("bfloat16", "bfloat16"), ("half", "float16"), ("float16", "float16"),
                                                   ("float", "float32"), ("float32", "float32"), ("BFloat16", "bfloat16")])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_follows_a_named_engine_dtype(tmp_path, engine_dtype, served, device):
    model = _checkpoint(tmp_path, torch_dtype="float32")
    assert EngineConfig(dtype=engine_dtype).resolved_publish_dtype(device, model) == served


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("wanted", ["float32", "bfloat16", "float16"])
def test_a_named_publish_dtype_wins(tmp_path, wanted, device):
    model = _checkpoint(tmp_path, torch_dtype="bfloat16")
    assert EngineConfig(dtype="float32", publish_dtype=wanted).resolved_publish_dtype(device, model) == wanted


def test_served_dtype_is_what_the_launcher_passes():
    """The flag the servers get and the dtype the publish resolves come from one method."""
    for engine_dtype in ["auto", *SGLANG_DTYPES]:
        cfg = EngineConfig(dtype=engine_dtype)
        for device in ("cpu", "cuda"):
            # python=/bin/false: the CPU launch's check for a real sgl_kernel fails at once instead of
            # importing it in a fresh interpreter (seconds); the dtype flags do not depend on it
            argv = build_server_launch(cfg, "/m", 1234, python="/bin/false", device=device, base_env={"PATH": "/bin"}).argv
            flag = argv[argv.index("--dtype") + 1] if "--dtype" in argv else None
            assert flag == cfg.server_dtype_flag(device), (engine_dtype, device)
            if flag is not None:
                assert cfg.served_dtype(device, "/unread") == SGLANG_DTYPES[flag.lower()]


@pytest.mark.parametrize("config", [
    {"torch_dtype": "bfloat16", "model_type": "qwen3"}, {"dtype": "bfloat16", "model_type": "llama"},
    {"torch_dtype": "float16", "model_type": "qwen2"}, {"torch_dtype": "float32", "model_type": "qwen3"},
    {"torch_dtype": "float32", "model_type": "gemma2"}, {"model_type": "qwen3"}, {"model_type": "gemma"},
    {"dtype": "float16", "torch_dtype": "bfloat16"}, {"torch_dtype": "int8"},
])
def test_checkpoint_dtype_matches_sglangs_own_auto_rule(tmp_path, config):
    import torch

    pytest.importorskip("sglang")
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    ours = checkpoint_serving_dtype(_checkpoint(tmp_path, **config))
    assert getattr(torch, ours) == _get_and_verify_dtype(config, "auto")


def test_refusals_list_what_is_allowed(tmp_path):
    with pytest.raises(ValidationError, match="'auto', 'float32', 'bfloat16' or 'float16'"):
        EngineConfig(publish_dtype="fp16")
    with pytest.raises(ValidationError, match="unknown engine dtype 'fp8'; allowed: auto, half, float16, bfloat16, float, float32"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="cannot read the base model's dtype from .*config.json"):
        EngineConfig().resolved_publish_dtype("cuda", tmp_path)  # no config.json


def test_trainer_takes_exactly_the_named_publish_dtypes():
    from trainer.export.export_writer import EXPORT_DTYPES, export_dtype

    assert set(EXPORT_DTYPES) == set(typing.get_args(PublishDtype)) - {"auto"}
    with pytest.raises(ValueError, match="unknown export dtype 'auto'; allowed: float32, bfloat16, float16"):
        export_dtype("auto")


@pytest.mark.parametrize("accelerator, engines, expected", [
    ("cpu", {}, "float32"),  # CPU engines serve in fp32: today's folders, unchanged
    ("gpu", {}, "float16"),  # GPU, auto: SGLang's dtype for this fp32 checkpoint (the tiny world's)
    ("gpu", {"dtype": "bfloat16"}, "bfloat16"),  # examples/gpu/job.yaml
    ("cpu", {"device": "cuda"}, "float16"),  # an explicit engine device wins over the placement
    ("gpu", {"device": "cpu"}, "float32"),
    ("gpu", {"publish_dtype": "float32"}, "float32"),
])
def test_the_runtime_publishes_in_the_engines_dtype(tiny_world, tmp_path, accelerator, engines, expected):
    """FleetRuntime resolves the handoff folders' dtype from the job (engines' device from the placement
    when 'auto', as service/fleet/actors.py gives the rollout worker GPUs), over a FAKE trainer (unused here)."""
    from service.cli import TINY_JOB
    from service.config.job import load_job
    from service.config.settings import load_settings
    from service.fleet.fleet_runtime import FleetRuntime
    from tests.fleet_fakes import FakeTrainer

    job = load_job(TINY_JOB)
    job = job.model_copy(update={
        "adapters": [], "base_model": job.base_model.model_copy(update={"path": str(tiny_world / "model")}),
        "placement": job.placement.model_copy(update={"accelerator": accelerator}),
        "engines": EngineConfig.model_validate(job.engines.model_dump() | {"weight_transfer": "disk"} | engines),
    })
    runtime = FleetRuntime(job, load_settings(state_dir=tmp_path / "state"), trainer=FakeTrainer(), rollout=None)
    assert runtime.publisher.dtype == expected
