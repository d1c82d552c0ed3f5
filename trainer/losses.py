"""Token losses: supervised cross-entropy and a GRPO/DAPO-style policy gradient.

All functions work on a micro-batch laid out [b, s] (one row per sample, token t's
loss predicts label t = token t+1). Per-sample parameters (objective, clip
range, KL weight, advantage) come as [b] tensors so one micro-batch can mix
adapters with different objectives.

The *un-normalized* per-sample loss returned by ``sample_loss_numerators`` is
``w_s * sum_t mask * token_loss`` with ``w_s = 1 / (loss tokens of s)`` for
``sequence_mean`` and 1 otherwise; the per-slot normalizer (samples_per_step,
the step's loss-token count, or samples_per_step * loss_norm_tokens) is applied
to the accumulated gradient when the slot steps (config.py explains why this
gives each adapter exactly its alone-gradient).

Masked positions are excluded with ``torch.where`` rather than multiplication so
that a non-finite value at a pad cannot turn a sample's loss into NaN; and the
per-token inputs are set to 0 there *before* any arithmetic, so that such a value
cannot turn the gradient into NaN either (the backward of ``where`` multiplies the
unselected branch's gradient by 0, and 0 * NaN from ``exp`` of a non-finite input
would still be NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class TokenLossInputs:
    logprobs: torch.Tensor  # [b, s] fp32, log p(label) under policy (LoRA on), requires grad
    mask: torch.Tensor  # [b, s] bool, loss positions
    is_rl: torch.Tensor  # [b] bool
    advantage: torch.Tensor  # [b] fp32
    rollout_logprobs: torch.Tensor  # [b, s] fp32 (policy logprobs at rollout; = logprobs.detach() if unknown)
    clip_low: torch.Tensor  # [b]
    clip_high: torch.Tensor  # [b]
    kl_coef: torch.Tensor  # [b]
    ref_logprobs: torch.Tensor | None  # [b, s] base logprobs (LoRA off), where any kl_coef > 0
    per_token_weight: torch.Tensor  # [b] (1/n_tokens for sequence_mean, else 1)


@dataclass
class TokenLossStats:
    """Per-sample sums (detached) for metrics."""

    numerator: torch.Tensor  # [b] the weighted loss sum (what is back-propagated)
    tokens: torch.Tensor  # [b] loss tokens
    clipped: torch.Tensor  # [b] RL tokens whose ratio was clipped
    ratio_sum: torch.Tensor  # [b]
    kl_sum: torch.Tensor  # [b] k3 KL estimate summed over tokens


def policy_gradient_token_loss(inp: TokenLossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token loss, ratio, clipped flag, k3 KL), all [b, s].

    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)) + kl_coef * KL,
    ratio = exp(logp - logp_rollout), KL = exp(ref - logp) - (ref - logp) - 1 (k3, >= 0).
    """
    log_ratio = inp.logprobs - inp.rollout_logprobs
    ratio = torch.exp(log_ratio)
    adv = inp.advantage.unsqueeze(1)
    lo = (1.0 - inp.clip_low).unsqueeze(1)
    hi = (1.0 + inp.clip_high).unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).detach()
    if inp.ref_logprobs is not None:
        delta = inp.ref_logprobs - inp.logprobs
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + inp.kl_coef.unsqueeze(1) * kl
    else:
        kl = torch.zeros_like(loss)
    return loss, ratio.detach(), was_clipped, kl.detach()


def sample_loss_numerators(inp: TokenLossInputs) -> tuple[torch.Tensor, TokenLossStats]:
    """[b] weighted per-sample loss sums (differentiable) and their statistics."""
    inp = _zero_masked_positions(inp)
    sft_loss = -inp.logprobs
    rl_loss, ratio, was_clipped, kl = policy_gradient_token_loss(inp)
    is_rl = inp.is_rl.unsqueeze(1)
    token_loss = torch.where(is_rl, rl_loss, sft_loss)
    token_loss = torch.where(inp.mask, token_loss, torch.zeros_like(token_loss))
    numerators = token_loss.sum(dim=1) * inp.per_token_weight
    rl_mask = inp.mask & is_rl
    zero = torch.zeros_like(ratio)
    stats = TokenLossStats(
        numerator=numerators.detach(),
        tokens=inp.mask.sum(dim=1).to(torch.float32),
        clipped=(was_clipped & rl_mask).sum(dim=1).to(torch.float32),
        ratio_sum=torch.where(rl_mask, ratio, zero).sum(dim=1),
        kl_sum=torch.where(rl_mask, kl, zero).sum(dim=1),
    )
    return numerators, stats


def _zero_masked_positions(inp: TokenLossInputs) -> TokenLossInputs:
    """The per-token inputs with 0 at positions outside the mask (module doc: no NaN gradient)."""

    def keep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(inp.mask, t, torch.zeros_like(t))

    return replace(inp, logprobs=keep(inp.logprobs), rollout_logprobs=keep(inp.rollout_logprobs),
                   ref_logprobs=keep(inp.ref_logprobs))
