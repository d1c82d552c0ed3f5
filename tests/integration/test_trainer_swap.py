"""Keep-warm eviction on the real tiny Megatron model (fp32, CPU): a run swapped out and back in
between its steps (into other slots, through host memory, through a spill file, and through a
spill file read ahead by a prefetch, with a half-accumulated step in flight) ends bit-identical to
the same run trained resident; a swap changes no other slot; a spill that fails (a real ENOSPC, or
the spill folder's budget reached) leaves the slot resident and unchanged; a corrupt spill file
is refused (the slot stays free, nothing wrong is loaded); a trainer starting over a spill folder
removes what a previous process left there; a dropped key's prefetch is discarded."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.integration

NUM_SLOTS = 4
ALL_HOST = 2**40  # a host budget nothing here reaches


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


def prefetched(trainer, key: str) -> None:
    """Room in host memory, a prefetch of the spilled `key`, and its read finished."""
    from tests.waiting import wait_until

    trainer.swap.store.host_budget_bytes = ALL_HOST
    assert trainer.swap.prefetch(key) == "started"
    assert trainer.swap.prefetch(key) in ("prefetching", "prefetched")  # a second prefetch starts nothing
    wait_until(lambda: trainer.swap.prefetch(key) == "prefetched", f"the prefetch of {key!r}")


def spill_files(trainer) -> list[str]:
    return sorted(p.name for p in trainer.swap.store.spill_dir.iterdir() if not p.name.startswith(".lock"))


# Per call, X's samples (2 per step): call 0 steps once and leaves one pending, call 1 steps and leaves one
# pending, calls 2 and 3 step once each (4 steps). Y gets 2 samples (one step) every call.
X_SAMPLES = [3, 2, 1, 2]


def run(trainer, x_slots: list[int], swaps: list[str | None]):
    """Train X (RL) and Y (SFT, slot 1) through len(x_slots) calls; X sits in x_slots[i] for call i.
    Before call i > 0, swaps[i - 1] says how X goes out and back in: None (stays resident), "host",
    "disk" (a zero host budget forces a spill), or "prefetch" (spilled, then read ahead into host
    memory before the swap-in)."""
    from trainer.batch import TrainBatch

    clear_all(trainer)
    trainer.init_slot(x_slots[0], hyper("rl", kl_coef=0.05), seed=7, registration="x-reg")
    trainer.init_slot(1, hyper("sft", lr=1e-2), seed=8, registration="y-reg")
    for call, slot in enumerate(x_slots):
        how = swaps[call - 1] if call > 0 else None
        if how is not None:
            tier = "disk" if how in ("disk", "prefetch") else how
            trainer.swap.store.host_budget_bytes = 0 if tier == "disk" else ALL_HOST
            y_before = row_state(trainer, 1)
            out = trainer.swap.swap_out(x_slots[call - 1], "x")
            assert out["where"] == tier
            assert trainer.slots[x_slots[call - 1]] is None
            if how == "prefetch":
                prefetched(trainer, "x")
            back = trainer.swap.swap_in(slot, "x")
            assert back["from"] == tier and trainer.swap.swapped()["keys"] == []
            assert back["prefetched"] == (how == "prefetch")
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
    trainer.swap.store.host_budget_bytes = ALL_HOST
    trainer.swap.swap_out(0, "p")
    trainer.swap.swap_in(3, "p")
    assert_bit_identical(before, row_state(trainer, 3), "a pending half step")


def test_failed_spill_keeps_the_slot(trainer, tmp_path):
    """A real ENOSPC: the spill's temporary file is a link to /dev/full."""
    from trainer.swap.slot_swap import SwapError

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
        trainer.swap.store.spill_dir, trainer.swap.store.host_budget_bytes = old_dir, ALL_HOST
    assert trainer.swap.swapped()["keys"] == []
    assert_bit_identical(before, row_state(trainer, 2), "the slot after a failed spill")


def test_bad_swaps_are_refused(trainer):
    from trainer.swap.slot_swap import SwapError

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


def test_prefetched_spill_is_bit_identical_to_resident(trainer):
    """A spill file read ahead into host memory by a prefetch, then swapped in (twice, into other
    slots), then a spill swapped in without one: all bit-identical to staying resident."""
    x_ref, y_ref = run(trainer, [0, 0, 0, 0], [None, None, None])
    x_got, y_got = run(trainer, [0, 2, 3, 0], ["prefetch", "prefetch", "disk"])
    assert_bit_identical(x_ref, x_got, "X through prefetched spill files")
    assert_bit_identical(y_ref, y_got, "Y beside a prefetched X")
    assert spill_files(trainer) == []


def test_spill_budget_reached_keeps_the_slot(trainer):
    """With host memory full, an eviction that would pass the spill folder's budget is refused:
    the slot stays resident and unchanged, nothing is stored or written."""
    from trainer.swap.slot_swap import SwapError

    clear_all(trainer)
    store = trainer.swap.store
    for slot, reg in ((0, "a"), (2, "b")):
        trainer.init_slot(slot, hyper("sft"), seed=slot, registration=reg)
    store.host_budget_bytes = 0
    saved = store.disk_budget_bytes
    try:
        assert trainer.swap.swap_out(0, "a")["where"] == "disk"
        one_file = store.disk_bytes()
        store.disk_budget_bytes = 2 * one_file - 1  # room for one spill file, not two
        before = row_state(trainer, 2)
        with pytest.raises(SwapError, match=r"spill folder .* is at its budget: \d+ of \d+ bytes held, \d+ more needed"):
            trainer.swap.swap_out(2, "b")
        assert_bit_identical(before, row_state(trainer, 2), "the slot after a refused spill")
        assert trainer.swap.swapped()["keys"] == ["a"] and spill_files(trainer) == ["a.rank0.swap"]
        assert trainer.swap.tiers()["disk"] == {"count": 1, "bytes": one_file, "budget_bytes": 2 * one_file - 1}
    finally:
        store.disk_budget_bytes, store.host_budget_bytes = saved, ALL_HOST
    assert trainer.swap.swap_out(2, "b")["where"] == "host"  # host memory again: it fits there
    tiers = trainer.swap.tiers()
    assert tiers["host"]["count"] == 1 and tiers["host"]["bytes"] == trainer.swap.swapped()["host_bytes"] > 0


