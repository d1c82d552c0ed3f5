"""One loss table, two faces (fp32, CPU, the tiny Qwen3 through Megatron-Bridge): every loss of the
table trained through a dataset run's path (samples with the sampler's log-probabilities and an
advantage, the slot's `loss` in its hyper-parameters: trainer/losses/rows.py) equals the same loss
through the Tinker path (forward_backward calls: trainer/step/round_runner.py) and the independent
reference (HF transformers + peft + torch.optim.AdamW, the losses from tests/reference/losses.py).

How the two faces are made to compute the same thing. A dataset run normalizes: with
``loss_normalization: constant`` and ``loss_norm_tokens: 1`` its step's gradient is the SUM of its
samples' token losses divided by the number of samples n (its samples_per_step). A Tinker call's
loss is the plain sum. Every loss of the table is linear in the inputs a client scales (weights,
advantages, and dro's beta), so Tinker datums with those inputs divided by n give exactly the
dataset run's gradient; both slots then take the same AdamW steps (per-call parameters on the
Tinker side, the slot's on the dataset side). Every position of a datum is learned (a dataset row
excludes its prompt positions by its loss mask, a Tinker datum by zero advantages or weights; dro's
penalty would still count a Tinker datum's prompt positions, so there are none here).

Tolerance as tests/integration/test_tinker_ops.py: 1e-5 between the faces (the same math in
different micro-batches), 5e-5 against HF (another implementation of the same function).
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_tinker_ops import ADAM, ALPHA, RANKS, REL_TOL, TARGETS, ops, reference_run, steps  # noqa: F401 - fixtures
from tests.numerics import max_rel_err

pytestmark = pytest.mark.integration

CASES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
         ("cispo", None), ("dro", {"beta": 0.2}), ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02}),
         ("stable_reinforce", {"ratio_cap": 1.3, "sequence_mask_low": 0.92, "sequence_mask_high": 1.08})]
TINKER_SLOT = 1  # ADAM[1]: weight decay 0.1 and clipping at 0.5 (both faces clip the same normalized gradient)
REST_SLOT = 3
N_SAMPLES, N_STEPS = 3, 2


def _sequences(loss_fn, step, base_lp):
    """(full token sequence, sampler log-probs of tokens 1.., advantage) per sample of one step."""
    g = torch.Generator().manual_seed(1000 * step + len(loss_fn))
    out = []
    for _ in range(N_SAMPLES):
        length = int(torch.randint(6, 14, (1,), generator=g))
        full = torch.randint(0, 400, (length + 1,), generator=g)
        q = base_lp(full[:-1], full[1:]) + 0.3 * torch.randn(length, generator=g)  # off-policy: ratios clip
        out.append((full, q, float(torch.randn(1, generator=g))))
    return out


def _tinker_datums(loss_fn, cfg, sequences):
    """The sequences as Tinker datums whose summed loss is the dataset run's normalized one (module doc)."""
    from trainer.rounds import Datum

    n = float(N_SAMPLES)
    data = []
    for full, q, adv in sequences:
        ones = torch.ones(len(full) - 1)
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": full[1:], "weights": ones / n}
        else:
            inputs = {"target_tokens": full[1:], "logprobs": q, "advantages": ones * adv / n}
            if loss_fn == "gspo":
                inputs["sequence_ratio_mask"] = ones
            if loss_fn == "stable_reinforce":  # one sampled sequence per datum (a dataset row is one too)
                inputs["sampled_sequence"] = ones
        data.append(Datum(tokens=full[:-1].tolist(), inputs=inputs))
    cfg = dict(cfg or {})
    if loss_fn == "dro":
        cfg["beta"] = cfg["beta"] / n
    return data, cfg


def _samples(loss_fn, sequences):
    from trainer.batch import TrainSample

    return [TrainSample(slot=REST_SLOT, tokens=full.tolist(), loss_mask=[0] + [1] * (len(full) - 1), advantage=adv,
                        rollout_logprobs=None if loss_fn == "cross_entropy" else [0.0] + q.tolist())
            for full, q, adv in sequences]


