"""Slot lifecycle on the real tiny Megatron model (fp32, CPU): isolation, a
non-finite slot, PEFT export parity with HF+peft, starting from a PEFT folder,
and slot checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

NUM_SLOTS = 4
RANKS = [4, 8, 2, 8]


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=NUM_SLOTS, max_rank=8, micro_batch_tokens=64))


def hyper(slot, **kw):
    from trainer.config import SlotHyperParams

    base = dict(rank=RANKS[slot], alpha=2.0 * RANKS[slot], lr=2e-2, samples_per_step=2, objective="sft" if slot % 2 else "rl")
    return SlotHyperParams(**(base | kw))


def samples(slots, seed=0, vocab=400):
    from trainer.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in slots:
        n = int(torch.randint(6, 12, (1,), generator=g))
        out.append(TrainSample(slot=slot, tokens=torch.randint(0, vocab, (n,), generator=g).tolist(),
                               loss_mask=[0, 0] + [1] * (n - 2), advantage=float(torch.randn(1, generator=g))))
    return out


def batch(slots, seed=0):
    from trainer.batch import TrainBatch

    return TrainBatch(samples=samples(slots, seed))


def reset(trainer, overrides=None):
    for slot in range(NUM_SLOTS):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, hyper(slot, **(overrides or {}).get(slot, {})), seed=10 + slot)


def snapshot(trainer):
    """Every slot's raw slices: weights, grads, moments (all rows, padding included)."""
    out = {}
    for slot in range(NUM_SLOTS):
        out[slot] = [t[slot].clone() for t in [p.data for p in trainer.buffers.params] + [p.grad for p in trainer.buffers.params]
                     + trainer.buffers.exp_avg_views + trainer.buffers.exp_avg_sq_views]
    return out


def assert_same(a, b, slots):
    """Bit-identical (NaN counts as equal to NaN)."""
    for slot in slots:
        for x, y in zip(a[slot], b[slot]):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=f"slot {slot} changed")


def assert_padding_zero(trainer):
    for slot, r in enumerate(RANKS):
        for i, layer in enumerate(trainer.layers):
            for t in (layer.lora_A.data, layer.lora_A.grad, trainer.buffers.exp_avg_views[2 * i], trainer.buffers.exp_avg_sq_views[2 * i]):
                assert torch.count_nonzero(t[slot, r:]) == 0
            for t in (layer.lora_B.data, layer.lora_B.grad, trainer.buffers.exp_avg_views[2 * i + 1], trainer.buffers.exp_avg_sq_views[2 * i + 1]):
                assert torch.count_nonzero(t[slot, :, r:]) == 0


def test_isolation_step_clear_reinit(trainer):
    reset(trainer)
    res = trainer.train(batch([0, 1, 1, 2, 2, 3, 0, 3]))  # every slot steps
    assert res.stepped == [0, 1, 2, 3]
    trainer.train(batch([1], seed=1))  # slot 1 now has a pending (accumulated) gradient
    assert slot_status(trainer, 1)["pending_samples"] == 1
    assert_padding_zero(trainer)

    before = snapshot(trainer)
    res = trainer.train(batch([0, 0], seed=2))  # step slot 0 only
    assert res.stepped == [0]
    after = snapshot(trainer)
    assert_same(before, after, [1, 2, 3])
    assert not torch.equal(before[0][0], after[0][0])

    trainer.clear_slot(2)
    cleared = snapshot(trainer)
    assert_same(after, cleared, [0, 1, 3])
    assert all(torch.count_nonzero(t) == 0 for t in cleared[2])
    assert slot_status(trainer, 2) == {"slot": 2, "active": False}

    trainer.init_slot(2, hyper(2), seed=99)
    reinit = snapshot(trainer)
    assert_same(cleared, reinit, [0, 1, 3])
    assert slot_status(trainer, 2)["step"] == 0
    assert_padding_zero(trainer)


