"""trainer/losses/table.py against hand-computed cases.

PPO-clip on both sides of the trust region (value and gradient), the k3 KL estimate
and the sign of its term, token- vs sequence-level weighting, masked positions that
hold non-finite values, and GRPO group advantages with zero variance. Every expected
number below is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.losses.rows import RowLoss, TokenLossInputs, row_token_losses, sample_loss_numerators

pytestmark = pytest.mark.unit

CLIP_LOW, CLIP_HIGH = 0.2, 0.3  # offsets (SlotHyperParams.clip_low/high): trust region [0.8, 1.3]
# A dataset run's two default losses (SlotHyperParams.loss_choice): ppo with the offsets' bounds, cross_entropy.
RL_LOSS = RowLoss.of("ppo", {"clip_low_threshold": 1.0 - CLIP_LOW, "clip_high_threshold": 1.0 + CLIP_HIGH})
SFT_LOSS = RowLoss.of("cross_entropy")


def inputs(logp, old=None, *, adv=1.0, rl=True, kl_coef=0.0, ref=None, mask=None, weight=1.0):
    """One sample [1, s] with the given per-token values."""
    logp = torch.tensor([logp], dtype=torch.float32, requires_grad=True)
    old = logp.detach().clone() if old is None else torch.tensor([old], dtype=torch.float32)
    return TokenLossInputs(
        logprobs=logp,
        mask=torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor([mask]),
        losses=[RL_LOSS if rl else SFT_LOSS],
        advantage=torch.tensor([adv]),
        rollout_logprobs=old,
        kl_coef=torch.tensor([kl_coef]),
        ref_logprobs=None if ref is None else torch.tensor([ref], dtype=torch.float32),
        per_token_weight=torch.tensor([weight]),
    )


def loss_and_grad(inp):
    loss, ratio, clipped, kl = row_token_losses(inp)
    (grad,) = torch.autograd.grad(loss.sum(), inp.logprobs)
    return loss[0].tolist(), grad[0].tolist(), ratio[0].tolist(), clipped[0].tolist(), kl[0].tolist()


# Token log-ratios log(r): r = 1.5 (above 1.3), 1.1 (inside), 0.5 (below 0.8).
LOG_R = [math.log(1.5), math.log(1.1), math.log(0.5)]


def test_ppo_clip_positive_advantage():
    """A = 2: L = -min(r A, clip(r) A).
    r = 1.5: clipped branch is smaller -> L = -1.3 * 2 = -2.6, no gradient.
    r = 1.1: inside -> L = -2.2, dL/dlogp = -A r = -2.2.
    r = 0.5: min picks r A (1.0 < 1.6) -> L = -1.0, gradient -A r = -1.0 (no clipping below
    for a positive advantage: a worse-than-before token keeps being pushed up)."""
    loss, grad, ratio, clipped, _ = loss_and_grad(inputs(LOG_R, [0.0] * 3, adv=2.0))
    assert ratio == pytest.approx([1.5, 1.1, 0.5], rel=1e-6)
    assert loss == pytest.approx([-2.6, -2.2, -1.0], rel=1e-6)
    assert grad == pytest.approx([0.0, -2.2, -1.0], rel=1e-6, abs=1e-7)
    assert clipped == [True, False, False]


def test_ppo_clip_negative_advantage():
    """A = -2: L = -min(r A, clip(r) A) = max(2r, 2 clip(r)).
    r = 1.5: 2r = 3.0 > 2.6 -> L = 3.0, gradient -A r = 3.0 (no clipping above for a
    negative advantage).
    r = 1.1: L = 2.2, gradient 2.2.
    r = 0.5: clipped branch 2 * 0.8 = 1.6 > 1.0 -> L = 1.6, no gradient."""
    loss, grad, _, clipped, _ = loss_and_grad(inputs(LOG_R, [0.0] * 3, adv=-2.0))
    assert loss == pytest.approx([3.0, 2.2, 1.6], rel=1e-6)
    assert grad == pytest.approx([3.0, 2.2, 0.0], rel=1e-6, abs=1e-7)
    assert clipped == [False, False, True]


def test_on_policy_ratio_is_one_and_gradient_is_minus_advantage():
    """logp_old = logp (detached): r = 1, L = -A, dL/dlogp = -A (REINFORCE)."""
    loss, grad, ratio, _, _ = loss_and_grad(inputs([-0.7, -2.0], adv=0.5))
    assert ratio == [1.0, 1.0]
    assert loss == pytest.approx([-0.5, -0.5])
    assert grad == pytest.approx([-0.5, -0.5])


def test_k3_kl_value_and_sign():
    """k3 = q - log q - 1 with q = p_ref / p_theta = exp(ref - logp); added with +kl_coef.
    logp = -1, ref = -1.5: q = e^-0.5 = 0.6065306597, k3 = 0.6065306597 + 0.5 - 1 = 0.1065306597.
    logp = -2, ref = -1.0: q = e^1, k3 = e - 1 - 1 = 0.7182818285.
    Equal: 0. Its gradient in logp is kl_coef * (1 - q): positive where the policy puts more
    mass than the reference (descent lowers logp, towards ref), negative where it puts less.
    With A = 0 only the KL term remains: L = 0.5 * k3."""
    loss, grad, _, _, kl = loss_and_grad(inputs([-1.0, -2.0, -0.3], adv=0.0, kl_coef=0.5, ref=[-1.5, -1.0, -0.3]))
    assert kl == pytest.approx([0.1065306597, math.e - 2.0, 0.0], rel=1e-6, abs=1e-7)
    assert loss == pytest.approx([0.5 * 0.1065306597, 0.5 * (math.e - 2.0), 0.0], rel=1e-6, abs=1e-7)
    assert grad == pytest.approx([0.5 * (1 - math.exp(-0.5)), 0.5 * (1 - math.e), 0.0], rel=1e-6, abs=1e-7)
    assert grad[0] > 0 > grad[1]
    assert all(k >= 0 for k in kl)


def test_no_reference_no_kl():
    loss, _, _, _, kl = loss_and_grad(inputs([-1.0], adv=1.0, kl_coef=0.5, ref=None))
    assert kl == [0.0] and loss == pytest.approx([-1.0])


def test_token_vs_sequence_weighting_and_mask():
    """SFT sample, token losses -logp = [1, 2, 3, 4], the last token masked out:
    token-level numerator (weight 1) = 1 + 2 + 3 = 6; sequence-level (weight 1/3, the
    trainer's 1 / learned tokens) = 2. A NaN at a masked position changes nothing."""
    logp, mask = [-1.0, -2.0, -3.0, float("nan")], [True, True, True, False]
    num_tok, stats = sample_loss_numerators(inputs(logp, rl=False, mask=mask, weight=1.0))
    num_seq, _ = sample_loss_numerators(inputs(logp, rl=False, mask=mask, weight=1.0 / 3))
    assert num_tok.item() == pytest.approx(6.0) and num_seq.item() == pytest.approx(2.0)
    assert stats.tokens.item() == 3 and stats.clipped.item() == 0 and stats.kl_sum.item() == 0
    inp = inputs(logp, rl=False, mask=mask, weight=1.0 / 3)
    num, _ = sample_loss_numerators(inp)
    (grad,) = torch.autograd.grad(num.sum(), inp.logprobs)
    assert grad[0].tolist() == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 0.0])  # finite, zero at the pad
    # The same for an RL row with a KL term, with -inf and NaN in the pads of every input.
    inp = inputs([-1.0, float("-inf"), -0.5], [-1.0, float("nan"), -0.5], adv=1.0, kl_coef=0.5,
                 ref=[-1.0, float("inf"), -0.5], mask=[True, False, True])
    num, stats = sample_loss_numerators(inp)
    (grad,) = torch.autograd.grad(num.sum(), inp.logprobs)
    assert num.item() == pytest.approx(-2.0)  # r = 1 and k3 = 0 on both learned tokens: -A - A
    assert grad[0].tolist() == pytest.approx([-1.0, 0.0, -1.0])
    assert math.isfinite(stats.ratio_sum.item()) and math.isfinite(stats.kl_sum.item())


