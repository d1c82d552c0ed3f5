"""Tinker forward_backward calls riding in the loop's train call: ONE mixed step (fp32, CPU,
the tiny Qwen3 through Megatron-Bridge, in-process trainer).

Loop slots 1 (RL, KL term, sequence_mean, 2 samples a step) and 3 (SFT, token_mean, 3
samples a step: it accumulates across calls) train two calls; Tinker models on slots 0
and 2 send three calls with different losses each time, riding in the same calls
(``RoundRunner.train_with``), then optim_step. Against

* the same work done apart: ``MultiLoraTrainer.train`` on the batch alone and Tinker's
  ``forward_backward`` alone (each Tinker slot's gradient after every call, and every
  slot's weights and Adam moments at the end), and
* independent references: the loop slots against tests/reference/trainer.py (HF + peft,
  torch AdamW, losses from their papers), the Tinker slots against HF + peft + AdamW with
  Tinker's published losses (test_tinker_ops.py's ``reference_run``).

Tolerances as the existing proofs: 1e-5 relative joined vs apart (different micro-batch
composition, same fp32 math), 5e-5 against the references. A bad Tinker call in a joined
step fails only itself. ~35 s on the 2-core machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integration.test_tinker_ops import ADAM, ALPHA, RANKS, make_data, reference_run
from tests.numerics import max_rel_err

pytestmark = pytest.mark.integration

TINKER = [0, 2]
LOOP = {  # every field differs between the two (eps >= 2e-3: see test_trainer_against_reference.py)
    1: dict(objective="rl", rank=4, alpha=8, lr=1e-2, betas=(0.9, 0.999), eps=1e-2, weight_decay=0.05,
            max_grad_norm=1.0, samples_per_step=2, clip_low=0.2, clip_high=0.28, kl_coef=0.2,
            loss_normalization="sequence_mean"),
    3: dict(objective="sft", rank=8, alpha=16, lr=5e-3, betas=(0.8, 0.99), eps=5e-3, weight_decay=0.1,
            max_grad_norm=0.5, samples_per_step=3, loss_normalization="token_mean"),
}
LOOP_CALLS = [{1: 2, 3: 2}, {1: 2, 3: 1}]  # slot 3 steps in call 2 on samples of both calls
UPDATES = {1: 2, 3: 1}
TINKER_CALLS = [  # (slot, loss_fn, loss_fn_config) per call
    [(0, "cross_entropy", None), (2, "ppo", None), (0, "importance_sampling", None)],
    [(2, "cross_entropy", None), (0, "dro", {"beta": 0.1}), (2, "cispo", None)],
]
MICRO_BATCH_TOKENS = 48  # several micro-batches per call, loop samples and datums sharing them
JOINED_VS_APART = 1e-5
VS_REFERENCE = 5e-5


@pytest.fixture(scope="module")
def ops(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.step.round_runner import RoundRunner

    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                             micro_batch_tokens=MICRO_BATCH_TOKENS))
    return RoundRunner(trainer)


def _base_lp(hf_model, tokens, targets):
    with torch.no_grad():
        logits = hf_model(torch.as_tensor(tokens)[None]).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(targets)[:, None])[:, 0]


@pytest.fixture(scope="module")
def work(hf_model):
    """Per call: the loop's TrainBatch and the Tinker calls as (slot, loss_fn, cfg, data)."""
    from trainer.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(5)
    batches = []
    for counts in LOOP_CALLS:
        samples = []
        for slot, n in counts.items():
            for _ in range(n):
                length = int(torch.randint(7, 16, (1,), generator=g))
                prompt = int(torch.randint(2, 5, (1,), generator=g))
                tokens = torch.randint(0, 400, (length,), generator=g)
                lp = _base_lp(hf_model, tokens[:-1], tokens[1:])
                rollout = [0.0] + (lp + 0.3 * torch.randn(length - 1, generator=g)).clamp(max=0).tolist()
                samples.append(TrainSample(slot=slot, tokens=tokens.tolist(), loss_mask=[0] * prompt + [1] * (length - prompt),
                                           advantage=float(torch.randn(1, generator=g)), rollout_logprobs=rollout))
        order = torch.randperm(len(samples), generator=g).tolist()
        batches.append(TrainBatch(samples=[samples[i] for i in order]))
    calls = [[(slot, fn, cfg, make_data(fn, seed=500 + 10 * s + c, base_lp_fn=lambda t, y: _base_lp(hf_model, t, y)))
              for c, (slot, fn, cfg) in enumerate(step)] for s, step in enumerate(TINKER_CALLS)]
    return batches, calls