def _rest_hyper(loss_fn, cfg):
    from trainer.config import LossChoice, SlotHyperParams

    a = ADAM[TINKER_SLOT]
    return SlotHyperParams(rank=RANKS[TINKER_SLOT], alpha=ALPHA[TINKER_SLOT], targets=TARGETS[TINKER_SLOT],
                           loss=LossChoice(name=loss_fn, config=cfg or {}), samples_per_step=N_SAMPLES,
                           loss_normalization="constant", loss_norm_tokens=1, lr=a["learning_rate"],
                           betas=(a["beta1"], a["beta2"]), eps=a["eps"], weight_decay=a["weight_decay"],
                           max_grad_norm=a["grad_clip_norm"] or None)


@pytest.fixture(scope="module")
def base_lp(hf_model):
    def lp(tokens, targets):
        with torch.no_grad():
            logits = hf_model(tokens[None]).logits[0]
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]

    return lp


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[c[0] for c in CASES])
def test_a_dataset_run_trains_each_loss_as_a_tinker_call_and_the_reference_do(ops, hf_model, base_lp, loss_fn, cfg, tmp_path):
    from trainer.batch import TrainBatch
    from trainer.config import SlotHyperParams
    from trainer.rounds import AdamStep, Call

    trainer = ops.trainer
    for slot in range(trainer.config.num_slots):
        if trainer.slots[slot] is not None:
            trainer.clear_slot(slot)
    seed = 11
    trainer.init_slot(TINKER_SLOT, SlotHyperParams(rank=RANKS[TINKER_SLOT], alpha=ALPHA[TINKER_SLOT], targets=TARGETS[TINKER_SLOT]),
                      seed=seed)
    trainer.init_slot(REST_SLOT, _rest_hyper(loss_fn, cfg), seed=seed)
    trainer.export.export_peft(TINKER_SLOT, tmp_path / "init")
    tinker_steps = []
    for step in range(N_STEPS):
        sequences = _sequences(loss_fn, step, base_lp)
        data, tinker_cfg = _tinker_datums(loss_fn, cfg, sequences)
        tinker_steps.append([(TINKER_SLOT, loss_fn, tinker_cfg, data)])
        result = trainer.train(TrainBatch(samples=_samples(loss_fn, sequences)))
        assert result.stepped == [REST_SLOT], result
        (call,) = ops.forward_backward([Call(TINKER_SLOT, data, loss_fn, tinker_cfg)])
        assert call.error is None, call.error
        optim = ops.optim_step(TINKER_SLOT, AdamStep(**ADAM[TINKER_SLOT]))
        # the step's loss and gradient norm (before clipping): the same numbers on both faces (AdamW
        # alone would hide a scale error: its update barely depends on the gradient's scale)
        (report,) = result.slots[REST_SLOT].steps
        assert report.loss == pytest.approx(call.metrics["loss:sum"], rel=1e-5, abs=1e-6), (report.loss, call.metrics)
        assert report.grad_norm == pytest.approx(optim["grad_norm"], rel=1e-5), (report.grad_norm, optim)
    rest, tinker = trainer.export.peft_tensors(REST_SLOT)[1], trainer.export.peft_tensors(TINKER_SLOT)[1]
    worst = max(max_rel_err(rest[k], tinker[k]) for k in tinker)
    assert worst <= 1e-5, f"{loss_fn}: dataset run vs Tinker call {worst:.2e}"
    ref, _ = reference_run(hf_model, tmp_path / "init", TINKER_SLOT, tinker_steps)
    worst_ref = max(max_rel_err(rest[k], ref[k]) for k in rest)
    print(f"{loss_fn}: dataset run vs Tinker {worst:.2e}, vs HF+peft+AdamW {worst_ref:.2e}")
    assert worst_ref <= REL_TOL, f"{loss_fn}: dataset run vs HF+peft+AdamW {worst_ref:.2e}"
    assert max((rest[k] - 0).abs().max().item() for k in rest if "lora_B" in k) > 1e-3  # it trained
