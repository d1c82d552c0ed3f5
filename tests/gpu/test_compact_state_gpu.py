"""GPU tier: the compact optimizer state (bf16 moments, stochastic rounding: trainer/optim/compact_state.py)
in the trainer's overlapped step (trainer/optim/step_overlap.py), dense and MoE.

The equivalence scenario (four adapters, three mixed calls, then each alone) with slots 1 and 3
keeping bf16 moments: the step overlapped on its stream (held back by a spin of the GPU, as in
tests/gpu/test_step_overlap_gpu.py) gives bit-identical losses, norms, weights, moments and
gradients to the step in order (that this check fails without the layers' waits is shown on the
same harness by tests/gpu/test_step_overlap_gpu.py). The compiled kernel against the reference:
tests/unit/test_compact_adamw.py run on the device (its ``kernel`` cases take the GPU there).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_step_overlap_gpu import DELAY_CYCLES, _assert_identical, _trainer
from tests.integration import test_trainer_equivalence as scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
COMPACT_SLOTS = (1, 3)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, tiny_world):
    hypers = scenario.make_hypers(scenario.OBJECTIVES["mixed"])
    folder = tiny_world
    if request.param == "moe":
        from examples.tiny_moe.build import ensure_tiny_moe_world

        folder = ensure_tiny_moe_world()
        hypers = [h.model_copy(update={"targets": ("attention", "mlp")}) for h in hypers]
    hypers = [h.model_copy(update={"state_dtype": "bfloat16"}) if i in COMPACT_SLOTS else h for i, h in enumerate(hypers)]
    on, off = _trainer(folder, True), _trainer(folder, False)
    on.step_overlap.delay_cycles = DELAY_CYCLES
    return on, off, scenario.make_batches(off), hypers


def test_overlapped_compact_step_is_bit_identical(pair):
    on, off, batches, hypers = pair
    got, want = scenario.run_scenario(on, hypers, batches), scenario.run_scenario(off, hypers, batches)
    for run in ("mixed", "alone"):
        _assert_identical(got[run], want[run])
    for slot in COMPACT_SLOTS:  # the moments were really bf16 (exact in fp32 after the round trip)
        m = want["mixed"][slot]["tensors"]["exp_avg_sq"][1]
        assert all(torch.equal(t, t.bfloat16().float()) for t in m.values()) and any(t.abs().max() > 0 for t in m.values())

