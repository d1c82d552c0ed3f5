"""Token losses, one home: the REST runs' RL/SFT losses (micro-batch rows) and the Tinker
API's built-in losses (one datum), over ONE definition of the PPO clip.

The clip (``clip_ratio``, ``clipped_surrogate``): the importance ratio r = exp(logp - q)
(q: the sampler's log-probability of the token) is clipped to ABSOLUTE bounds
[low, high], and the clipped surrogate is -min(r * A, clip(r, low, high) * A). Tinker's
config keys are these bounds (``clip_low_threshold`` / ``clip_high_threshold``, default
0.8 / 1.2). REST runs are configured DAPO-style with offsets (``SlotHyperParams.clip_low``
/ ``clip_high``: r in [1 - clip_low, 1 + clip_high]); ``SlotHyperParams.ratio_bounds`` turns
them into bounds where the trainer builds a micro-batch (trainer/core.py), the only place
an offset is converted. Nothing below takes an offset.

REST runs (``sample_loss_numerators``): a micro-batch laid out [b, s] (one row per sample,
token t's loss predicts label t = token t+1). Per-sample parameters (objective, ratio
bounds, KL weight, advantage) come as [b] tensors so one micro-batch can mix adapters with
different objectives. The *un-normalized* per-sample loss is ``w_s * sum_t mask * token_loss``
with ``w_s = 1 / (loss tokens of s)`` for ``sequence_mean`` and 1 otherwise; the per-slot
normalizer (samples_per_step, the step's loss-token count, or samples_per_step *
loss_norm_tokens) is applied to the accumulated gradient when the slot steps (config.py
explains why this gives each adapter exactly its alone-gradient).

Masked positions are excluded with ``torch.where`` rather than multiplication so that a
non-finite value at a pad cannot turn a sample's loss into NaN; and the per-token inputs
are set to 0 there *before* any arithmetic, so that such a value cannot turn the gradient
into NaN either (the backward of ``where`` multiplies the unselected branch's gradient by
0, and 0 * NaN from ``exp`` of a non-finite input would still be NaN).

Tinker losses (``LOSSES``, ``resolve_loss``, ``check_inputs``): each works on ONE datum:
``target_logprobs`` lp [N] (log p(target_tokens[i]) at input position i, under the model's
LoRA, differentiable) and the datum's ``loss_fn_inputs`` ([N] tensors), and returns the
per-token loss [N]. The datum's loss is its SUM, and a forward_backward's gradient is the
gradient of the sum over the call's datums (Tinker's losses are sums: no mean over tokens
or datums; a client that wants a mean scales its weights/advantages). Positions are never
masked: a token is excluded by a zero weight (cross_entropy) or a zero advantage (the RL
losses), as in Tinker. Definitions (tinker-docs.thinkingmachines.ai/tinker/losses and its
per-loss pages; q = the ``logprobs`` input, A = ``advantages``, ratio = exp(lp - q)):

* cross_entropy:        -lp * weights
* importance_sampling:  -ratio * A
* ppo:                  -min(ratio * A, clip(ratio, lo, hi) * A)
* cispo:                -sg(clip(ratio, lo, hi)) * lp * A
* dro:                  -(lp * A - beta / 2 * (lp - q) ** 2)
* gspo (GSPO-token, Zheng et al. 2025): the sequence ratio s = exp(mean over the positions
  M that ``sequence_ratio_mask`` marks (!= 0) of sg(lp) - q); every token's ratio has s's
  value and its own log-probability's gradient, s_t = s * exp(lp - sg(lp)); loss
  -min(s_t * A, clip(s_t, lo, hi) * A).

``stable_reinforce`` is refused (``REFUSED``): its objective uses stability information that
Tinker's sampler records server-side, and that objective is not published in a form this
server can reproduce exactly; an approximation under its name would train silently
differently from Tinker. ``custom`` (server-side custom losses) is refused too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

# -- the clip (the one definition) ------------------------------------------------------------


def clip_ratio(ratio: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float) -> torch.Tensor:
    """The ratio clipped to the absolute bounds [low, high] (tensors broadcast against ratio)."""
    return torch.clamp(ratio, low, high)


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor | float, low: torch.Tensor | float,
                      high: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """(-min(ratio * A, clip(ratio, low, high) * A), where the clipped branch is the smaller one).

    Written as max(-A r, -A clip(r)): where the clipped branch wins its value is constant in
    the parameters (no gradient), as PPO intends; the flag is detached (for statistics)."""
    unclipped = -advantage * ratio
    clipped = -advantage * clip_ratio(ratio, low, high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


# -- REST runs: a micro-batch of rows ------------------------------------------------------------


@dataclass
class TokenLossInputs:
    logprobs: torch.Tensor  # [b, s] fp32, log p(label) under policy (LoRA on), requires grad
    mask: torch.Tensor  # [b, s] bool, loss positions
    is_rl: torch.Tensor  # [b] bool
    advantage: torch.Tensor  # [b] fp32
    rollout_logprobs: torch.Tensor  # [b, s] fp32 (policy logprobs at rollout; = logprobs.detach() if unknown)
    ratio_low: torch.Tensor  # [b] absolute lower bound of the ratio (module doc: the clip)
    ratio_high: torch.Tensor  # [b] absolute upper bound
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

    loss = clipped_surrogate(ratio, A, ratio_low, ratio_high) + kl_coef * KL,
    ratio = exp(logp - logp_rollout), KL = exp(ref - logp) - (ref - logp) - 1 (k3, >= 0).
    """
    ratio = torch.exp(inp.logprobs - inp.rollout_logprobs)
    loss, was_clipped = clipped_surrogate(ratio, inp.advantage.unsqueeze(1), inp.ratio_low.unsqueeze(1),
                                          inp.ratio_high.unsqueeze(1))
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