@pytest.mark.parametrize("damage", ["payload", "header", "truncated"])
def test_corrupt_spill_file_is_refused(trainer, damage):
    """A spill file changed on disk fails its swap-in (directly, and through a prefetch) with a
    clear SwapError: the target slot stays free and zero, the snapshot stays stored, dropping it
    removes the file."""
    from trainer.swap.slot_swap import SwapError

    clear_all(trainer)
    trainer.init_slot(0, hyper("rl"), seed=3, registration="c")
    trainer.swap.store.host_budget_bytes = 0
    trainer.swap.swap_out(0, "c")
    path = trainer.swap.store.spill_dir / "c.rank0.swap"
    data = bytearray(path.read_bytes())
    if damage == "payload":
        data[len(data) // 2] ^= 0x01  # one bit of one weight, gradient or moment
    elif damage == "header":
        data[40] ^= 0x01  # inside the JSON header
    else:
        del data[len(data) - 100 :]
    path.write_bytes(bytes(data))
    message = {"payload": "checksum mismatch", "header": "header checksum mismatch", "truncated": "truncated"}[damage]
    for ahead in (False, True):
        if ahead:
            prefetched(trainer, "c")
        with pytest.raises(SwapError, match=f"reading spilled snapshot 'c' .*{message}"):
            trainer.swap.swap_in(3, "c")
        assert trainer.slots[3] is None
        assert all(torch.count_nonzero(t[3]) == 0 for t in trainer.buffers.by_kind().values())
        assert trainer.swap.swapped()["keys"] == ["c"]
    trainer.swap.store.host_budget_bytes = ALL_HOST
    assert trainer.swap.drop("c") and spill_files(trainer) == [] and trainer.swap.swapped()["keys"] == []


def test_drop_of_a_prefetched_key_discards_it(trainer):
    """Dropping a key while its prefetch is under way or done removes its file and frees its host
    memory; a later prefetch or swap-in of it finds nothing; unknown and host keys start nothing."""
    from trainer.swap.slot_swap import SwapError

    clear_all(trainer)
    trainer.init_slot(0, hyper("sft"), seed=1, registration="d")
    trainer.init_slot(2, hyper("sft"), seed=2, registration="h")
    trainer.swap.store.host_budget_bytes = 0
    trainer.swap.swap_out(0, "d")
    assert trainer.swap.prefetch("d") == "no room"  # a prefetch takes host room like any snapshot
    trainer.swap.store.host_budget_bytes = ALL_HOST
    trainer.swap.swap_out(2, "h")
    assert trainer.swap.prefetch("h") == "host" and trainer.swap.prefetch("nope") == "absent"
    for wait in (False, True):
        if wait:
            trainer.swap.store.host_budget_bytes = 0
            trainer.init_slot(0, hyper("sft"), seed=1, registration="d")
            trainer.swap.swap_out(0, "d")
            prefetched(trainer, "d")
        else:
            assert trainer.swap.prefetch("d") == "started"
        assert trainer.swap.tiers()["prefetched"]["count"] == 1
        assert trainer.swap.drop("d")
        assert spill_files(trainer) == [] and trainer.swap.swapped()["keys"] == ["h"]
        assert trainer.swap.tiers()["prefetched"] == {"count": 0, "bytes": 0}
        assert trainer.swap.prefetch("d") == "absent" and not trainer.swap.drop("d")
        with pytest.raises(SwapError, match="no evicted slot 'd'"):
            trainer.swap.swap_in(0, "d")
    assert trainer.swap.swap_in(0, "h")["from"] == "host"


def test_a_trainer_starting_over_a_spill_folder_removes_what_a_previous_one_left(tiny_world, tmp_path, monkeypatch):
    """Spill files of a previous process (this rank's, temporaries, the older .pt format, and rank
    0 also those of ranks beyond the world size) are removed when a trainer starts over the folder;
    other files stay; a second live trainer on the same folder is refused."""
    from trainer.swap import swap_store
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.swap.slot_swap import SwapError

    spill = tmp_path / "spill"
    spill.mkdir()
    left = ["k1.rank0.swap", "k2.rank0.tmp", "k3.rank0.pt", "k4.rank3.swap"]
    kept = ["notes.txt", "k5.rank0.swap.bak", "k6.swap"]
    for name in left + kept:
        (spill / name).write_bytes(b"from a previous process")
    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=1, max_rank=4, swap_spill_dir=str(spill))
    fresh = MultiLoraTrainer(cfg)
    assert sorted(p.name for p in spill.iterdir() if not p.name.startswith(".lock")) == sorted(kept)
    monkeypatch.setattr(swap_store, "FOLDER_LOCK_WAIT_S", 0.0)
    with pytest.raises(SwapError, match="is in use by another trainer"):
        swap_store.SwapStore(0, spill, 2**20)
    assert fresh.swap.swapped()["keys"] == []
