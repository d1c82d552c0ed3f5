"""The one loss table: every objective a tenant trains with, for both kinds of tenant.

An entry (``LossSpec``) names its kind (``sft``: supervised rows; ``rl``: sampled rows with the
sampler's log-probabilities and advantages), the per-token inputs it takes, its config keys with
their defaults, and its per-token loss with the statistics it reports. A Tinker call names an
entry by ``loss_fn`` (with ``loss_fn_config``); a dataset run by ``loss: {name, config}``, its
``objective: rl | sft`` naming the two defaults (``ppo`` with the run's clip offsets, and
``cross_entropy``). Both faces evaluate the SAME functions (trainer/losses/rows.py lays a dataset
micro-batch's rows out as these inputs; trainer/step/round_runner.py hands a Tinker datum's).

Every function takes ``lp`` (log p(target token) under the policy being trained, differentiable)
and the inputs as tensors of one shape [..., S] (one Tinker datum: [N]; a dataset micro-batch:
[b, s]), and returns the per-token loss of that shape. Reductions over positions (gspo's
sequence ratio) run over the last dimension. The caller sums (Tinker: a datum's loss is its sum,
a call's the sum over its datums; no mean) or masks and normalizes (dataset runs: rows.py).

Definitions (tinker-docs.thinkingmachines.ai/tinker/losses and its per-loss pages; q = the
``logprobs`` input, the sampler's log-probability; A = ``advantages``; ratio = exp(lp - q)):

* cross_entropy (sft):        -lp * weights; with inputs of shape [N, K] (top-K distillation: K
  target tokens a position, each with its weight), -sum_k w[t, k] * log p(x[t, k]) at position t.
  The round evaluates it as K columns of the same datum (column k: targets x[:, k], weights
  w[:, k]), each a 1-D cross_entropy: the sum over columns IS the definition. Its outputs are
  [N, K] too (``columns`` below; MAX_COLUMNS bounds K, as each column is one more pass).
* importance_sampling (rl):   -ratio * A
* ppo (rl):                   -min(ratio * A, clip(ratio, lo, hi) * A)
* cispo (rl):                 -sg(clip(ratio, lo, hi)) * lp * A
* dro (rl):                   -(lp * A - beta / 2 * (lp - q) ** 2)
* gspo (rl, GSPO-token, Zheng et al. 2025): the sequence ratio s = exp(mean over the positions
  M that ``sequence_ratio_mask`` marks (!= 0) of sg(lp) - q); every token's ratio has s's value
  and its own log-probability's gradient, s_t = s * exp(lp - sg(lp)); loss
  -min(s_t * A, clip(s_t, lo, hi) * A).

The clip is ONE definition (``clip_ratio``, ``clipped_surrogate``): absolute bounds [lo, hi]
(Tinker's ``clip_low_threshold`` / ``clip_high_threshold``, default 0.8 / 1.2). A dataset run's
DAPO-style offsets (``clip_low`` / ``clip_high``: r in [1 - clip_low, 1 + clip_high]) become
these bounds in one place, ``SlotHyperParams.loss_choice`` (trainer/config.py).

Statistics (what a dataset run reports per step, trainer/optim/slot_steps.py): per token, the
importance ratio exp(lp - q) of an rl entry (1 on-policy) and whether the clip was active
(``clipped``: the clipped branch was taken, for ppo and gspo; the weight was clipped, for cispo).

* stable_reinforce (rl): lorafleet's own definition (trainer/losses/stable_reinforce.py; Tinker has
  not published its formula): -min(ratio, C) * A * lp on the sampled tokens, a sequence dropped whole
  when its geometric-mean ratio leaves [L, H], plus kl_coeff / 2 * (lp - q) ** 2; q is the log-prob
  the server RECORDED at sampling time (the Tinker face replaces the client's ``logprobs`` with it).

Server-side ``custom`` losses are not entries: a Tinker call names one by its ``loss_id``
(create_custom_loss) and the round runs it (trainer/step/custom_calls.py); a dataset run cannot
name one (``REFUSED``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from trainer.losses import stable_reinforce

LossKind = Literal["sft", "rl"]

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


# -- the entries ------------------------------------------------------------------------------------

Inputs = dict[str, torch.Tensor]
Config = dict[str, float]


@dataclass(frozen=True)
class TokenLoss:
    """A loss's answer for some positions: the per-token loss and where its clip was active."""

    loss: torch.Tensor
    clipped: torch.Tensor | None = None  # bool, detached; None: the loss has no clip


@dataclass(frozen=True)
class LossSpec:
    """One entry: its kind, the inputs it takes (all required; a Tinker call sending any other is
    refused), its config keys with their defaults (None: no default, the key must be given), the
    per-token loss, and an optional check of one datum's inputs beyond names and shapes."""

    kind: LossKind
    inputs: tuple[str, ...]
    config: dict[str, float | None]
    fn: Callable[[torch.Tensor, Inputs, Config], TokenLoss]
    check: Callable[[Inputs], None] | None = None
    check_config: Callable[[Config], None] | None = None  # the resolved config's ranges (ValueError)
    columns: bool = False  # its inputs may be [n, K]: K targets a position, the loss summed over them (module doc)


def _ratio(lp: torch.Tensor, inp: Inputs) -> torch.Tensor:
    return torch.exp(lp - inp["logprobs"])