# -- Tinker's built-in losses: one datum -----------------------------------------------------------

TokenLoss = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    """One Tinker loss: the loss_fn_inputs it takes (all required; any other is refused), its
    loss_fn_config keys with their defaults (None: no default, the key must be given), the
    per-token loss, and an optional check of one datum's inputs beyond names and shapes."""

    inputs: tuple[str, ...]
    config: dict[str, float | None]
    fn: TokenLoss
    check: Callable[[dict[str, torch.Tensor]], None] | None = None


def _ratio(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inp["logprobs"])


def _cross_entropy(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -lp * inp["weights"]


def _importance_sampling(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -_ratio(lp, inp) * inp["advantages"]


def _ppo(lp, inp, cfg):  # noqa: ANN001, ANN202
    return clipped_surrogate(_ratio(lp, inp), inp["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"])[0]


def _cispo(lp, inp, cfg):  # noqa: ANN001, ANN202
    weight = clip_ratio(_ratio(lp, inp), cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(weight * lp * inp["advantages"])


def _dro(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -(lp * inp["advantages"] - 0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2)


def _gspo(lp, inp, cfg):  # noqa: ANN001, ANN202
    in_ratio = inp["sequence_ratio_mask"] != 0
    sequence_log_ratio = (lp.detach() - inp["logprobs"])[in_ratio].mean()
    ratio = torch.exp(sequence_log_ratio + lp - lp.detach())  # s's value, each token's own gradient
    return clipped_surrogate(ratio, inp["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"])[0]


def _check_gspo(inp: dict[str, torch.Tensor]) -> None:
    if not bool((inp["sequence_ratio_mask"] != 0).any()):
        raise ValueError("loss_fn_inputs['sequence_ratio_mask'] marks no position (the sequence ratio is a mean "
                         "over the marked ones): mark the sampled tokens with 1")


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}, _cross_entropy),
    "importance_sampling": LossSpec(_RL_INPUTS, {}, _importance_sampling),
    "ppo": LossSpec(_RL_INPUTS, dict(_CLIP), _ppo),
    "cispo": LossSpec(_RL_INPUTS, dict(_CLIP), _cispo),
    "dro": LossSpec(_RL_INPUTS, {"beta": None}, _dro),
    "gspo": LossSpec((*_RL_INPUTS, "sequence_ratio_mask"), dict(_CLIP), _gspo, _check_gspo),
}
REFUSED = {
    "stable_reinforce": "stable_reinforce is not served: its objective uses stability information that Tinker's "
                        "sampler records on its side, and that objective is not published in a form this server can "
                        "reproduce exactly (for off-policy data use ppo, cispo or gspo)",
    "custom": "server-side custom losses are not supported (forward_backward_custom runs client-side)",
}
FORWARD_ONLY = "forward"  # forward(): logprobs only, any inputs but target_tokens ignored


def resolve_loss(loss_fn: str, config: dict[str, float] | None) -> tuple[LossSpec, dict[str, float]]:
    """The loss and its full config (defaults filled in); ValueError naming what is allowed."""
    if loss_fn in REFUSED:
        raise ValueError(f"loss_fn {loss_fn!r}: {REFUSED[loss_fn]}; supported: {sorted(LOSSES)}")
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; supported: {sorted(LOSSES)}")
    config = dict(config or {})
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        allowed = sorted(spec.config) or "none"
        raise ValueError(f"loss_fn_config keys {unknown} are not known to {loss_fn!r}; allowed: {allowed}")
    out = {}
    for key, default in spec.config.items():
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_config[{key!r}] (no default)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out and not 0 <= out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise ValueError(f"need 0 <= clip_low_threshold <= clip_high_threshold (absolute ratio bounds, "
                         f"default 0.8 and 1.2), got {out}")
    return spec, out


def check_inputs(loss_fn: str, spec: LossSpec | None, n: int, inputs: dict[str, torch.Tensor]) -> None:
    """Input names and shapes of one datum of ``n`` input tokens (spec None: forward only)."""
    required = ("target_tokens",) if spec is None else spec.inputs
    missing = [k for k in required if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn_inputs lacks {missing} (loss_fn {loss_fn!r} needs {list(required)})")
    if spec is not None:
        extra = sorted(set(inputs) - set(spec.inputs))
        if extra:
            raise ValueError(f"loss_fn_inputs {extra} are not used by {loss_fn!r}; it takes {list(spec.inputs)}")
    for key, t in inputs.items():
        if tuple(t.shape) != (n,):
            raise ValueError(f"loss_fn_inputs[{key!r}] has shape {tuple(t.shape)}; model_input has {n} tokens, need ({n},)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"loss_fn_inputs[{key!r}] has non-finite values")
    if spec is not None and spec.check is not None:
        spec.check(inputs)