def test_mixed_rows_each_use_their_own_objective():
    """Row 0 SFT (ignores advantage and ratio), row 1 RL: numerators [1 + 2, -A * (r1 + r2)]
    with A = 1, r = 1.5 and 1.1 -> clipped to 1.3 and 1.1 -> -(1.3 + 1.1) = -2.4; clip
    statistics count only the RL row."""
    logp = torch.tensor([[-1.0, -2.0], [math.log(1.5), math.log(1.1)]], requires_grad=True)
    inp = TokenLossInputs(
        logprobs=logp, mask=torch.ones(2, 2, dtype=torch.bool), losses=[SFT_LOSS, RL_LOSS],
        advantage=torch.tensor([5.0, 1.0]), rollout_logprobs=torch.zeros(2, 2),
        kl_coef=torch.zeros(2), ref_logprobs=None, per_token_weight=torch.ones(2),
    )
    num, stats = sample_loss_numerators(inp)
    assert num.tolist() == pytest.approx([3.0, -2.4], rel=1e-6)
    assert stats.clipped.tolist() == [0.0, 1.0]
    assert stats.ratio_sum.tolist() == pytest.approx([0.0, 2.6], rel=1e-6)


def test_group_advantages_zero_variance():
    """Rewards all equal: (r - mean) = 0 and std = 0, so every advantage is exactly 0 (not
    NaN), and the policy-gradient term then has zero gradient: such a group teaches
    nothing. Rewards [1, 0]: mean 0.5, population std 0.5 -> (+-0.5) / (0.5 + 1e-6)."""
    from rollout.groups import group_advantages

    assert group_advantages([0.25, 0.25, 0.25, 0.25]) == [0.0, 0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0]) == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], rel=1e-12)
    _, grad, _, _, _ = loss_and_grad(inputs(LOG_R, [0.0] * 3, adv=0.0))
    assert grad == [0.0, 0.0, 0.0]
