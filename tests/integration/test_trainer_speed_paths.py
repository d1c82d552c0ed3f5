"""The trainer's speed paths train exactly like the previous padded path (fp32, CPU, tiny Qwen3).

Reference: the path of the first trainer version, kept selectable: padded micro-batches
(samples x longest), megatron-core's unfused local attention with an explicit causal
mask, the loss from full fp32 logits (``packed=False, layer_spec="local",
chunked_logprobs=False``). Against it, the proof scenario of test_trainer_equivalence.py
(4 slots, 3 calls, RL + SFT, KL to the base, accumulation, two phases, clipping) run
mixed through:

* the defaults: packed micro-batches (one token stream each, attention per sequence),
  fused SDPA attention, chunked log-probs (16-token chunks here: several per stream);
* padded micro-batches with fused attention and chunked log-probs;
* packed + full activation recomputation, and packed + selective (MLP) recomputation.

Every LoRA weight, Adam moment, pending gradient, loss and gradient norm agrees with
the padded path within 2e-5 relative (fp32 differs only by summation order; the
scenario's own noise floor is about 1e-5, see SPEED_PATH_TOL), and mixed equals
alone on each speed path within the proof's 1e-5. A forward hook counts MLP calls to show that recomputation ran.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REFERENCE = dict(packed=False, layer_spec="local", chunked_logprobs=False)
VARIANTS = {
    "packed_fused_chunked": {},
    "padded_fused_chunked": dict(packed=False),
    "packed_recompute_full": dict(recompute="full"),
    "packed_recompute_selective": dict(recompute="selective"),
}
CHUNK_TOKENS = 16
# fp32 noise floor of this scenario (3 Adam steps, eps 1e-2): mixed vs alone on the padded
# path itself differs by up to 6.1e-6; the speed paths vs the padded path by up to 1.1e-5
# (measured; in the step losses and second moments). Twice that is allowed.
SPEED_PATH_TOL = 2e-5


def _scenario_module():
    path = Path(__file__).resolve().parent / "test_trainer_equivalence.py"
    spec = importlib.util.spec_from_file_location("trainer_equivalence_scenario_speed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scenario = _scenario_module()


def _trainer(tiny_world, **overrides):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                        micro_batch_tokens=scenario.MICRO_BATCH_TOKENS, logprob_chunk_tokens=CHUNK_TOKENS,
                        **overrides)
    return MultiLoraTrainer(cfg)


@pytest.fixture(scope="module")
def reference(tiny_world):
    trainer = _trainer(tiny_world, **REFERENCE)
    assert trainer.base.layer_spec == "local"
    batches = scenario.make_batches(trainer)
    run = scenario.run_scenario(trainer, scenario.make_hypers(scenario.OBJECTIVES["mixed"]), batches)
    return batches, run


def _mlp_calls(trainer) -> list[int]:
    calls = [0]
    mlp = trainer.base.model.decoder.layers[0].mlp
    mlp.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_speed_path_trains_like_the_padded_path(tiny_world, reference, variant):
    from trainer.base.fused_attention import FusedCoreAttention

    batches, ref = reference
    overrides = VARIANTS[variant]
    trainer = _trainer(tiny_world, **overrides)
    assert trainer.base.layer_spec == "fused"
    assert all(isinstance(layer.self_attention.core_attention, FusedCoreAttention)
               for layer in trainer.base.model.decoder.layers)
    calls = _mlp_calls(trainer)
    run = scenario.run_scenario(trainer, scenario.make_hypers(scenario.OBJECTIVES["mixed"]), batches)
    scenario._assert_nontrivial(run, scenario.OBJECTIVES["mixed"])
    worst = scenario.assert_equivalent(run["mixed"], ref["mixed"], tol=SPEED_PATH_TOL)
    scenario.assert_equivalent(run["alone"], ref["alone"], tol=SPEED_PATH_TOL)
    # and the proof's bound on the path itself (padded rows: their own fp32 order, scenario.PADDED_TOL)
    scenario.assert_equivalent(run["mixed"], run["alone"], tol=scenario.PADDED_TOL if variant.startswith("padded") else scenario.REL_TOL)
    print(f"{variant}: worst relative error vs the padded path {worst:.2e}")
    assert worst > 0  # a different computation, not a copy

    # Recomputation really ran: one SFT sample (one micro-batch, no KL pass) calls the
    # first layer's MLP once in forward, and once more in backward when it is recomputed.
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams

    trainer.init_slot(0, SlotHyperParams(rank=4, objective="sft", samples_per_step=8), seed=1)
    calls[0] = 0
    trainer.train(TrainBatch(samples=[TrainSample(slot=0, tokens=[5, 6, 7, 8], loss_mask=[0, 1, 1, 1])]))
    trainer.clear_slot(0)
    assert calls[0] == (2 if overrides.get("recompute", "none") != "none" else 1)
    assert trainer.base.model.training == (overrides.get("recompute", "none") != "none")


def test_packed_needs_a_fused_spec():
    from pydantic import ValidationError

    from trainer.config import TrainerConfig

    with pytest.raises(ValidationError, match="set packed: false"):
        TrainerConfig(base_model_path="/m", layer_spec="local")
    assert TrainerConfig(base_model_path="/m", layer_spec="local", packed=False).packed is False
    cfg = TrainerConfig(base_model_path="/m")
    assert (cfg.packed, cfg.chunked_logprobs, cfg.recompute, cfg.layer_spec) == (True, True, "none", "auto")


def test_frozen_base_pass_is_the_base_and_changes_nothing(tiny_world, reference):
    """The benchmark floor: the batch's learned-token log-probs through the base alone, along
    the packed path, equal the padded reference's; no slot gradient or weight moves."""
    from benchmarks.trainer_floor import frozen_base_pass

    from trainer.base.base_model import token_logprobs

    batches, _ = reference
    trainer = _trainer(tiny_world)
    batch = batches[0]
    total = frozen_base_pass(trainer, batch)
    expected = 0.0
    for s in batch.samples:
        ids = torch.tensor(s.tokens)
        lp = token_logprobs(trainer.base, ids[None, :-1], ids[None, 1:])[0]
        expected += float((lp * torch.tensor(s.loss_mask[1:], dtype=torch.float32)).sum())
    assert total == pytest.approx(expected, rel=1e-5) and total < 0
    assert trainer.buffers.grad.abs().max() == 0 and trainer.buffers.weight.abs().max() == 0
