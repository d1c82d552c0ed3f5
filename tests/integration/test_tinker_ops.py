"""Proof of the Tinker trainer primitives (fp32, CPU, the tiny Qwen3 through Megatron-Bridge).

Three slots with different ranks, targets (slots 0 and 2 train the unembedding, lm_head), losses
(cross_entropy, ppo, cispo, importance_sampling, dro, gspo; every config key off its default at
least once) and per-call AdamW parameters train 3 steps; each step is ONE mixed forward_backward of
four calls (slot 0 twice: its two calls' gradients accumulate), then one optim_step per slot. Every
slot's weights and Adam moments equal

* the same slot trained alone (same calls, one slot per forward_backward), and
* an independent reference: HF transformers + peft (the slot's initial PEFT export,
  with lora_A shared by q/k/v and by gate/up as in the fused Megatron linears) and
  torch.optim.AdamW, the losses from tests/reference/losses.py (Tinker's definitions).

Every reported output of every call equals that reference too: ``loss:sum`` (the sum over
the call's datums and positions), each datum's ``logprobs`` and (cross_entropy)
``elementwise_loss``.

Tolerance: max relative error per tensor 5e-5 against HF (measured 1.7e-5; HF and Megatron
compute the same function with different kernels) and 1e-5 mixed vs alone; outputs below
(OUT_TOL).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.numerics import max_rel_err
from tests.reference.losses import tinker_token_loss

pytestmark = pytest.mark.integration

RANKS = {0: 4, 1: 8, 2: 2}
ALPHA = {0: 8.0, 1: 8.0, 2: 4.0}
TARGETS = {0: ("attention", "mlp", "unembed"), 1: ("attention", "mlp"), 2: ("mlp", "unembed")}  # the SDK's default: all
ADAM = {  # per slot: AdamParams fields; eps 1e-2 as in test_trainer_equivalence.py (its module doc: a
    # smaller eps lets Adam amplify fp32 kernel noise near zero gradients; 1e-3 measured 1.2e-4 here)
    0: dict(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-2, weight_decay=0.0, grad_clip_norm=0.0),
    1: dict(learning_rate=1e-2, beta1=0.8, beta2=0.99, eps=1e-2, weight_decay=0.1, grad_clip_norm=0.5),
    2: dict(learning_rate=3e-2, beta1=0.9, beta2=0.999, eps=1e-2, weight_decay=0.0, grad_clip_norm=1e3),
}
# (slot, loss_fn, loss_fn_config) of the four calls of each step, per step
STEP_CALLS = [
    [(0, "cross_entropy", None), (1, "ppo", None), (2, "cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), (0, "dro", {"beta": 0.1})],
    [(2, "importance_sampling", None), (0, "cross_entropy", None), (1, "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}), (0, "gspo", None)],
    [(1, "dro", {"beta": 0.5}), (0, "cispo", None), (2, "cross_entropy", None), (0, "gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02})],
]
REL_TOL = 5e-5  # measured worst 1.7e-5
OUT_TOL = 1e-4  # outputs: |ours - HF| <= OUT_TOL * (1 + sum of |token losses|) for loss:sum, OUT_TOL absolute per logprob


def make_data(loss_fn, seed, base_lp_fn, n_datums=2):
    from trainer.step.round_runner import Datum

    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n_datums):
        length = int(torch.randint(7, 16, (1,), generator=g))
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        full = torch.randint(0, 400, (length + 1,), generator=g)
        tokens, targets = full[:-1], full[1:]
        completion = (torch.arange(length) >= prompt - 1).float()
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": targets, "weights": completion * (0.5 + torch.rand(length, generator=g))}
        else:
            q = base_lp_fn(tokens, targets) + 0.3 * torch.randn(length, generator=g)  # off-policy: ratios clip
            adv = float(torch.randn(1, generator=g)) * completion
            inputs = {"target_tokens": targets, "logprobs": q, "advantages": adv}
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = completion
        data.append(Datum(tokens=tokens.tolist(), inputs=inputs))
    return data


@pytest.fixture(scope="module")
def ops(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.step.round_runner import RoundRunner

    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                             micro_batch_tokens=40))  # several micro-batches per call
    return RoundRunner(trainer)


@pytest.fixture(scope="module")
def steps(hf_model):
    """The calls of every step (same tensors for every run)."""

    def base_lp(tokens, targets):
        with torch.no_grad():
            logits = hf_model(tokens[None]).logits[0]
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]

    return [[(slot, fn, cfg, make_data(fn, seed=100 * s + c, base_lp_fn=base_lp)) for c, (slot, fn, cfg) in enumerate(calls)]
            for s, calls in enumerate(STEP_CALLS)]


def fresh_slots(ops, slots):
    from trainer.config import SlotHyperParams

    for slot in range(ops.trainer.config.num_slots):
        if ops.trainer.slots[slot] is not None:
            ops.trainer.clear_slot(slot)
    for slot in slots:
        ops.trainer.init_slot(slot, SlotHyperParams(rank=RANKS[slot], alpha=ALPHA[slot], targets=TARGETS[slot]), seed=slot + 7)


def run(ops, steps, only_slot=None):
    """3 steps; mixed (all calls of a step in one forward_backward) or one slot alone."""
    from trainer.step.round_runner import AdamStep, Call

    out = {}  # (step, call index in STEP_CALLS) -> CallResult
    for s, calls in enumerate(steps):
        mine = [(c, Call(slot, data, fn, cfg)) for c, (slot, fn, cfg, data) in enumerate(calls) if only_slot in (None, slot)]
        results = ops.forward_backward([call for _, call in mine])
        assert all(r.error is None for r in results), [r.error for r in results]
        out.update({(s, c): r for (c, _), r in zip(mine, results)})
        for slot in sorted({call.slot for _, call in mine}):
            ops.optim_step(slot, AdamStep(**ADAM[slot]))
    return out


def slot_tensors(ops, slot):
    from trainer.swap.slot_checkpoint import slot_state_tensors

    parts = slot_state_tensors(ops.trainer, slot)
    return {f"{kind}.{i}.{name}": t.clone() for kind in ("weight", "exp_avg", "exp_avg_sq") for i in (0, 1) for name, t in parts[kind][i].items()}


def reference_run(hf_model, folder, slot, steps):
    """HF + peft + torch.optim.AdamW from the slot's initial PEFT export: the final LoRA tensors, and
    per call of the slot ((step, call index) -> (loss sum, sum of |token losses|, per datum: logprobs,
    token losses))."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder), is_trainable=True)
    for layer in model.base_model.model.model.layers:  # the fused linears share lora_A (where the slot has them)
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn.q_proj, "lora_A"):
            attn.k_proj.lora_A["default"].weight = attn.q_proj.lora_A["default"].weight
            attn.v_proj.lora_A["default"].weight = attn.q_proj.lora_A["default"].weight
        if hasattr(mlp.gate_proj, "lora_A"):
            mlp.up_proj.lora_A["default"].weight = mlp.gate_proj.lora_A["default"].weight
    params = list({id(p): p for n, p in model.named_parameters() if "lora_" in n}.values())
    a = ADAM[slot]
    opt = torch.optim.AdamW(params, lr=a["learning_rate"], betas=(a["beta1"], a["beta2"]), eps=a["eps"], weight_decay=a["weight_decay"])
    outputs = {}
    for step, calls in enumerate(steps):
        opt.zero_grad()
        for c, (s, fn, cfg, data) in enumerate(calls):
            if s != slot:
                continue
            total, scale, per_datum = 0.0, 0.0, []
            for d in data:
                logits = model(torch.tensor(d.tokens)[None]).logits[0]
                lp = torch.log_softmax(logits, -1).gather(-1, d.inputs["target_tokens"][:, None])[:, 0]
                token_loss = tinker_token_loss(fn, cfg, lp, d.inputs)
                token_loss.sum().backward()
                total += float(token_loss.detach().double().sum())
                scale += float(token_loss.detach().abs().sum())
                per_datum.append((lp.detach().clone(), token_loss.detach().clone()))
            outputs[(step, c)] = (total, scale, per_datum)
        if a["grad_clip_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(params, a["grad_clip_norm"])
        opt.step()
    weights = {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if "lora_" in n}
    return weights, outputs


def test_mixed_forward_backward_equals_alone_and_hf_peft(ops, steps, hf_model, tmp_path):
    fresh_slots(ops, RANKS)
    for slot in RANKS:
        ops.trainer.export.export_peft(slot, tmp_path / f"init{slot}")
    mixed_results = run(ops, steps)
    mixed = {slot: slot_tensors(ops, slot) for slot in RANKS}
    mixed_peft = {slot: ops.trainer.export.peft_tensors(slot)[1] for slot in RANKS}
    assert all(abs(r.metrics["loss:sum"]) > 0 for r in mixed_results.values())

    for slot in RANKS:
        fresh_slots(ops, [slot])
        run(ops, steps, only_slot=slot)
        alone = slot_tensors(ops, slot)
        worst = max(max_rel_err(mixed[slot][k], alone[k]) for k in alone if alone[k].abs().max() > 0)
        assert worst <= 1e-5, f"slot {slot}: mixed vs alone {worst:.2e}"

        ref, ref_outputs = reference_run(hf_model, tmp_path / f"init{slot}", slot, steps)
        for key, (total, scale, per_datum) in ref_outputs.items():
            got = mixed_results[key]
            fn = STEP_CALLS[key[0]][key[1]][1]
            err = abs(got.metrics["loss:sum"] - total)
            print(f"slot {slot} call {key} {fn}: loss:sum {got.metrics['loss:sum']:.6f} vs HF {total:.6f} (|diff| {err:.1e})")
            assert err <= OUT_TOL * (1.0 + scale), (key, fn, got.metrics["loss:sum"], total)
            assert set(got.metrics) == {"loss:sum"} and len(got.outputs) == len(per_datum)
            for out, (lp, token_loss) in zip(got.outputs, per_datum):
                assert set(out) == ({"logprobs", "elementwise_loss"} if fn == "cross_entropy" else {"logprobs"})
                assert torch.allclose(out["logprobs"], lp, atol=OUT_TOL, rtol=0), (key, (out["logprobs"] - lp).abs().max())
                if fn == "cross_entropy":
                    assert torch.allclose(out["elementwise_loss"], token_loss, atol=OUT_TOL, rtol=0), key
        ours = mixed_peft[slot]
        assert set(ours) == set(ref)
        worst = max(max_rel_err(ours[k], ref[k]) for k in ours)
        print(f"slot {slot}: ours vs HF+peft+AdamW {worst:.2e}")
        assert worst <= REL_TOL, f"slot {slot}: ours vs HF+peft+AdamW {worst:.2e}"
        moved = max((ours[k] - 0).abs().max().item() for k in ours if "lora_B" in k)
        assert moved > 1e-3  # the adapters really trained


def test_forward_matches_forward_backward_and_changes_nothing(ops, steps):
    from trainer.step.round_runner import Call

    fresh_slots(ops, RANKS)
    calls = [Call(slot, data, fn, cfg) for slot, fn, cfg, data in steps[0]]
    before = {slot: slot_tensors(ops, slot) for slot in RANKS}
    grad_before = ops.trainer.buffers.grad.clone()
    fwd = ops.forward(calls)
    assert torch.equal(ops.trainer.buffers.grad, grad_before)
    assert all(torch.equal(before[s][k], v) for s in RANKS for k, v in slot_tensors(ops, s).items())
    fb = ops.forward_backward(calls)
    for f, b in zip(fwd, fb):
        assert f.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
        for fo, bo in zip(f.outputs, b.outputs):
            assert torch.allclose(fo["logprobs"], bo["logprobs"], atol=1e-6)
    assert set(fb[0].outputs[0]) == {"logprobs", "elementwise_loss"}  # cross_entropy
    assert set(fb[1].outputs[0]) == {"logprobs"}  # ppo


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.data[0].inputs.update(weights=c.data[0].inputs["weights"][:-1]), r"datum 0: loss_fn_inputs\['weights'\] has shape"),
        (lambda c: c.data[1].tokens.__setitem__(0, 400), r"datum 1: model_input token ids must be in \[0, 400\)"),
        (lambda c: c.data[0].inputs.update(target_tokens=c.data[0].inputs["target_tokens"] + 1000), "target_tokens must be in"),
        (lambda c: c.data.clear(), "data is empty"),
        (lambda c: c.data[0].tokens.extend([1] * 100), "more than this server allows"),
        (lambda c: setattr(c, "loss_fn", "ppo"), r"lacks \['logprobs', 'advantages'\]"),
        (lambda c: setattr(c, "loss_fn", "stable_reinforce"), r"lacks \['logprobs', 'advantages', 'sampled_sequence'\]"),
        (lambda c: (setattr(c, "loss_fn", "gspo"), c.data[0].inputs.update(logprobs=c.data[0].inputs["weights"],
                                                                             advantages=c.data[0].inputs["weights"]),
                    c.data[0].inputs.pop("weights")), r"datum 0: loss_fn_inputs lacks \['sequence_ratio_mask'\]"),
        (lambda c: setattr(c, "loss_fn", "nope"), "unknown loss_fn 'nope'"),
        (lambda c: setattr(c, "loss_fn_config", {"beta": 1.0}), r"keys \['beta'\] are not known to 'cross_entropy'"),
        (lambda c: c.data[0].inputs.update(weights=c.data[0].inputs["weights"] * float("nan")), "non-finite"),
        (lambda c: setattr(c, "slot", 3), "slot 3 is not initialized"),
    ],
)
def test_bad_call_is_refused_and_others_unaffected(ops, steps, mutate, message):
    from trainer.step.round_runner import Call

    fresh_slots(ops, RANKS)
    good = [Call(slot, copy.deepcopy(data), fn, cfg) for slot, fn, cfg, data in steps[0][1:3]]
    ref = ops.forward_backward(good)
    grad_ref = ops.trainer.buffers.grad.clone()

    fresh_slots(ops, RANKS)
    ops.max_seq_len = 64
    try:
        bad = Call(0, copy.deepcopy(steps[0][0][3]), "cross_entropy", None)
        mutate(bad)
        got = ops.forward_backward([good[0], bad, good[1]])
    finally:
        ops.max_seq_len = 4096
    assert got[1].error is not None and __import__("re").search(message, got[1].error), got[1].error
    assert got[0].error is None and got[2].error is None
    assert torch.equal(ops.trainer.buffers.grad, grad_ref)  # slot 0 untouched, the others as without it
    assert got[0].metrics == ref[0].metrics and got[2].metrics == ref[1].metrics
