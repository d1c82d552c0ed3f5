"""Keep-warm eviction on the real tiny Megatron model (fp32, CPU): a run swapped out and back in
between its steps (into other slots, through host memory and through a spill file, with a
half-accumulated step in flight) ends bit-identical to the same run trained resident; a swap
changes no other slot; a spill that fails (a real ENOSPC) leaves the slot resident and unchanged."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.integration

NUM_SLOTS = 4


@pytest.fixture(scope="module")
def trainer(tiny_world, tmp_path_factory):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    spill = tmp_path_factory.mktemp("spill")
    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=NUM_SLOTS, max_rank=8,
                                          micro_batch_tokens=64, swap_spill_dir=str(spill)))


@pytest.fixture(scope="module")
def moe_trainer(tmp_path_factory):
    from examples.tiny_moe.build import ensure_tiny_moe_world
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    world = ensure_tiny_moe_world()
    return MultiLoraTrainer(TrainerConfig(base_model_path=str(world / "model"), num_slots=NUM_SLOTS, max_rank=8,
                                          micro_batch_tokens=64, swap_spill_dir=str(tmp_path_factory.mktemp("spill"))))


def hyper(objective: str, **kw):
    from trainer.config import SlotHyperParams

    base = dict(rank=4, alpha=8.0, lr=3e-2, samples_per_step=2, objective=objective, lr_schedule="cosine",
                warmup_steps=1, total_steps=6, weight_decay=0.01, betas=(0.8, 0.95))
    return SlotHyperParams(**(base | kw))


def samples(slot: int, n: int, seed: int, registration: str):
    from trainer.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(6, 12, (1,), generator=g))
        out.append(TrainSample(slot=slot, tokens=torch.randint(0, 400, (k,), generator=g).tolist(),
                               loss_mask=[0, 0] + [1] * (k - 2), advantage=float(torch.randn(1, generator=g)),
                               registration=registration))
    return out


def row_state(trainer, slot):
    """Everything slot `slot` owns: its four buffer rows and its counters."""
    b = trainer.buffers
    st = trainer.slots[slot]
    rows = [t[slot].clone() for t in (b.weight, b.grad, b.exp_avg, b.exp_avg_sq)]
    return rows, (st.step, st.pending_samples, st.pending.clone(), st.rank, st.scale, st.registration, st.hyper)


def assert_bit_identical(a, b, what):
    (rows_a, meta_a), (rows_b, meta_b) = a, b
    for kind, x, y in zip(("weight", "grad", "exp_avg", "exp_avg_sq"), rows_a, rows_b):
        assert torch.equal(x, y), f"{what}: {kind} differs (max abs {float((x - y).abs().max()):.3g})"
    assert meta_a[:2] == meta_b[:2] and torch.equal(meta_a[2], meta_b[2]) and meta_a[3:] == meta_b[3:], f"{what}: counters differ"


def clear_all(trainer):
    for slot in range(NUM_SLOTS):
        if trainer.slots[slot] is not None:
            trainer.clear_slot(slot)
    for key in trainer.swap.swapped()["keys"]:
        trainer.swap.drop(key)


# Per call, X's samples (2 per step): call 0 steps once and leaves one pending, call 1 steps and leaves one
# pending, calls 2 and 3 step once each (4 steps). Y gets 2 samples (one step) every call.
X_SAMPLES = [3, 2, 1, 2]


def run(trainer, x_slots: list[int], swaps: list[str | None]):
    """Train X (RL) and Y (SFT, slot 1) through len(x_slots) calls; X sits in x_slots[i] for call i.
    Before call i > 0, swaps[i - 1] says how X goes out and back in: None (stays resident), "host",
    or "disk" (a zero host budget forces a spill)."""
    from trainer.batch import TrainBatch

    clear_all(trainer)
    trainer.init_slot(x_slots[0], hyper("rl", kl_coef=0.05), seed=7, registration="x-reg")
    trainer.init_slot(1, hyper("sft", lr=1e-2), seed=8, registration="y-reg")
    for call, slot in enumerate(x_slots):
        how = swaps[call - 1] if call > 0 else None
        if how is not None:
            trainer.swap.store.host_budget_bytes = 0 if how == "disk" else None
            y_before = row_state(trainer, 1)
            out = trainer.swap.swap_out(x_slots[call - 1], "x")
            assert out["where"] == how
            assert trainer.slots[x_slots[call - 1]] is None
            back = trainer.swap.swap_in(slot, "x")
            assert back["from"] == how and trainer.swap.swapped()["keys"] == []
            assert_bit_identical(y_before, row_state(trainer, 1), "Y across X's swap")
        batch = samples(slot, X_SAMPLES[call], seed=100 + call, registration="x-reg") + samples(1, 2, seed=200 + call, registration="y-reg")
        trainer.train(TrainBatch(samples=batch))
    return row_state(trainer, x_slots[-1]), row_state(trainer, 1)


def test_swapped_run_is_bit_identical_to_resident(trainer):
    x_ref, y_ref = run(trainer, [0, 0, 0, 0], [None, None, None])
    assert x_ref[1][:2] == (4, 0)  # 4 steps, nothing pending
    # Out with a pending sample and back into the same slot (host), out with a pending sample into
    # another slot through a spill file, then into a third slot (host).
    x_swapped, y_swapped = run(trainer, [0, 0, 2, 3], ["host", "disk", "host"])
    assert_bit_identical(x_ref, x_swapped, "X swapped through host memory and a spill file")
    assert_bit_identical(y_ref, y_swapped, "Y beside a swapped X")


def test_swapped_moe_run_is_bit_identical_to_resident(moe_trainer):
    """Expert LoRA (lora_experts, the default) lives in the same slot rows and comes back with its scale."""
    x_ref, y_ref = run(moe_trainer, [0, 0, 0, 0], [None, None, None])
    x_swapped, y_swapped = run(moe_trainer, [0, 0, 2, 3], ["host", "disk", "host"])
    assert_bit_identical(x_ref, x_swapped, "MoE X swapped through host memory and a spill file")
    assert_bit_identical(y_ref, y_swapped, "MoE Y beside a swapped X")


def test_swap_of_pending_half_step_is_exact(trainer):
    from trainer.batch import TrainBatch

    clear_all(trainer)
    trainer.init_slot(0, hyper("rl"), seed=3, registration="p")
    trainer.train(TrainBatch(samples=samples(0, 1, seed=5, registration="p")))  # one of two samples: pending
    before = row_state(trainer, 0)
    assert before[1][1] == 1 and torch.count_nonzero(before[0][1]) > 0  # a pending gradient is there
    trainer.swap.store.host_budget_bytes = None
    trainer.swap.swap_out(0, "p")
    trainer.swap.swap_in(3, "p")
    assert_bit_identical(before, row_state(trainer, 3), "a pending half step")


def test_failed_spill_keeps_the_slot(trainer, tmp_path):
    """A real ENOSPC: the spill's temporary file is a link to /dev/full."""
    from trainer.slot_swap import SwapError

    clear_all(trainer)
    trainer.init_slot(2, hyper("sft"), seed=4, registration="f")
    before = row_state(trainer, 2)
    spill = tmp_path / "full"
    spill.mkdir()
    os.symlink("/dev/full", spill / "f.rank0.tmp")
    old_dir, trainer.swap.store.spill_dir = trainer.swap.store.spill_dir, spill
    trainer.swap.store.host_budget_bytes = 0
    try:
        with pytest.raises(SwapError, match="No space left on device"):
            trainer.swap.swap_out(2, "f")
    finally:
        trainer.swap.store.spill_dir, trainer.swap.store.host_budget_bytes = old_dir, None
    assert trainer.swap.swapped()["keys"] == []
    assert_bit_identical(before, row_state(trainer, 2), "the slot after a failed spill")


def test_bad_swaps_are_refused(trainer):
    from trainer.slot_swap import SwapError

    clear_all(trainer)
    trainer.init_slot(0, hyper("sft"), seed=1, registration="a")
    trainer.init_slot(1, hyper("sft"), seed=2, registration="b")
    with pytest.raises(SwapError, match="no evicted slot 'nope'"):
        trainer.swap.swap_in(2, "nope")
    trainer.swap.swap_out(0, "a")
    with pytest.raises(ValueError, match="slot 1 is in use"):
        trainer.swap.swap_in(1, "a")
    with pytest.raises(ValueError, match="slot 0 is not initialized"):
        trainer.swap.swap_out(0, "again")
    assert trainer.swap.swapped()["keys"] == ["a"]
    assert trainer.swap.drop("a") and trainer.swap.swapped()["keys"] == []