def fresh(ops):
    from trainer.config import SlotHyperParams

    for slot in range(ops.trainer.config.num_slots):
        if ops.trainer.slots[slot] is not None:
            ops.trainer.clear_slot(slot)
    for slot in TINKER:
        ops.trainer.init_slot(slot, SlotHyperParams(rank=RANKS[slot], alpha=ALPHA[slot]), seed=slot + 7)
    for slot, h in LOOP.items():
        ops.trainer.init_slot(slot, SlotHyperParams(**h), seed=100 + slot)


def tinker_calls(step):
    from trainer.step.round_runner import Call

    return [Call(slot, copy.deepcopy(data), fn, cfg) for slot, fn, cfg, data in step]


def grad_rows(ops, slot):
    return ops.trainer.buffers.grad[slot].clone()


def slot_tensors(ops, slot):
    from trainer.swap.slot_checkpoint import slot_state_tensors

    parts = slot_state_tensors(ops.trainer, slot)
    return {f"{kind}.{i}.{name}": t.clone() for kind in ("weight", "exp_avg", "exp_avg_sq") for i in (0, 1)
            for name, t in parts[kind][i].items()}


def optim_steps(ops, step):
    from trainer.step.round_runner import AdamStep

    for slot in sorted({slot for slot, *_ in step}):
        ops.optim_step(slot, AdamStep(**ADAM[slot]))


def reports_of(result):
    return {slot: [dict(update=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr) for r in m.steps]
            for slot, m in result.slots.items()}


def run(ops, work, joined: bool, spy=None):
    """Both kinds of work; joined: one train_with per call; apart: train, then forward_backward."""
    batches, calls = work
    reports = {slot: [] for slot in LOOP}
    grads, losses = [], []
    for batch, step in zip(batches, calls):
        if joined:
            result, results = ops.train_with(batch, tinker_calls(step))
        else:
            result = ops.trainer.train(batch)
            results = ops.forward_backward(tinker_calls(step))
        assert all(r.error is None for r in results), [r.error for r in results]
        losses.append([r.metrics["loss:sum"] for r in results])
        for slot, rs in reports_of(result).items():
            reports[slot] += rs
        grads.append({slot: grad_rows(ops, slot) for slot in TINKER})
        optim_steps(ops, step)
    return dict(reports=reports, grads=grads, losses=losses,
                tensors={slot: slot_tensors(ops, slot) for slot in [*TINKER, *LOOP]},
                peft={slot: ops.trainer.export.peft_tensors(slot)[1] for slot in [*TINKER, *LOOP]})


class StreamSpy:
    """Records the slots of every packed LoRA stream (delegating to the trainer's own pass)."""

    def __init__(self, trainer):
        self.trainer, self.streams = trainer, []
        self._orig = trainer.passes.stream_logprobs

    def __call__(self, sequences, slot_ids, targets, **kw):
        if kw.get("lora"):
            self.streams.append(list(slot_ids))
        return self._orig(sequences, slot_ids, targets, **kw)


