"""GPU tier: the optimizer step on a stream of its own (trainer/optim/step_overlap.py), dense and MoE.

The step is held back on its stream by a spin of the GPU (``StepOverlap.delay_cycles``, a fault
injected for the test: on these tiny worlds the step would otherwise finish before the host
gets to the next forward, and a missing wait could not show). With it:
* the equivalence scenario (four adapters, three mixed calls, then each alone) gives bit-identical
  losses, norms, weights, moments and gradients with the overlap on and off;
* ``train`` returns while the step still runs (the overlap is real, not a sync in disguise), and
  an export taken right then equals one taken after the device is idle;
* a background export taken right then gathers behind the step on its stream: the main stream
  runs on without waiting for the step, and a slot cleared on the main stream at once does not
  reach the folder (the clear waits for the gather);
* with the layers' waits switched off the same run differs: the held-back step is observable, so
  the first check can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration import test_trainer_equivalence as scenario
from tests.trainer_probes import slot_status

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DELAY_CYCLES = 200_000_000  # about 0.1 s at the H200's clock: far longer than a tiny world's forward


@pytest.fixture(scope="module", params=["dense", "moe"])
def world(request, tiny_world):
    """(world folder, the scenario's hypers there): the MoE scenario trains attention and mlp (its
    experts), as tests/integration/test_moe_trainer.py does."""
    hypers = scenario.make_hypers(scenario.OBJECTIVES["mixed"])
    if request.param == "dense":
        return tiny_world, hypers
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world(), [h.model_copy(update={"targets": ("attention", "mlp")}) for h in hypers]


def _trainer(world, overlap: bool):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    t = MultiLoraTrainer(TrainerConfig(base_model_path=str(world / "model"), num_slots=4, max_rank=8,
                                       micro_batch_tokens=scenario.MICRO_BATCH_TOKENS, dtype="float32",
                                       overlap_step=overlap, overlap_step_min_params=0))
    assert t.step_overlap.active is overlap
    return t


@pytest.fixture(scope="module")
def pair(world):
    folder, hypers = world
    on, off = _trainer(folder, True), _trainer(folder, False)
    on.step_overlap.delay_cycles = DELAY_CYCLES
    return on, off, scenario.make_batches(off), hypers


def _assert_identical(a: dict, b: dict) -> None:
    for slot in b:
        assert a[slot]["losses"] == b[slot]["losses"] and a[slot]["steps"] == b[slot]["steps"], slot
        for kind, sides in b[slot]["tensors"].items():
            for side, tensors in enumerate(sides):
                for name, t in tensors.items():
                    assert torch.equal(a[slot]["tensors"][kind][side][name], t), (slot, kind, name)


def test_overlapped_step_is_bit_identical(pair):
    on, off, batches, hypers = pair
    got, want = scenario.run_scenario(on, hypers, batches), scenario.run_scenario(off, hypers, batches)
    for run in ("mixed", "alone"):
        _assert_identical(got[run], want[run])


def _one_round(pair, seed: int, before_train=None) -> None:  # noqa: ANN001
    """Fresh slots on both trainers, then one train call each, ``on`` last: nothing runs between its
    call and the caller's checks. ``before_train(on)`` runs just before ``on``'s call."""
    on, off, batches, hypers = pair
    for t in (off, on):
        for slot, h in enumerate(hypers):
            if slot_status(t, slot)["active"]:
                t.clear_slot(slot)
            t.init_slot(slot, h, seed=seed + slot)
        if t is on and before_train is not None:
            before_train(on)
        t.train(batches[0])


def _assert_same_folders(tmp_path, *names: str) -> None:  # noqa: ANN001
    from safetensors.torch import load_file

    first, *others = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in names)
    for other in others:
        assert sorted(other) == sorted(first)
        for k in first:
            assert torch.equal(other[k], first[k]), k


def _clear(pair) -> None:  # noqa: ANN001
    on, off, _, hypers = pair
    for t in (on, off):
        for slot in range(len(hypers)):
            if slot_status(t, slot)["active"]:
                t.clear_slot(slot)


def test_train_returns_before_the_step_ends_and_exports_wait_for_it(pair, tmp_path):
    on, off = pair[:2]
    _one_round(pair, seed=100)
    assert on.step_overlap.pending()  # train returned with the step still running on its stream
    on.export.export_peft(0, tmp_path / "early")
    torch.cuda.synchronize()
    on.export.export_peft(0, tmp_path / "late")
    off.export.export_peft(0, tmp_path / "off")
    _assert_same_folders(tmp_path, "off", "early", "late")
    _clear(pair)


def test_background_export_gathers_behind_the_step_without_holding_the_main_stream(pair, tmp_path):
    on, off = pair[:2]
    # the writer's arena and processes start on first use: not inside the held-back step
    _one_round(pair, seed=200, before_train=lambda t: t.export.wait_export(
        t.export.export_peft_in_background(1, tmp_path / "warm")))
    on.export.export_peft_in_background(0, tmp_path / "on")
    main_done = torch.cuda.Event()
    main_done.record()
    main_done.synchronize()  # the main stream's work so far (the call's, the export's) ended ...
    assert on.step_overlap.pending()  # ... while the step and the gather behind it still run
    on.clear_slot(0)  # a writer of slot 0's rows on the main stream: must wait for the gather
    assert on.export.wait_export(tmp_path / "on") == str(tmp_path / "on")
    off.export.export_peft(0, tmp_path / "off")
    _assert_same_folders(tmp_path, "off", "on")
    _clear(pair)


def test_without_the_waits_the_held_back_step_shows(pair, monkeypatch):
    from trainer.optim.step_overlap import StepOverlap

    on, off, batches, hypers = pair
    monkeypatch.setattr(StepOverlap, "wait", lambda self, layer: None)
    got, want = scenario.run_scenario(on, hypers, batches), scenario.run_scenario(off, hypers, batches)
    with pytest.raises(AssertionError):
        _assert_identical(got["mixed"], want["mixed"])
