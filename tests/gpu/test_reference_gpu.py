"""GPU tier, fp32: lorafleet's CUDA trainer against the independent reference trainer.

tests/reference/test_trainer_against_reference.py's scenario (four adapters with different
everything, three mixed calls, accumulation across calls, slots stepping twice) with the
trainer on the GPU in fp32; the reference (HF + peft, torch.optim.AdamW, clip_grad_norm_,
LambdaLR) trains each adapter alone on the CPU. The other GPU tests compare the mixed step
with each adapter alone *inside* the trainer, which cannot see a bug that hits every slot
alike (a wrong Adam coefficient in the CUDA kernel, a wrong loss normalization): this one
compares with code that shares nothing with it, at the CPU test's tolerance (REL_TOL).
"""

from __future__ import annotations

import pytest
import torch

from tests.reference import test_trainer_against_reference as scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def compared(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                             micro_batch_tokens=scenario.MICRO_BATCH_TOKENS, dtype="float32"))
    assert trainer.device.type == "cuda" and trainer.base.dtype == torch.float32
    return scenario.train_both(trainer, tiny_world / "model")


def test_fp32_cuda_trainer_matches_the_reference(compared):
    worst = scenario.assert_matches_reference(compared)
    print(f"fp32 CUDA trainer vs the reference: worst relative error {worst:.2e}")


def test_fp32_cuda_comparison_is_not_trivial(compared):
    scenario.assert_nontrivial(compared)