def _cross_entropy(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    return TokenLoss(-lp * inp["weights"])


def _importance_sampling(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    return TokenLoss(-_ratio(lp, inp) * inp["advantages"])


def _ppo(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    return TokenLoss(*clipped_surrogate(_ratio(lp, inp), inp["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"]))


def _cispo(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    ratio = _ratio(lp, inp).detach()
    weight = clip_ratio(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    clipped = (ratio < cfg["clip_low_threshold"]) | (ratio > cfg["clip_high_threshold"])
    return TokenLoss(-(weight * lp * inp["advantages"]), clipped)


def _dro(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    return TokenLoss(-(lp * inp["advantages"] - 0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2))


def _gspo(lp: torch.Tensor, inp: Inputs, cfg: Config) -> TokenLoss:
    marked = (inp["sequence_ratio_mask"] != 0).to(lp.dtype)
    log_ratio = torch.where(marked > 0, lp.detach() - inp["logprobs"], torch.zeros_like(lp))
    sequence_log_ratio = log_ratio.sum(-1, keepdim=True) / marked.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(sequence_log_ratio + lp - lp.detach())  # s's value, each token's own gradient
    return TokenLoss(*clipped_surrogate(ratio, inp["advantages"], cfg["clip_low_threshold"], cfg["clip_high_threshold"]))


def _check_gspo(inp: Inputs) -> None:
    if not bool((inp["sequence_ratio_mask"] != 0).any()):
        raise ValueError("loss_fn_inputs['sequence_ratio_mask'] marks no position (the sequence ratio is a mean "
                         "over the marked ones): mark the sampled tokens with 1")


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("sft", ("target_tokens", "weights"), {}, _cross_entropy, columns=True),
    "importance_sampling": LossSpec("rl", _RL_INPUTS, {}, _importance_sampling),
    "ppo": LossSpec("rl", _RL_INPUTS, dict(_CLIP), _ppo),
    "cispo": LossSpec("rl", _RL_INPUTS, dict(_CLIP), _cispo),
    "dro": LossSpec("rl", _RL_INPUTS, {"beta": None}, _dro),
    "gspo": LossSpec("rl", (*_RL_INPUTS, "sequence_ratio_mask"), dict(_CLIP), _gspo, _check_gspo),
    "stable_reinforce": LossSpec("rl", stable_reinforce.INPUTS, dict(stable_reinforce.DEFAULTS),
                                 lambda lp, inp, cfg: TokenLoss(*stable_reinforce.token_loss(lp, inp, cfg)),
                                 stable_reinforce.check_inputs, stable_reinforce.check_config),
}
REFUSED = {
    "custom": "a custom loss is created with the Tinker API's create_custom_loss and named by its loss_id in a "
              "Tinker forward_backward; a dataset run cannot name one",
}
# What each objective of a dataset run trains with when its config names no loss.
DEFAULT_LOSS: dict[LossKind, str] = {"rl": "ppo", "sft": "cross_entropy"}


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
    if "beta" in out and out["beta"] < 0:
        raise ValueError(f"loss_fn_config['beta'] must be >= 0 (the weight of dro's quadratic penalty), got {out['beta']}")
    if spec.check_config is not None:
        spec.check_config(out)
    return spec, out


# The most target columns a datum of a ``columns`` loss may have (lorafleet's own bound: each column
# is one more pass over the datum's tokens; the cookbook's top-K distillation uses K = 20).
MAX_COLUMNS = 64


def datum_columns(inputs: Inputs) -> int | None:
    """K for a datum whose inputs are [n, K] (checked by check_inputs), None for [n]."""
    t = inputs.get("target_tokens")
    return int(t.shape[1]) if t is not None and t.dim() == 2 else None


def column_inputs(inputs: Inputs, column: int | None) -> Inputs:
    """Column ``column`` of a datum's [n, K] inputs (each [n]); the inputs themselves for None."""
    return inputs if column is None else {name: t[:, column] for name, t in inputs.items()}


def check_inputs(loss_fn: str, spec: LossSpec | None, n: int, inputs: Inputs) -> None:
    """Input names and shapes of one datum of ``n`` input tokens (spec None: forward only)."""
    required = ("target_tokens",) if spec is None else spec.inputs
    missing = [k for k in required if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn_inputs lacks {missing} (loss_fn {loss_fn!r} needs {list(required)})")
    if spec is not None:
        extra = sorted(set(inputs) - set(spec.inputs))
        if extra:
            raise ValueError(f"loss_fn_inputs {extra} are not used by {loss_fn!r}; it takes {list(spec.inputs)}")
    columns = spec is not None and spec.columns
    for key, t in inputs.items():
        shape = tuple(t.shape)
        if shape != (n,) and not (columns and len(shape) == 2 and shape[0] == n and 1 <= shape[1] <= MAX_COLUMNS):
            need = f"({n},) or ({n}, K) with 1 <= K <= {MAX_COLUMNS} (top-K targets)" if columns else f"({n},)"
            raise ValueError(f"loss_fn_inputs[{key!r}] has shape {shape}; model_input has {n} tokens, need {need}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"loss_fn_inputs[{key!r}] has non-finite values")
    shapes = {k: tuple(t.shape) for k, t in inputs.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"loss_fn_inputs have different shapes {shapes}; they must all be ({n},) or all the same ({n}, K)")
    if spec is not None and spec.check is not None:
        spec.check(inputs)
