"""Every loss of the one table through a dataset run's rows (trainer/losses/rows.py), against its
definition: the loss numerators, their gradients, and every statistic a run reports (loss tokens,
clipped tokens, importance-ratio sum, KL sum), on rows of different lengths padded into one
micro-batch, off-policy and on-policy. The definitions are tests/reference/losses.py's (written from
Tinker's loss pages and the papers, not from the product); the statistics' definitions are here:

* clipped: a loss position whose clip was active: ppo, in PPO's case form ((A > 0 and r > hi) or
  (A < 0 and r < lo), r = exp(lp - q)); gspo, the same with the sequence ratio s in place of r;
  cispo, its weight clipped (r < lo or r > hi); stable_reinforce, its correction acted (a kept token
  whose ratio exceeded the cap, or a token of a masked row: tests/reference/stable_reinforce.py);
  no other loss clips;
* ratio: r = exp(lp - q) at each loss position of an rl row (exactly 1 on-policy);
* kl: k3 = exp(ref - lp) - (ref - lp) - 1 at each loss position of an rl row with a reference;
* the reported means divide by the rl rows' loss tokens (trainer/optim/slot_steps.py slot_metrics).

Padding must not count: on-policy rows of different lengths report ratio_mean exactly 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference.losses import k3_kl, tinker_token_loss
from tests.reference.stable_reinforce import reference_loss_and_grad, reference_statistics
from trainer.losses.rows import RowLoss, TokenLossInputs, sample_loss_numerators
from trainer.losses.table import LOSSES, resolve_loss

pytestmark = pytest.mark.unit

LENGTHS = [5, 3, 7]  # three rows, padded to 7
PROMPT = [1, 1, 2]  # each row's leading positions outside the loss mask
ADVANTAGES = [1.5, -0.7, 0.4]
CASES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", None), ("ppo", {"clip_high_threshold": 1.05}),
         ("cispo", None), ("dro", {"beta": 0.3}), ("gspo", None), ("gspo", {"clip_low_threshold": 0.97}),
         ("stable_reinforce", None), ("stable_reinforce", {"ratio_cap": 1.2, "kl_coeff": 0.3, "sequence_mask_high": 1.1})]


def _rows(on_policy: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = max(LENGTHS)
    lp = -torch.rand(len(LENGTHS), s, generator=g, dtype=torch.float64).float() * 2 - 0.1
    q = lp + (torch.rand(len(LENGTHS), s, generator=g) - 0.5) * 0.8  # ratios about 0.67..1.5
    mask = torch.zeros(len(LENGTHS), s, dtype=torch.bool)
    for j, (n, p) in enumerate(zip(LENGTHS, PROMPT)):
        mask[j, p:n] = True
        lp[j, n:] = float("nan")  # a pad holds anything: it must not reach a loss, a gradient or a statistic
        q[j, n:] = float("-inf")
    if on_policy:
        q = lp.clone()
    ref = lp + (torch.rand(len(LENGTHS), s, generator=g) - 0.5) * 0.5
    return lp, q, mask, ref


def _stable_reinforce(cfg: dict | None, x: torch.Tensor, q: torch.Tensor, adv: float, mask: torch.Tensor):
    """The row as one sampled sequence (id 1 on its loss positions), from the written-out reference:
    a token loss with the reference's value and derivative, and where the correction acted."""
    groups = [1 if b else 0 for b in mask.tolist()]
    value, grad = reference_loss_and_grad(x.tolist(), q.tolist(), [adv if g else 0.0 for g in groups], groups, cfg)
    value, grad = torch.tensor(value, dtype=x.dtype), torch.tensor(grad, dtype=x.dtype)
    ref = reference_statistics(x.tolist(), q.tolist(), groups, cfg)
    cap = {"ratio_cap": 2.0, **(cfg or {})}["ratio_cap"]
    acted = mask & (torch.exp(x.detach() - q) > cap) if not ref["masked_sequences"] else mask.clone()
    return value + grad * (x - x.detach()), acted


def _clip_active(loss_fn: str, cfg: dict, lp: torch.Tensor, q: torch.Tensor, adv: float, mask: torch.Tensor) -> torch.Tensor:
    r = torch.exp(lp - q)
    if loss_fn == "cispo":
        return (r < cfg["clip_low_threshold"]) | (r > cfg["clip_high_threshold"])
    if loss_fn == "gspo":
        marked = [i for i in range(len(mask)) if mask[i]]
        r = torch.exp(torch.tensor(sum(float(lp[i] - q[i]) for i in marked) / len(marked))).expand_as(lp)
    if loss_fn in ("ppo", "gspo"):
        return ((adv > 0) & (r > cfg["clip_high_threshold"])) | ((adv < 0) & (r < cfg["clip_low_threshold"]))
    return torch.zeros_like(lp, dtype=torch.bool)


