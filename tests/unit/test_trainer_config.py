"""TrainerConfig / SlotHyperParams: valid inputs pass, bad ones name what is wrong."""

import pytest
from pydantic import ValidationError

from trainer.config import SlotHyperParams, TrainerConfig

pytestmark = pytest.mark.unit


def test_defaults():
    cfg = TrainerConfig(base_model_path="/m")
    assert cfg.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
    assert cfg.dtype == "auto" and cfg.tp == cfg.dp == 1
    hp = SlotHyperParams()
    assert hp.scale == 2.0 and hp.objective == "rl" and hp.loss_normalization == "sequence_mean"
    assert hp.targets == ("attention", "mlp")  # the unembedding only when asked for


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_modules": ["linear_qkv", "q_proj"]}, "need a non-empty subset"),
        ({"target_modules": []}, "need a non-empty subset"),
        ({"target_modules": ["linear_qkv", "linear_qkv"]}, "duplicates"),
        ({"num_slots": 0}, "greater than or equal to 1"),
        ({"tp": 0}, "greater than or equal to 1"),
        ({"dtype": "float16"}, "'auto', 'float32' or 'bfloat16'"),
        ({"num_slot": 3}, "Extra inputs are not permitted"),
    ],
)
def test_trainer_config_rejects(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(base_model_path="/m", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr_schedule": "cosine"}, "needs total_steps"),
        ({"warmup_steps": 10, "total_steps": 5}, "exceeds total_steps"),
        ({"loss_normalization": "constant"}, "needs loss_norm_tokens"),
        ({"loss_norm_tokens": 64}, "applies only to loss_normalization 'constant'"),
        ({"objective": "sft", "kl_coef": 0.1}, "kl_coef applies only to objective 'rl'"),
        ({"betas": (0.9, 1.0)}, r"each must be in \[0, 1\)"),
        ({"rank": 0}, "greater than or equal to 1"),
        ({"lr": 0}, "greater than 0"),
        ({"clip_low": 1.0}, "less than 1"),
        ({"samples_per_step": 0}, "greater than or equal to 1"),
        ({"objective": "dpo"}, "'rl' or 'sft'"),
        ({"targets": []}, "at least one target must be on, of attention, mlp, unembed"),
        ({"targets": ["attention", "attention"]}, "duplicates"),
        ({"targets": ["lm_head"]}, "'attention', 'mlp' or 'unembed'"),
    ],
)
def test_slot_hyper_params_reject(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        SlotHyperParams(**kwargs)


def test_cosine_and_constant_accepted():
    hp = SlotHyperParams(lr_schedule="cosine", total_steps=100, warmup_steps=10, loss_normalization="constant", loss_norm_tokens=128)
    assert hp.total_steps == 100 and hp.loss_norm_tokens == 128


def test_targets_take_one_order():
    """Equal target sets compare equal (the export cache and checkpoints key on them)."""
    assert SlotHyperParams(targets=["unembed", "attention"]).targets == ("attention", "unembed")
    assert SlotHyperParams(targets=("unembed",)).targets == ("unembed",)