def test_bad_requests_change_nothing(trainer):
    from trainer.batch import TrainBatch, TrainSample

    reset(trainer)
    trainer.clear_slot(3)
    before = snapshot(trainer)
    cases = [
        (lambda: trainer.train(batch([0, 3])), "sample 1: slot 3 is not initialized"),
        (lambda: trainer.train(batch([0, 7])), "sample 1: slot 7 out of range 0..3"),
        (lambda: trainer.train(TrainBatch(samples=[TrainSample(slot=0, tokens=[1, 500], loss_mask=[0, 1])])), "token id 500 >= vocab size 400"),
        (lambda: trainer.init_slot(0, hyper(0), seed=1), "slot 0 is in use; clear it"),
        (lambda: trainer.init_slot(3, hyper(3, rank=9), seed=1), "rank 9 exceeds the trainer's max_rank 8"),
        (lambda: trainer.export.export_peft(3, "/tmp/nowhere"), "slot 3 is not initialized"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert_same(before, snapshot(trainer), range(NUM_SLOTS))


def test_foreign_registration_dropped(trainer):
    from trainer.batch import TrainBatch

    reset(trainer)
    trainer.clear_slot(0)
    trainer.init_slot(0, hyper(0), seed=1, registration="reg-A")
    s = samples([0, 0, 1, 1])
    s[0] = s[0].model_copy(update={"registration": "reg-OLD"})
    s[1] = s[1].model_copy(update={"registration": "reg-A"})
    res = trainer.train(TrainBatch(samples=s))
    assert res.dropped_foreign == {0: 1}
    assert res.slots[0].samples == 1 and slot_status(trainer, 0)["pending_samples"] == 1
    assert res.stepped == [1]


def test_nonfinite_slot_skips_only_its_step(trainer):
    reset(trainer)
    # Fault injection (named as such): a diverged adapter, which a healthy run cannot produce
    # on demand: one weight of slot 0 set to NaN.
    with torch.no_grad():
        trainer.layers[0].lora_A.data[0, 0, 0] = float("nan")
    before = snapshot(trainer)
    res = trainer.train(batch([0, 0, 1, 1, 2, 2]))
    assert res.skipped_nonfinite == [0] and res.stepped == [1, 2]
    assert res.slots[0].steps[0].skipped_nonfinite
    after = snapshot(trainer)
    assert_same(before, after, [0, 3])  # slot 0: nothing applied (and its gradient discarded)
    assert slot_status(trainer, 0)["step"] == 0 and slot_status(trainer, 0)["pending_samples"] == 0
    assert slot_status(trainer, 1)["step"] == 1 and slot_status(trainer, 2)["step"] == 1
    for slot in (1, 2):
        assert all(torch.isfinite(t).all() for t in after[slot])
        assert not torch.equal(before[slot][1], after[slot][1])  # B moved
        assert torch.isfinite(torch.tensor(res.slots[slot].steps[0].grad_norm))


def _hf_peft_logits(hf_model, folder, ids):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model, str(folder))
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.unload()  # give back the plain HF model for the next test


def test_export_parity_with_hf_peft(trainer, hf_model, tmp_path):
    from tests.trainer_probes import forward_logits

    reset(trainer)
    for seed in range(3):
        trainer.train(batch([0, 0, 1, 1, 2, 2, 3, 3], seed=seed))
    ids = torch.randint(0, 400, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = hf_model(ids).logits
    for slot in (0, 1, 2):
        folder = trainer.export.export_peft(slot, tmp_path / f"slot{slot}")
        cfg = json.loads((tmp_path / f"slot{slot}" / "adapter_config.json").read_text())
        assert cfg["r"] == RANKS[slot] and cfg["lora_alpha"] == 2.0 * RANKS[slot]
        assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        ours = forward_logits(trainer, ids, slot)
        ref = _hf_peft_logits(hf_model, folder, ids)
        assert (ours - ref).abs().max().item() <= 1e-5
        assert (ref - base_logits).abs().max().item() > 1e-2  # the adapter really changes the output
    cfg, tensors = trainer.export.peft_tensors(1)
    from safetensors.torch import load_file

    on_disk = load_file(str(tmp_path / "slot1" / "adapter_model.safetensors"))
    assert set(tensors) == set(on_disk) and all(torch.equal(tensors[k], on_disk[k]) for k in tensors)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (RANKS[1], 64)


def test_init_from_peft_folder(trainer, hf_model, tmp_path):
    """A peft-made adapter (different lora_A for q/k/v and gate/up) loads exactly (stacked to
    rank 2r/3r); our own export loads back bit-exactly; bad folders are refused."""
    from tests.trainer_probes import forward_logits
    from trainer.swap.slot_checkpoint import slot_state_tensors

    from peft import LoraConfig, get_peft_model

    reset(trainer)
    torch.manual_seed(0)
    peft_cfg = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                          init_lora_weights=False)
    peft_model = get_peft_model(hf_model, peft_cfg)
    peft_model.save_pretrained(tmp_path / "hf_made")
    peft_model.unload()
    ids = torch.randint(0, 400, (2, 13), generator=torch.Generator().manual_seed(6))
    ref = _hf_peft_logits(hf_model, tmp_path / "hf_made", ids)

    trainer.clear_slot(3)
    status = trainer.init_slot(3, hyper(3, rank=2, alpha=6.0), seed=0, init_from=tmp_path / "hf_made")
    assert status["rank"] == 6  # q/k/v lora_A differ: stacked [A_q; A_k; A_v]
    assert (forward_logits(trainer, ids, 3) - ref).abs().max().item() <= 1e-5
    # exported again, it is still the same function for peft
    trainer.export.export_peft(3, tmp_path / "again")
    assert (_hf_peft_logits(hf_model, tmp_path / "again", ids) - ref).abs().max().item() <= 1e-5

    # our own export round-trips bit-exactly into another slot
    trainer.train(batch([0, 0], seed=3))
    trainer.export.export_peft(0, tmp_path / "slot0")
    trainer.clear_slot(2)
    trainer.init_slot(2, hyper(0), seed=123, init_from=tmp_path / "slot0")
    a = slot_state_tensors(trainer, 0)["weight"]
    b = slot_state_tensors(trainer, 2)["weight"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in (0, 1) for k in a[i])

    trainer.clear_slot(2)
    wide = get_peft_model(hf_model, LoraConfig(r=3, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False))
    wide.save_pretrained(tmp_path / "wide")
    wide.unload()
    for hp, folder, message in [
        (hyper(0, rank=8), tmp_path / "slot0", "init_from adapter has r=4"),
        (hyper(0, rank=3, alpha=3.0), tmp_path / "wide", "needs rank 9 in the slot .* above max_rank 8"),
        (hyper(0), tmp_path / "missing", "missing is not a complete folder"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            trainer.init_slot(2, hp, seed=1, init_from=folder)
        assert slot_status(trainer, 2) == {"slot": 2, "active": False}
    (tmp_path / "rs").mkdir()
    cfg = json.loads((tmp_path / "slot0" / "adapter_config.json").read_text()) | {"use_rslora": True}
    (tmp_path / "rs" / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "rs" / "adapter_model.safetensors").write_bytes((tmp_path / "slot0" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="use_rslora=True is not supported"):
        trainer.init_slot(2, hyper(0), seed=1, init_from=tmp_path / "rs")


def test_slot_state_round_trip_resumes_exactly(trainer, tmp_path):
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state, slot_state_tensors

    reset(trainer, {1: dict(samples_per_step=3)})
    trainer.train(batch([1, 1, 1], seed=0))  # one step
    trainer.train(batch([1], seed=1))  # one sample pending
    save_slot_state(trainer, 1, tmp_path / "state")
    meta = json.loads((tmp_path / "state" / "slot_state.json").read_text())
    assert meta["step"] == 1 and meta["pending_samples"] == 1
    saved = slot_state_tensors(trainer, 1)

    nxt = batch([1, 1], seed=2)  # completes the step
    res_orig = trainer.train(nxt)
    after_orig = slot_state_tensors(trainer, 1)

    trainer.clear_slot(2)
    status = load_slot_state(trainer, 2, tmp_path / "state")
    assert status["step"] == 1 and status["pending_samples"] == 1
    loaded = slot_state_tensors(trainer, 2)
    for kind in saved:
        for side in (0, 1):
            assert all(torch.equal(saved[kind][side][k], loaded[kind][side][k]) for k in saved[kind][side])
    res_loaded = trainer.train(nxt.model_copy(update={"samples": [s.model_copy(update={"slot": 2}) for s in nxt.samples]}))
    after_loaded = slot_state_tensors(trainer, 2)
    assert res_loaded.slots[2].steps == res_orig.slots[1].steps
    for kind in after_orig:
        for side in (0, 1):
            assert all(torch.equal(after_orig[kind][side][k], after_loaded[kind][side][k]) for k in after_orig[kind][side])
    with pytest.raises(ValueError, match="slot 2 is in use"):
        load_slot_state(trainer, 2, tmp_path / "state")


def test_a_background_slot_state_holds_the_state_when_it_was_asked_for(trainer, tmp_path):
    """TrainWorker.save_slot_state_in_background (a Tinker model's periodic snapshot, issue 41): the state
    is taken at the call, written later on rank 0's slot-state writer (held here until the slot has
    trained on), and the folder equals the one save_slot_state writes at the same point, file by file:
    what trains after the call is not in it (on a CPU trainer the gathered blocks are views of the
    slot's buffers, so the snapshot must copy them)."""
    from safetensors.torch import load_file

    from tests.trainer_probes import hold_writer
    from trainer.actor import TrainWorker
    from trainer.swap.slot_checkpoint import save_slot_state

    reset(trainer, {1: dict(samples_per_step=3)})
    trainer.train(batch([1, 1, 1], seed=0))  # one step
    trainer.train(batch([1], seed=1))  # one sample pending: a gradient too
    worker = TrainWorker(trainer)
    save_slot_state(trainer, 1, tmp_path / "now")  # the reference, written at once
    hold_writer(worker._state_writer(), True)  # noqa: SLF001 - the write waits until the slot has changed
    assert worker.save_slot_state_in_background(1, tmp_path / "later") == str(tmp_path / "later")
    trainer.train(batch([1, 1], seed=2))  # completes the step: weights, moments and gradient change
    assert not (tmp_path / "later").exists()
    hold_writer(worker._state_writer(), False)  # noqa: SLF001
    assert worker.wait_slot_state(tmp_path / "later") == str(tmp_path / "later")
    now, later = load_file(str(tmp_path / "now" / "slot_state.safetensors")), load_file(str(tmp_path / "later" / "slot_state.safetensors"))
    assert now.keys() == later.keys() and all(torch.equal(now[k], later[k]) for k in now)
    assert (tmp_path / "now" / "slot_state.json").read_text() == (tmp_path / "later" / "slot_state.json").read_text()
    save_slot_state(trainer, 1, tmp_path / "after")
    after = load_file(str(tmp_path / "after" / "slot_state.safetensors"))
    assert any(not torch.equal(now[k], after[k]) for k in now)  # the slot did change after the call