def _expected(loss_fn, cfg, lp, q, mask, ref, kl_coef, weights):
    """Per row, from the definitions, on the row's own length: (numerator, d numerator / d lp,
    tokens, clipped, ratio_sum, kl_sum)."""
    out = []
    full = resolve_loss(loss_fn, cfg)[1]
    rl = LOSSES[loss_fn].kind == "rl"
    for j, n in enumerate(LENGTHS):
        m = mask[j, :n]
        x = lp[j, :n].double().clone().requires_grad_(True)
        inp = {"weights": m.double(), "logprobs": q[j, :n].double(), "advantages": ADVANTAGES[j] * m.double(),
               "sequence_ratio_mask": m.double()}
        if loss_fn == "stable_reinforce":
            token, acted = _stable_reinforce(cfg, x, q[j, :n].double(), ADVANTAGES[j], m)
        else:
            token = tinker_token_loss(loss_fn, cfg, x, inp)
            acted = _clip_active(loss_fn, full, x.detach(), q[j, :n].double(), ADVANTAGES[j], m)
        kl = k3_kl(x, ref[j, :n].double()) if rl else torch.zeros_like(x)
        numerator = (torch.where(m, token + kl_coef * kl, torch.zeros_like(token))).sum() * weights[j]
        (grad,) = torch.autograd.grad(numerator, x)
        r = torch.exp(x.detach() - q[j, :n].double())
        clipped = acted & m if rl else m & False
        out.append(dict(numerator=float(numerator.detach()), grad=grad, tokens=int(m.sum()), clipped=int(clipped.sum()),
                        ratio_sum=float(r[m].sum()) if rl else 0.0, kl_sum=float(kl.detach()[m].sum())))
    return out


def _ours(loss_fn, cfg, lp, q, mask, ref, kl_coef, weights):
    full = resolve_loss(loss_fn, cfg)[1]
    x = lp.clone().requires_grad_(True)
    inp = TokenLossInputs(logprobs=x, mask=mask, losses=[RowLoss.of(loss_fn, full)] * len(LENGTHS),
                          advantage=torch.tensor(ADVANTAGES), rollout_logprobs=q,
                          kl_coef=torch.full((len(LENGTHS),), kl_coef), ref_logprobs=ref if kl_coef else None,
                          per_token_weight=torch.tensor(weights))
    num, stats = sample_loss_numerators(inp)
    (grad,) = torch.autograd.grad(num.sum(), x)
    return num, grad, stats


@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[f"{n}{'-' + str(c) if c else ''}" for n, c in CASES])
def test_every_statistic_of_every_loss_against_its_definition(loss_fn, cfg, on_policy):
    lp, q, mask, ref = _rows(on_policy)
    kl_coef = 0.25 if LOSSES[loss_fn].kind == "rl" else 0.0
    weights = [1.0 / int(mask[j].sum()) for j in range(len(LENGTHS))]  # sequence_mean's per-row weight
    num, grad, stats = _ours(loss_fn, cfg, lp, q, mask, ref, kl_coef, weights)
    want = _expected(loss_fn, cfg, lp, q, mask, ref, kl_coef, weights)
    for j, (n, w) in enumerate(zip(LENGTHS, want)):
        assert float(num[j]) == pytest.approx(w["numerator"], rel=1e-5, abs=1e-6), (j, "numerator")
        assert torch.allclose(grad[j, :n].double(), w["grad"], rtol=1e-5, atol=1e-6), (j, grad[j], w["grad"])
        assert bool((grad[j, n:] == 0).all()), "the pad got a gradient"
        assert int(stats.tokens[j]) == w["tokens"]
        assert int(stats.clipped[j]) == w["clipped"], (j, "clipped")
        assert float(stats.ratio_sum[j]) == pytest.approx(w["ratio_sum"], rel=1e-6), (j, "ratio_sum")
        # k3 = exp(d) - d - 1 cancels to about d^2 / 2 in fp32: each token's value is off by up to a few
        # ulps of 1 (2**-24), whatever its size, so the sum is held to that per token
        assert float(stats.kl_sum[j]) == pytest.approx(w["kl_sum"], abs=4 * n * 2**-24), (j, "kl_sum")
    if on_policy and LOSSES[loss_fn].kind == "rl":
        # the reported mean (slot_metrics: ratio_sum / rl tokens): exactly 1, whatever the padding
        assert float(stats.ratio_sum.sum()) / float(stats.tokens.sum()) == 1.0
        assert int(stats.clipped.sum()) == 0  # r = 1 lies inside every clip range here


def test_rows_of_different_losses_in_one_micro_batch_each_get_their_own():
    """One micro-batch mixing three slots' losses equals each row evaluated alone (rows grouped by
    entry and config, put back in row order)."""
    lp, q, mask, ref = _rows(False, seed=3)
    losses = [RowLoss.of("cispo", resolve_loss("cispo", None)[1]), RowLoss.of("cross_entropy"),
              RowLoss.of("gspo", resolve_loss("gspo", None)[1])]
    x = lp.clone().requires_grad_(True)
    inp = TokenLossInputs(logprobs=x, mask=mask, losses=losses, advantage=torch.tensor(ADVANTAGES), rollout_logprobs=q,
                          kl_coef=torch.zeros(3), ref_logprobs=None, per_token_weight=torch.ones(3))
    num, stats = sample_loss_numerators(inp)
    (grad,) = torch.autograd.grad(num.sum(), x)
    for j, row in enumerate(losses):
        want = _expected(row.name, dict(row.config), lp, q, mask, ref, 0.0, [1.0] * 3)[j]
        n = LENGTHS[j]
        assert float(num[j]) == pytest.approx(want["numerator"], rel=1e-5, abs=1e-6)
        assert torch.allclose(grad[j, :n].double(), want["grad"], rtol=1e-5, atol=1e-6)
        assert int(stats.clipped[j]) == want["clipped"] and float(stats.ratio_sum[j]) == pytest.approx(want["ratio_sum"])


def test_every_entry_is_covered():
    assert {n for n, _ in CASES} == set(LOSSES)
    assert all(math.isfinite(v) for _, c in CASES for v in (c or {}).values())
