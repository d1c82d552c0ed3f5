"""stable_reinforce written from lorafleet's stated definition (docs/tinker.md, "stable_reinforce"),
position by position in plain Python floats: NOT from trainer/losses/stable_reinforce.py.

The definition, for one datum with positions t: lp_t (the trainer's log-prob of target t), q_t (the
engine's log-prob recorded at sampling), A_t (advantage), k_t (0: not a sampled token; k >= 1: a
sampled token of the datum's k-th sequence); config C = ratio_cap, L = sequence_mask_low,
H = sequence_mask_high, beta = kl_coeff:

    r_t  = exp(lp_t - q_t)                               (a number: no gradient flows through it)
    G_k  = exp( (1 / n_k) * sum over k's positions of (lp_t - q_t) )
    keep_k = L <= G_k <= H
    loss_t = keep_{k_t} * ( -min(r_t, C) * A_t * lp_t + beta / 2 * (lp_t - q_t)^2 )     (k_t >= 1)
    loss_t = 0                                                                           (k_t = 0)

and its derivative with respect to lp_t, written out (r_t and G_k are constants of the gradient):

    d loss_t / d lp_t = keep_{k_t} * ( -min(r_t, C) * A_t + beta * (lp_t - q_t) )       (k_t >= 1), else 0.
"""

from __future__ import annotations

import math

DEFAULTS = {"ratio_cap": 2.0, "sequence_mask_low": 0.5, "sequence_mask_high": 2.0, "kl_coeff": 0.0}


def _kept_sequences(lp: list[float], q: list[float], k: list[int], low: float, high: float) -> dict[int, bool]:
    gaps: dict[int, list[float]] = {}
    for lp_t, q_t, k_t in zip(lp, q, k):
        if k_t >= 1:
            gaps.setdefault(k_t, []).append(lp_t - q_t)
    return {seq: low <= math.exp(sum(g) / len(g)) <= high for seq, g in gaps.items()}


def reference_loss_and_grad(lp: list[float], q: list[float], adv: list[float], k: list[int],
                            cfg: dict[str, float] | None = None) -> tuple[list[float], list[float]]:
    """Per-position loss and d loss / d lp of one datum."""
    c = {**DEFAULTS, **(cfg or {})}
    kept = _kept_sequences(lp, q, k, c["sequence_mask_low"], c["sequence_mask_high"])
    losses, grads = [], []
    for lp_t, q_t, a_t, k_t in zip(lp, q, adv, k):
        if k_t < 1 or not kept[k_t]:
            losses.append(0.0)
            grads.append(0.0)
            continue
        w = min(math.exp(lp_t - q_t), c["ratio_cap"])
        losses.append(-w * a_t * lp_t + c["kl_coeff"] / 2 * (lp_t - q_t) ** 2)
        grads.append(-w * a_t + c["kl_coeff"] * (lp_t - q_t))
    return losses, grads


def reference_statistics(lp: list[float], q: list[float], k: list[int], cfg: dict[str, float] | None = None) -> dict[str, float]:
    """The statistics the definition names, for one datum: sampled tokens, sequences, masked
    sequences, truncated tokens (kept tokens with r > C), the sums of r and of (lp - q)^2 / 2 over the
    sampled tokens, and the largest |lp - q| among them."""
    c = {**DEFAULTS, **(cfg or {})}
    kept = _kept_sequences(lp, q, k, c["sequence_mask_low"], c["sequence_mask_high"])
    sampled = [(lp_t - q_t, k_t) for lp_t, q_t, k_t in zip(lp, q, k) if k_t >= 1]
    return {"sampled_tokens": float(len(sampled)), "sequences": float(len(kept)),
            "masked_sequences": float(sum(1 for v in kept.values() if not v)),
            "truncated_tokens": float(sum(1 for d, k_t in sampled if kept[k_t] and math.exp(d) > c["ratio_cap"])),
            "ratio_sum": sum(math.exp(d) for d, _ in sampled), "kl_sum": sum(d * d / 2 for d, _ in sampled),
            "max_abs_log_ratio": max((abs(d) for d, _ in sampled), default=0.0)}
