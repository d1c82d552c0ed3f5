"""Token losses of one adapter, written from their papers (not from trainer/losses.py).

Per learned token t of a sample (log-probability ``logp`` of the token under the
policy being trained):

* SFT: the negative log-likelihood, ``-logp``.
* PPO-clip (Schulman et al. 2017, eq. 7), as GRPO (Shao et al. 2024) and DAPO (Yu et
  al. 2025, asymmetric "clip-higher" range) use it per token with the sample's
  advantage A: with the importance ratio ``r = exp(logp - logp_old)`` (logp_old: the
  policy that generated the sample),
      L_clip = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A).
  Written here in its case form: where the clipped branch is the smaller one, i.e.
  (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low), the term is the constant
  -clip(r) * A (no gradient); everywhere else it is -r * A.
* KL to a reference policy (GRPO eq. 4, the "k3" estimator of Schulman 2020,
  "Approximating KL divergence"): KL(pi_theta || pi_ref) is estimated per token by
      k3 = q - log q - 1,   q = pi_ref(token) / pi_theta(token) = exp(logp_ref - logp),
  which is >= 0 and zero only where the two agree; it is ADDED to the loss with weight
  beta (kl_coef), pulling the policy towards the reference.

How a step's token losses become one number (the per-adapter normalizations lorafleet
claims, trainer/config.py):
* ``sequence_mean`` (GRPO): mean over each sample's learned tokens, then mean over the
  step's samples.
* ``token_mean`` (DAPO, eq. 8): sum over every learned token of the step / their count.
* ``constant`` (Dr. GRPO, Liu et al. 2025): sum over learned tokens / (samples x a fixed
  token count L).
"""

from __future__ import annotations

import torch


def sft_token_loss(logp: torch.Tensor) -> torch.Tensor:
    return -logp


def ppo_clip_token_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantage: float, eps_low: float, eps_high: float) -> torch.Tensor:
    ratio = torch.exp(logp - logp_old)
    clipped_value = -advantage * torch.clamp(ratio.detach(), 1.0 - eps_low, 1.0 + eps_high)
    if advantage > 0:
        clip_active = ratio.detach() > 1.0 + eps_high
    elif advantage < 0:
        clip_active = ratio.detach() < 1.0 - eps_low
    else:
        clip_active = torch.zeros_like(ratio, dtype=torch.bool)
    return torch.where(clip_active, clipped_value, -advantage * ratio)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) (>= 0)."""
    q = torch.exp(logp_ref - logp)
    return q - torch.log(q) - 1.0


def normalize_step(token_losses: list[torch.Tensor], how: str, tokens_per_sample: int | None = None) -> torch.Tensor:
    """One step's loss from its samples' per-token losses (one 1-D tensor per sample)."""
    n = len(token_losses)
    if how == "sequence_mean":
        return sum(t.mean() for t in token_losses) / n
    if how == "token_mean":
        return sum(t.sum() for t in token_losses) / sum(t.numel() for t in token_losses)
    if how == "constant":
        return sum(t.sum() for t in token_losses) / (n * tokens_per_sample)
    raise ValueError(f"unknown normalization {how!r}")