@pytest.fixture(scope="module")
def compared(ops, work, tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("joined")
    fresh(ops)
    for slot in TINKER:
        ops.trainer.export.export_peft(slot, tmp / f"init{slot}")
    loop_init = {slot: ops.trainer.export.peft_tensors(slot)[1] for slot in LOOP}
    spy = StreamSpy(ops.trainer)
    ops.trainer.passes.stream_logprobs = spy
    try:
        joined = run(ops, work, joined=True)
        joined_streams, spy.streams = spy.streams, []
        fresh(ops)
        apart = run(ops, work, joined=False)
        apart_streams = spy.streams
    finally:
        del ops.trainer.passes.stream_logprobs
    return dict(joined=joined, apart=apart, joined_streams=joined_streams, apart_streams=apart_streams,
                loop_init=loop_init, tmp=tmp)


def test_joined_step_is_one_pass_over_both_kinds(compared):
    both = [s for s in compared["joined_streams"] if set(s) & set(TINKER) and set(s) & set(LOOP)]
    assert both, compared["joined_streams"]  # loop samples and Tinker datums in the same packed stream
    assert len(compared["joined_streams"]) <= len(compared["apart_streams"])  # never more passes than apart


def test_each_slot_gets_what_it_gets_apart(compared):
    joined, apart = compared["joined"], compared["apart"]
    for slot in LOOP:
        j, a = joined["reports"][slot], apart["reports"][slot]
        assert len(j) == len(a) == UPDATES[slot], (slot, j, a)
        assert [r["update"] for r in j] == [r["update"] for r in a]
        for key in ("loss", "grad_norm", "lr"):
            assert [r[key] for r in j] == pytest.approx([r[key] for r in a], rel=JOINED_VS_APART), (slot, key)
    worst = 0.0
    for step, (gj, ga) in enumerate(zip(joined["grads"], apart["grads"])):
        for slot in TINKER:  # the gradient each Tinker call accumulated, before its optim_step
            assert ga[slot].abs().max() > 0
            e = max_rel_err(gj[slot], ga[slot])
            worst = max(worst, e)
            assert e <= JOINED_VS_APART, (step, slot, e)
    for lj, la in zip(joined["losses"], apart["losses"], strict=True):
        assert lj == pytest.approx(la, rel=JOINED_VS_APART)
    for slot in [*TINKER, *LOOP]:
        for k, t in apart["tensors"][slot].items():
            if t.abs().max() > 0:
                e = max_rel_err(joined["tensors"][slot][k], t)
                worst = max(worst, e)
                assert e <= JOINED_VS_APART, (slot, k, e)
    print(f"joined vs apart: worst relative error {worst:.2e}")


def test_loop_slots_match_the_reference_trainer(compared, work, tiny_world):
    from tests.reference.trainer import train_alone
    from trainer.config import SlotHyperParams

    batches, _ = work
    worst = 0.0
    for slot, h in LOOP.items():
        own = [s for b in batches for s in b.samples if s.slot == slot]
        ref, reports = train_alone(tiny_world / "model", SlotHyperParams(**h), compared["loop_init"][slot], own)
        ours = compared["joined"]["reports"][slot]
        assert len(reports) == len(ours) == UPDATES[slot]
        for key in ("loss", "grad_norm"):
            e = max_rel_err(torch.tensor([r[key] for r in ours], dtype=torch.float64),
                            torch.tensor([r[key] for r in reports], dtype=torch.float64))
            worst = max(worst, e)
            assert e <= VS_REFERENCE, (slot, key, e)
        weights = compared["joined"]["peft"][slot]
        for name, w in ref.state().items():
            e = max_rel_err(weights[name], w)
            worst = max(worst, e)
            assert e <= VS_REFERENCE, (slot, name, e)
    print(f"loop slots vs reference trainer: worst {worst:.2e}")


def test_tinker_slots_match_hf_peft(compared, work, hf_model):
    _, calls = work
    worst = 0.0
    for slot in TINKER:
        ref, _ = reference_run(hf_model, compared["tmp"] / f"init{slot}", slot, calls)  # (weights, per-call outputs)
        ours = compared["joined"]["peft"][slot]
        assert set(ours) == set(ref)
        e = max(max_rel_err(ours[k], ref[k]) for k in ours)
        worst = max(worst, e)
        assert e <= VS_REFERENCE, (slot, e)
        assert max(ours[k].abs().max().item() for k in ours if "lora_B" in k) > 1e-3  # it trained
    print(f"Tinker slots vs HF+peft+AdamW: worst {worst:.2e}")


def test_bad_tinker_call_in_a_joined_step_fails_only_itself(ops, work):
    from trainer.step.round_runner import Call

    batches, calls = work
    fresh(ops)
    alone = ops.trainer.train(batches[0])
    good_alone = ops.forward_backward(tinker_calls(calls[0][:1]))
    expected = {slot: slot_tensors(ops, slot) for slot in LOOP}
    expected_grad = grad_rows(ops, 0)

    fresh(ops)
    good = tinker_calls(calls[0][:1])[0]
    bad_token = Call(2, copy.deepcopy(calls[0][1][3]), "ppo", None)
    bad_token.data[0].tokens[0] = 10**6
    on_loop_slot = Call(1, copy.deepcopy(calls[0][0][3]), "cross_entropy", None)
    result, results = ops.train_with(batches[0], [bad_token, good, on_loop_slot])
    assert "datum 0: model_input token ids must be in" in results[0].error
    assert "slot 1 is being trained by the service's loop" in results[2].error
    assert results[1].error is None and results[1].metrics == pytest.approx(good_alone[0].metrics, rel=JOINED_VS_APART)
    got, want = reports_of(result), reports_of(alone)
    assert set(got) == set(want) and result.stepped == alone.stepped == [1]
    for slot in want:
        assert len(got[slot]) == len(want[slot])  # slot 1 steps, slot 3 accumulates (2 of its 3 samples)
        for g, w in zip(got[slot], want[slot]):
            assert g == pytest.approx(w, rel=JOINED_VS_APART), slot
    assert result.slots[3].pending_samples == alone.slots[3].pending_samples == 2
    for slot in LOOP:
        for k, t in expected[slot].items():
            if t.abs().max() > 0:
                assert max_rel_err(slot_tensors(ops, slot)[k], t) <= JOINED_VS_APART, (slot, k)
    assert max_rel_err(grad_rows(ops, 0), expected_grad) <= JOINED_VS_APART
    assert torch.count_nonzero(grad_rows(ops, 2)) == 0  # the refused call accumulated nothing
    assert ops.trainer.slots[0].step == 0 and ops.trainer.slots[2].step == 0  # no Tinker slot stepped


def test_refused_loop_batch_leaves_the_tinker_calls_running_alone(ops, work):
    batches, calls = work
    fresh(ops)
    alone = ops.forward_backward(tinker_calls(calls[0]))
    grads = {slot: grad_rows(ops, slot) for slot in TINKER}

    fresh(ops)
    ops.trainer.clear_slot(3)  # the loop's batch has samples of slot 3: train refuses it
    before = slot_tensors(ops, 1)
    result, results = ops.train_with(batches[0], tinker_calls(calls[0]))
    assert isinstance(result, ValueError) and "slot 3 is not initialized" in str(result)
    assert all(r.error is None for r in results)
    for got, want in zip(results, alone, strict=True):
        assert got.metrics == pytest.approx(want.metrics, rel=JOINED_VS_APART)
    for slot in TINKER:
        assert max_rel_err(grad_rows(ops, slot), grads[slot]) <= JOINED_VS_APART
    assert all(torch.equal(t, before[k]) for k, t in slot_tensors(ops, 1).items())  # the loop's slot: untouched
    assert torch.count_nonzero(grad_rows(ops, 1)) == 0 and ops.trainer.slots[1].pending_samples == 0
