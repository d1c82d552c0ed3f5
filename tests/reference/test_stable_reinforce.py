"""stable_reinforce (trainer/losses/stable_reinforce.py, registered in trainer/losses/table.py) against
its stated definition, written out independently in tests/reference/stable_reinforce.py: per-position
values, gradients (autograd of ours against the written-out derivative), the statistics a call
reports, through both faces (a Tinker datum, and a dataset run's padded rows in trainer/losses/rows.py).

The data puts tokens on both sides of the ratio cap, one sequence outside the geometric-mean bounds
(masked whole) and one inside, prompt positions between them, and moves every config key off its
default at least once. Planted bugs: tests/reference/stable_reinforce_plants.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference.stable_reinforce import DEFAULTS, reference_loss_and_grad, reference_statistics

pytestmark = pytest.mark.unit

# One datum: 2 prompt positions, sequence 1 (5 tokens: ratios 3.0 and 2.5 above the cap 2, the rest
# near 1; geometric mean about 1.5, kept by default), 1 prompt position, sequence 2 (3 tokens, ratios
# about 3: geometric mean 3 > 2, masked by default).
RATIOS = [1.0, 1.0, 3.0, 0.9, 1.1, 2.5, 0.8, 1.0, 3.2, 2.8, 3.0]
GROUPS = [0, 0, 1, 1, 1, 1, 1, 0, 2, 2, 2]
ADV = [0.0, 0.0, 1.5, 1.5, 1.5, 1.5, 1.5, 0.0, -0.7, -0.7, -0.7]
Q = [-1.0, -2.0, -2.4, -0.3, -1.7, -3.1, -0.6, -0.9, -1.8, -2.2, -0.5]
CONFIGS = [None, {"kl_coeff": 0.3}, {"ratio_cap": 1.05}, {"sequence_mask_high": 3.5},
           {"sequence_mask_low": 0.99, "sequence_mask_high": 1.01}, {"sequence_mask_low": 0.0, "kl_coeff": 1.0}]


def _datum(ratios=RATIOS):
    q = torch.tensor(Q, dtype=torch.float64)
    lp = (q + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_(True)
    inp = {"target_tokens": torch.arange(len(ratios)), "logprobs": q, "advantages": torch.tensor(ADV, dtype=torch.float64),
           "sampled_sequence": torch.tensor(GROUPS, dtype=torch.float64)}
    return lp, inp


def _ours(cfg, lp, inp):
    from trainer.losses.table import check_inputs, resolve_loss

    spec, full = resolve_loss("stable_reinforce", cfg)
    check_inputs("stable_reinforce", spec, len(lp), inp)
    loss = spec.fn(lp, inp, full).loss
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad, full


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_values_gradients_and_statistics_equal_the_definition(cfg):
    from trainer.losses.stable_reinforce import statistics

    lp, inp = _datum()
    loss, grad, full = _ours(cfg, lp, inp)
    assert full == {**DEFAULTS, **(cfg or {})}
    want_loss, want_grad = reference_loss_and_grad(lp.tolist(), Q, ADV, GROUPS, cfg)
    assert torch.allclose(loss, torch.tensor(want_loss, dtype=torch.float64), rtol=1e-12, atol=1e-12), (loss, want_loss)
    assert torch.allclose(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-12), (grad, want_grad)
    got, want = statistics(lp, inp, full), reference_statistics(lp.tolist(), Q, GROUPS, cfg)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), key


def test_the_data_reaches_every_branch_of_the_definition():
    """The cases above are not vacuous: defaults truncate 2 tokens of sequence 1 and mask sequence 2;
    moved keys change what is kept or truncated."""
    lp, _ = _datum()
    stats = {str(c): reference_statistics(lp.tolist(), Q, GROUPS, c) for c in CONFIGS}
    assert stats["None"]["truncated_tokens"] == 2 and stats["None"]["masked_sequences"] == 1
    assert stats[str({"sequence_mask_high": 3.5})]["masked_sequences"] == 0
    assert stats[str({"ratio_cap": 1.05})]["truncated_tokens"] == 3
    assert stats[str({"sequence_mask_low": 0.99, "sequence_mask_high": 1.01})]["masked_sequences"] == 2
    losses = {str(c): reference_loss_and_grad(lp.tolist(), Q, ADV, GROUPS, c)[1] for c in CONFIGS}
    assert len({tuple(v) for v in losses.values()}) == len(CONFIGS)  # every config gives other gradients


@pytest.mark.parametrize("cfg", [{"kl_coeff": 0.5}, {"sequence_mask_low": 1.0, "sequence_mask_high": 1.0}])
def test_on_policy_is_plain_reinforce(cfg):
    """Sampler = trainer (q = lp): every weight is 1, nothing is masked (the bounds are inclusive: a
    geometric mean of exactly 1 is kept by [1, 1]): -A lp on the sampled tokens."""
    lp, inp = _datum([1.0] * len(RATIOS))
    loss, grad, _ = _ours(cfg, lp, inp)
    sampled = torch.tensor(GROUPS) > 0
    want = torch.where(sampled, -inp["advantages"] * lp.detach(), torch.zeros_like(lp))
    assert torch.allclose(loss, want, atol=1e-12) and torch.allclose(grad, torch.where(sampled, -inp["advantages"], 0.0))


def test_config_and_input_refusals_say_what_is_allowed():
    from trainer.losses.table import check_inputs, resolve_loss

    for cfg, msg in (({"ratio_cap": 0.0}, "ratio_cap'] must be > 0"), ({"sequence_mask_low": 1.2}, "sequence_mask_low <= 1"),
                     ({"sequence_mask_high": 0.9}, "1 <= sequence_mask_high"), ({"kl_coeff": -1.0}, "kl_coeff'] must be >= 0"),
                     ({"beta": 1.0}, r"allowed: \['kl_coeff', 'ratio_cap', 'sequence_mask_high', 'sequence_mask_low'\]")):
        with pytest.raises(ValueError, match=msg):
            resolve_loss("stable_reinforce", cfg)
    spec, _ = resolve_loss("stable_reinforce", None)
    _, inp = _datum()
    with pytest.raises(ValueError, match="whole numbers"):
        check_inputs("stable_reinforce", spec, len(Q), {**inp, "sampled_sequence": inp["sampled_sequence"] + 0.5})
    with pytest.raises(ValueError, match=r"must be in \[0, 11\]"):
        check_inputs("stable_reinforce", spec, len(Q), {**inp, "sampled_sequence": inp["sampled_sequence"] - 1})


def test_call_metrics_combine_the_datums_statistics():
    from trainer.losses.stable_reinforce import call_metrics, statistics

    lp, inp = _datum()
    _, _, full = _ours(None, lp, inp)
    one = statistics(lp, inp, full)
    two = {k: (max(v, v) if k == "max_abs_log_ratio" else 2 * v) for k, v in one.items()}
    m = call_metrics(two)
    assert m["stable_reinforce/sequences:sum"] == 4 and m["stable_reinforce/masked_sequences:sum"] == 2
    assert m["stable_reinforce/ratio:mean"] == pytest.approx(sum(RATIOS[i] for i in range(11) if GROUPS[i]) / 8)
    assert m["stable_reinforce/abs_log_ratio:max"] == pytest.approx(max(abs(math.log(r)) for r, g in zip(RATIOS, GROUPS) if g))
    assert all(k.count(":") == 1 for k in m)  # the SDK splits a metric's name from its reduction at the one ':'


def test_dataset_rows_through_rows_py_equal_the_definition():
    """A dataset run naming stable_reinforce: each padded row is one sampled sequence whose rollout
    log-probabilities are q; the row's numerator and gradient are the definition's sum over its loss
    positions, and its 'clipped' count is the tokens the correction acted on (truncated, or masked)."""
    from trainer.losses.rows import RowLoss, TokenLossInputs, sample_loss_numerators
    from trainer.losses.table import resolve_loss

    lengths, prompt, adv = [6, 4, 7], [1, 2, 1], [1.2, -0.8, 0.5]
    g = torch.Generator().manual_seed(5)
    s = max(lengths)
    lp = -torch.rand(3, s, generator=g, dtype=torch.float64) * 2 - 0.1
    gap = torch.tensor([[1.2, 0.9, 1.3, -0.4, 0.2, 0.1, 0.0], [0.05, -0.02, 0.01, 0.03, 0, 0, 0], [-1.0, -0.9, -0.8, -1.1, -0.7, -0.9, -1.2]],
                       dtype=torch.float64)  # row 0: some ratios above 2; row 2: geometric mean ~0.4 < 0.5 (masked)
    q = lp - gap
    mask = torch.zeros(3, s, dtype=torch.bool)
    for j, (n, p) in enumerate(zip(lengths, prompt)):
        mask[j, p:n] = True
        lp[j, n:] = float("nan")
        q[j, n:] = float("-inf")
    for cfg in (None, {"kl_coeff": 0.4, "ratio_cap": 1.5}):
        full = resolve_loss("stable_reinforce", cfg)[1]
        x = lp.clone().requires_grad_(True)
        inp = TokenLossInputs(logprobs=x, mask=mask, losses=[RowLoss.of("stable_reinforce", full)] * 3,
                              advantage=torch.tensor(adv, dtype=torch.float64), rollout_logprobs=q,
                              kl_coef=torch.zeros(3, dtype=torch.float64), ref_logprobs=None,
                              per_token_weight=torch.ones(3, dtype=torch.float64))
        num, stats = sample_loss_numerators(inp)
        (grad,) = torch.autograd.grad(num.sum(), x)
        for j, n in enumerate(lengths):
            m = mask[j, :n].tolist()
            groups = [1 if b else 0 for b in m]
            want_loss, want_grad = reference_loss_and_grad(lp[j, :n].tolist(), q[j, :n].tolist(),
                                                           [adv[j] if b else 0.0 for b in m], groups, cfg)
            ref = reference_statistics(lp[j, :n].tolist(), q[j, :n].tolist(), groups, cfg)
            assert float(num[j].detach()) == pytest.approx(sum(want_loss), rel=1e-12, abs=1e-12), (cfg, j)
            assert torch.allclose(grad[j, :n], torch.tensor(want_grad, dtype=torch.float64), atol=1e-12), (cfg, j)
            assert bool((grad[j, n:] == 0).all())
            acted = ref["truncated_tokens"] + (ref["sampled_tokens"] if ref["masked_sequences"] else 0)
            assert int(stats.clipped[j]) == acted, (cfg, j, stats.clipped)
            assert float(stats.ratio_sum[j]) == pytest.approx(ref["ratio_sum"], rel=1e-12)
        assert int(stats.clipped[2]) == lengths[2] - prompt[2]  # row 2 masked whole
        assert int(stats.clipped[0]) > 0  # row 0 has tokens above the cap
