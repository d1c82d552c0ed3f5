"""Token losses of one adapter, written from their papers and Tinker's docs (not from trainer/losses/table.py).

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

After them: the Tinker API's built-in losses of one datum, each value and gradient written
out from its documented definition (the comment above ``TINKER_DEFAULTS``).
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



# -- Tinker's built-in losses (one datum), from tinker-docs.thinkingmachines.ai/tinker/losses -----------
#
# Per position i of one datum: lp = log p(target_tokens[i]) under the model being trained, q = the
# ``logprobs`` input (the sampler's), A = ``advantages``, w = ``weights``, r = p / q = exp(lp - q).
# A datum's loss is the SUM over its positions (no mean anywhere). The clip bounds are absolute
# ratio thresholds: config ``clip_low_threshold`` / ``clip_high_threshold``, 1 - eps_low and
# 1 + eps_high with eps "currently fixed to 0.2 in Tinker" (its PPO page): 0.8 and 1.2.
#
# * cross_entropy: -w lp.
# * importance_sampling: -r A.
# * ppo: -min(r A, clip(r, lo, hi) A). Case form: where the clipped branch is the smaller one,
#   (A > 0 and r > hi) or (A < 0 and r < lo), the term is the constant -clip(r) A; elsewhere -r A.
# * cispo (MiniMax-M1): -sg(clip(r, lo, hi)) lp A: a REINFORCE term whose weight is the clipped
#   ratio, held constant.
# * dro: -(lp A - beta/2 (lp - q)^2), beta required (no documented default).
# * gspo (GSPO-token, Zheng et al. 2025 and Tinker's GSPO page): s = exp(mean over the marked
#   positions M (sequence_ratio_mask != 0) of (lp - q)), taken as a constant; each position's ratio
#   s_t = s * p / sg(p) has the value s and the gradient of its own lp. Loss -min(s_t A, clip(s_t) A)
#   at every position, in PPO's case form with s in place of r.
#
# Gradients, d(loss_i)/d(lp_i), from the same definitions (the loss of position i depends on no
# other position's lp: gspo's s is a constant):
# cross_entropy -w; importance_sampling -r A; ppo 0 where clipped, else -r A; cispo -clip(r) A;
# dro -(A - beta (lp - q)); gspo 0 where clipped, else -s A.

TINKER_DEFAULTS = {
    "cross_entropy": {}, "importance_sampling": {}, "dro": {"beta": None},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
TINKER_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}


def tinker_config(loss_fn: str, cfg: dict | None) -> dict:
    """The documented defaults with the call's keys over them."""
    return {**TINKER_DEFAULTS[loss_fn], **(cfg or {})}


def _case_clip_active(ratio: torch.Tensor, adv: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return ((adv > 0) & (ratio > hi)) | ((adv < 0) & (ratio < lo))


def _scalar_clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.where(x < lo, torch.full_like(x, lo), torch.where(x > hi, torch.full_like(x, hi), x))


def gspo_sequence_ratio(lp: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s = exp(mean over the marked positions of lp - q), a constant (no gradient)."""
    marked = [i for i in range(len(mask)) if float(mask[i]) != 0.0]
    return torch.exp(sum(float(lp[i]) - float(q[i]) for i in marked) / torch.tensor(float(len(marked))))


def tinker_token_loss(loss_fn: str, cfg: dict | None, lp: torch.Tensor, inp: dict) -> torch.Tensor:
    """Per-position loss [N] of one datum (differentiable in lp)."""
    if loss_fn == "stable_reinforce":  # lorafleet's own definition, written out in tests/reference/stable_reinforce.py
        return _stable_reinforce(cfg, lp, inp)
    c = tinker_config(loss_fn, cfg)
    if loss_fn == "cross_entropy":
        return -(inp["weights"] * lp)
    q, adv = inp["logprobs"], inp["advantages"]
    r = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(r * adv)
    if loss_fn == "dro":
        return -(lp * adv) + 0.5 * c["beta"] * (lp - q) ** 2
    lo, hi = c["clip_low_threshold"], c["clip_high_threshold"]
    if loss_fn == "cispo":
        return -(_scalar_clip(r.detach(), lo, hi) * lp * adv)
    if loss_fn == "ppo":
        return torch.where(_case_clip_active(r.detach(), adv, lo, hi), -(_scalar_clip(r.detach(), lo, hi) * adv), -(r * adv))
    if loss_fn == "gspo":
        s = gspo_sequence_ratio(lp.detach(), q, inp["sequence_ratio_mask"])
        s_t = s * torch.exp(lp - lp.detach())
        s_all = s.expand_as(lp)
        return torch.where(_case_clip_active(s_all, adv, lo, hi), -(_scalar_clip(s_all, lo, hi) * adv), -(s_t * adv))
    raise AssertionError(f"no reference for {loss_fn!r}")


def tinker_token_grad(loss_fn: str, cfg: dict | None, lp: torch.Tensor, inp: dict) -> torch.Tensor:
    """d(loss_i)/d(lp_i) [N] of one datum, written out (see the comment above)."""
    c = tinker_config(loss_fn, cfg)
    lp = lp.detach()
    if loss_fn == "cross_entropy":
        return -inp["weights"]
    q, adv = inp["logprobs"], inp["advantages"]
    r = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(r * adv)
    if loss_fn == "dro":
        return -(adv - c["beta"] * (lp - q))
    lo, hi = c["clip_low_threshold"], c["clip_high_threshold"]
    if loss_fn == "cispo":
        return -(_scalar_clip(r, lo, hi) * adv)
    if loss_fn == "ppo":
        return torch.where(_case_clip_active(r, adv, lo, hi), torch.zeros_like(r), -(r * adv))
    if loss_fn == "gspo":
        s = gspo_sequence_ratio(lp, q, inp["sequence_ratio_mask"]).expand_as(lp)
        return torch.where(_case_clip_active(s, adv, lo, hi), torch.zeros_like(s), -(s * adv))
    raise AssertionError(f"no reference for {loss_fn!r}")


def _stable_reinforce(cfg: dict | None, lp: torch.Tensor, inp: dict) -> torch.Tensor:
    """The written-out definition's per-position values, with its written-out derivative as the gradient."""
    from tests.reference.stable_reinforce import reference_loss_and_grad

    groups = [int(k) for k in inp["sampled_sequence"].tolist()]
    value, grad = reference_loss_and_grad(lp.detach().double().tolist(), inp["logprobs"].double().tolist(),
                                          inp["advantages"].double().tolist(), groups, cfg)
    value, grad = torch.tensor(value, dtype=lp.dtype), torch.tensor(grad, dtype=lp.dtype)
    return value + grad * (lp - lp.detach())
