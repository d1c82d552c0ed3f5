"""stable_reinforce: lorafleet's definition (Tinker documents the loss's contract, not its formula).

REINFORCE whose per-token weight corrects for the gap between the engine that sampled a token and
the trainer that trains on it, computed from what the SERVER recorded at sampling time (never from
log-probabilities a client sends), truncated and masked so that a large gap cannot blow the update
up. Built from two published corrections of that gap:

* truncated importance sampling (TIS; Yao, Liu, Zhang, Dong, Shang, Gao, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training", 2025): weight each token's policy gradient
  by the trainer/sampler probability ratio, capped at C (they use C = 2);
* masked, sequence-level importance sampling (Liu, Li, Fu, Wang, Liu, Shen, "When Speed Kills
  Stability: Demystifying RL Collapse from the Training-Inference Mismatch", 2025): drop (mask) a
  whole sequence whose sampler was too far from the trainer instead of reweighting it, judged by a
  length-invariant sequence ratio, the geometric mean of its token ratios.

Per position t of one datum (or one dataset row), with lp_t = log p(target_t) under the policy being
trained (differentiable), sg a stop-gradient, and the inputs:

    q_t  = ``logprobs``: the ENGINE's log-probability of the same token, recorded when it was sampled
    A_t  = ``advantages``
    k_t  = ``sampled_sequence``: 0 where the position is not a sampled token (a prompt token); k >= 1
           where it is a sampled token of the datum's k-th sampled sequence

    d_t   = sg(lp_t) - q_t
    w_t   = min(exp(d_t), C)                                   truncated token weight (C = ratio_cap)
    G_k   = exp(mean of d_t over the positions with k_t = k)   sequence k's geometric-mean ratio
    m_k   = 1 if L <= G_k <= H else 0                          sequence mask (L, H = sequence_mask_low/high)
    loss_t = m_{k_t} * ( -w_t * A_t * lp_t + kl_coeff / 2 * (lp_t - q_t)^2 )   where k_t >= 1
    loss_t = 0                                                                  where k_t = 0

``kl_coeff`` weighs the k2 estimate (Schulman 2020, "Approximating KL divergence") of the KL
divergence between the sampler's and the trainer's token distributions, (lp - q)^2 / 2 per sampled
token: a proximal term that pulls the trainer back towards the policy that produced the data; its
gradient grows linearly with the gap (the k3 form's grows exponentially). Defaults:
``ratio_cap`` 2.0 (TIS's C), ``sequence_mask_low`` 0.5 and ``sequence_mask_high`` 2.0 (a sequence is
dropped only when its tokens were on average twice as likely, or half as likely, under the trainer
as under its sampler: a stale or broken sampler, not the ordinary numerical gap, ~1e-6 on the CPU in
fp32 and ~1e-3 in bf16), ``kl_coeff`` 0.0.

The caller sums the per-token loss (Tinker: a datum's loss is its sum) or masks and normalizes it
(dataset runs: trainer/losses/rows.py, where each row is one sampled sequence and the rollout's
recorded log-probabilities are its ``logprobs``). Pure torch; trainer/losses/table.py registers it.
"""

from __future__ import annotations

import math

import torch

DEFAULTS = {"ratio_cap": 2.0, "sequence_mask_low": 0.5, "sequence_mask_high": 2.0, "kl_coeff": 0.0}
INPUTS = ("target_tokens", "logprobs", "advantages", "sampled_sequence")


def check_config(cfg: dict[str, float]) -> None:
    """ValueError naming the allowed ranges."""
    if not cfg["ratio_cap"] > 0:
        raise ValueError(f"loss_fn_config['ratio_cap'] must be > 0 (the cap C of the token weight min(ratio, C), "
                         f"default 2.0), got {cfg['ratio_cap']}")
    if not 0 <= cfg["sequence_mask_low"] <= 1 <= cfg["sequence_mask_high"]:
        raise ValueError("need 0 <= sequence_mask_low <= 1 <= sequence_mask_high (bounds on a sequence's geometric-mean "
                         f"ratio, default 0.5 and 2.0), got {cfg['sequence_mask_low']} and {cfg['sequence_mask_high']}")
    if cfg["kl_coeff"] < 0:
        raise ValueError(f"loss_fn_config['kl_coeff'] must be >= 0 (the weight of the KL penalty), got {cfg['kl_coeff']}")


