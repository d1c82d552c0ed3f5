"""The Tinker API's built-in losses, written from their published definitions.

Every loss works on ONE datum: ``target_logprobs`` [N] (log p(target_tokens[i]) at
input position i, under the model's LoRA, differentiable) and the datum's
``loss_fn_inputs`` ([N] tensors). It returns the per-token loss [N]; the datum's
loss is its SUM, and the gradient a forward_backward accumulates is the gradient
of the sum over the call's datums (Tinker's losses are sums: no mean over tokens
or datums anywhere; a client that wants a mean scales its weights/advantages).

Definitions (tinker-docs.thinkingmachines.ai/tinker/losses; ratio = exp(lp - q),
q = the sampler's logprobs ``logprobs`` input, A = ``advantages``):

* cross_entropy:        -lp * weights
* importance_sampling:  -ratio * A
* ppo:                  -min(ratio * A, clip(ratio, lo, hi) * A)
* cispo:                -sg(clip(ratio, lo, hi)) * lp * A
* dro:                  -(lp * A - beta / 2 * (lp - q) ** 2)

``lo``/``hi`` are ratio thresholds (config ``clip_low_threshold`` /
``clip_high_threshold``, defaults 0.8 / 1.2, Tinker's fixed 0.2 clip); ``beta`` has
no documented default and must be given. ``gspo``, ``stable_reinforce`` and
``custom`` (server-side custom losses) are refused with a message naming what is
supported. Positions are never masked here: a token is excluded by a zero weight
(cross_entropy) or a zero advantage (the RL losses), as in Tinker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

# name -> (required inputs, optional inputs, config keys with defaults; None = required)
@dataclass(frozen=True)
class LossSpec:
    inputs: tuple[str, ...]
    config: dict[str, float | None]
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


def _ratio(lp: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inp["logprobs"])


def _cross_entropy(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -lp * inp["weights"]


def _importance_sampling(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -_ratio(lp, inp) * inp["advantages"]


def _ppo(lp, inp, cfg):  # noqa: ANN001, ANN202
    ratio, adv = _ratio(lp, inp), inp["advantages"]
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(lp, inp, cfg):  # noqa: ANN001, ANN202
    clipped = torch.clamp(_ratio(lp, inp), cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(clipped * lp * inp["advantages"])


def _dro(lp, inp, cfg):  # noqa: ANN001, ANN202
    return -(lp * inp["advantages"] - 0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}, _cross_entropy),
    "importance_sampling": LossSpec(("target_tokens", "logprobs", "advantages"), {}, _importance_sampling),
    "ppo": LossSpec(("target_tokens", "logprobs", "advantages"), dict(_CLIP), _ppo),
    "cispo": LossSpec(("target_tokens", "logprobs", "advantages"), dict(_CLIP), _cispo),
    "dro": LossSpec(("target_tokens", "logprobs", "advantages"), {"beta": None}, _dro),
}
REFUSED = {
    "gspo": "sequence-level GSPO is not implemented here",
    "stable_reinforce": "stable_reinforce is not implemented here",
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
        raise ValueError(f"need 0 <= clip_low_threshold <= clip_high_threshold, got {out}")
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