def check_inputs(inp: dict[str, torch.Tensor]) -> None:
    k = inp["sampled_sequence"]
    if k.is_floating_point() and not bool((k == k.round()).all()):
        raise ValueError("loss_fn_inputs['sampled_sequence'] must hold whole numbers (0: not sampled; k >= 1: sequence k)")
    if bool((k < 0).any()) or bool((k > k.shape[-1]).any()):
        raise ValueError(f"loss_fn_inputs['sampled_sequence'] must be in [0, {k.shape[-1]}]")


def sequence_mask(delta: torch.Tensor, groups: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[..., S] bool: the sampled positions (groups >= 1) whose sequence's geometric-mean ratio
    exp(mean of delta over the sequence's positions) lies in [low, high]. Sequences are the positions
    of one group id along the last dimension."""
    gid = groups.long()
    sampled = gid > 0
    zeros = torch.zeros(*delta.shape[:-1], delta.shape[-1] + 1, dtype=delta.dtype, device=delta.device)
    sums = zeros.scatter_add(-1, gid, torch.where(sampled, delta, torch.zeros_like(delta)))
    counts = zeros.scatter_add(-1, gid, sampled.to(delta.dtype))
    log_mean = sums / counts.clamp(min=1.0)
    lo = math.log(low) if low > 0 else -math.inf
    kept = (log_mean >= lo) & (log_mean <= math.log(high))
    return kept.gather(-1, gid) & sampled


def token_loss(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, where the correction acted: a kept token whose weight was truncated, or a
    token of a masked sequence), both of lp's shape."""
    q, adv, groups = inp["logprobs"], inp["advantages"], inp["sampled_sequence"]
    delta = lp.detach() - q
    ratio = torch.exp(delta)
    weight = torch.clamp(ratio, max=cfg["ratio_cap"])
    keep = sequence_mask(delta, groups, cfg["sequence_mask_low"], cfg["sequence_mask_high"])
    per_token = -weight * adv * lp + 0.5 * cfg["kl_coeff"] * (lp - q) ** 2
    loss = torch.where(keep, per_token, torch.zeros_like(per_token))
    sampled = groups > 0
    acted = sampled & ((keep & (ratio > cfg["ratio_cap"])) | ~keep)
    return loss, acted.detach()


def statistics(lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]) -> dict[str, float]:
    """One datum's (or row's) counts and sums, added up over a call's datums by the caller:
    sampled_tokens, sequences, masked_sequences, truncated_tokens (kept tokens whose ratio exceeded
    the cap), ratio_sum and kl_sum ((lp - q)^2 / 2) over the sampled tokens, max_abs_log_ratio."""
    q, groups = inp["logprobs"], inp["sampled_sequence"].long()
    delta = (lp.detach() - q).double()
    sampled = groups > 0
    keep = sequence_mask(delta, groups, cfg["sequence_mask_low"], cfg["sequence_mask_high"])
    ids = torch.unique(groups[sampled])
    masked = sum(1 for k in ids.tolist() if not bool(keep[groups == k].any()))
    ratio = torch.exp(delta)
    return {"sampled_tokens": float(sampled.sum()), "sequences": float(len(ids)), "masked_sequences": float(masked),
            "truncated_tokens": float((keep & (ratio > cfg["ratio_cap"])).sum()),
            "ratio_sum": float(ratio[sampled].sum()), "kl_sum": float((0.5 * delta[sampled] ** 2).sum()),
            "max_abs_log_ratio": float(delta[sampled].abs().max()) if bool(sampled.any()) else 0.0}


def call_metrics(totals: dict[str, float]) -> dict[str, float]:
    """A call's Tinker metrics (``name:reduction``, the SDK's convention) from its datums' summed
    statistics (``max_abs_log_ratio`` combined by max)."""
    n = max(totals.get("sampled_tokens", 0.0), 1.0)
    return {"stable_reinforce/sampled_tokens:sum": totals.get("sampled_tokens", 0.0),
            "stable_reinforce/sequences:sum": totals.get("sequences", 0.0),
            "stable_reinforce/masked_sequences:sum": totals.get("masked_sequences", 0.0),
            "stable_reinforce/truncated_tokens:sum": totals.get("truncated_tokens", 0.0),
            "stable_reinforce/ratio:mean": totals.get("ratio_sum", 0.0) / n,
            "stable_reinforce/kl:mean": totals.get("kl_sum", 0.0) / n,
            "stable_reinforce/abs_log_ratio:max": totals.get("max_abs_log_ratio", 0.0)}
