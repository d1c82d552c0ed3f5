"""Trainer primitives of the Tinker API: mixed forward(_backward) over several slots, and a
per-call AdamW step of one slot.

* ``forward_backward(calls)``: the calls (each one model's data, loss and config) of
  SEVERAL slots in one mixed pass (packed micro-batches, each slot one contiguous
  segment); every call's loss is the SUM of its datums' per-token losses
  (trainer/tinker_losses.py) and its gradient ACCUMULATES in its slot's gradient rows.
  Nothing steps. The base is frozen and sequences never interact, so a slot's gradient
  is exactly what its calls would give alone.
* ``forward(calls)``: the same outputs and losses, no gradient.
* ``optim_step(slot, adam)``: the slot's accumulated gradient as is (Tinker scales by
  nothing: losses are sums), clipped to ``grad_clip_norm`` (0 = off) and applied with
  the call's AdamW parameters; then zeroed.

Validation runs before anything changes: a call with bad input gets an error and
changes nothing; the other calls of the same mixed pass run as if it were absent.
Only dp == 1 for now (TP is fine: every rank runs the same calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trainer.core import MultiLoraTrainer
from trainer.packing import split_by_token_budget
from trainer.tinker_losses import LossSpec, check_inputs, resolve_loss


@dataclass
class Datum:
    tokens: list[int]  # model_input (position i predicts target_tokens[i])
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs, each [len(tokens)]; target_tokens int64


@dataclass
class Call:
    slot: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


@dataclass
class CallResult:
    outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per datum: logprobs [, elementwise_loss]
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # the call was refused (bad input); it changed nothing


@dataclass(frozen=True)
class AdamStep:
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping

    def check(self) -> None:
        vals = dict(learning_rate=self.learning_rate, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=self.weight_decay, grad_clip_norm=self.grad_clip_norm)
        bad = [k for k, v in vals.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"adam_params {bad} must be finite")
        if self.learning_rate < 0 or self.weight_decay < 0 or self.grad_clip_norm < 0 or self.eps <= 0:
            raise ValueError("adam_params need learning_rate >= 0, weight_decay >= 0, grad_clip_norm >= 0, eps > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"adam_params betas must be in [0, 1), got {self.beta1}, {self.beta2}")


@dataclass
class _Planned:
    call: int
    datum: int
    slot: int
    tokens: list[int]
    targets: list[int]


class TinkerOps:
    def __init__(self, trainer: MultiLoraTrainer, *, max_seq_len: int = 4096):
        self.trainer = trainer
        self.max_seq_len = max_seq_len

    # -- validation -----------------------------------------------------------------------

    def _validate(self, call: Call) -> tuple[LossSpec, dict[str, float]]:
        self.trainer._state(call.slot)  # noqa: SLF001 - "slot N is not initialized" for a gone model
        spec, cfg = resolve_loss(call.loss_fn, call.loss_fn_config)
        if not call.data:
            raise ValueError("data is empty: send at least one datum")
        vocab = self.trainer.vocab_size
        for i, d in enumerate(call.data):
            n = len(d.tokens)
            try:
                if n == 0:
                    raise ValueError("model_input has no tokens")
                if n > self.max_seq_len:
                    raise ValueError(f"model_input has {n} tokens, more than this server allows ({self.max_seq_len})")
                if min(d.tokens) < 0 or max(d.tokens) >= vocab:
                    raise ValueError(f"model_input token ids must be in [0, {vocab}), got {min(d.tokens)}..{max(d.tokens)}")
                check_inputs(call.loss_fn, spec, n, d.inputs)
                tt = d.inputs["target_tokens"]
                if tt.is_floating_point():
                    raise ValueError("loss_fn_inputs['target_tokens'] must be integers (int64)")
                if int(tt.min()) < 0 or int(tt.max()) >= vocab:
                    raise ValueError(f"target_tokens must be in [0, {vocab}), got {int(tt.min())}..{int(tt.max())}")
            except ValueError as err:
                raise ValueError(f"datum {i}: {err}") from None
        return spec, cfg

    # -- the mixed pass ---------------------------------------------------------------------

    def forward_backward(self, calls: list[Call]) -> list[CallResult]:
        return self._run(calls, backward=True)

    def forward(self, calls: list[Call]) -> list[CallResult]:
        return self._run(calls, backward=False)

    def _run(self, calls: list[Call], backward: bool) -> list[CallResult]:
        results = [CallResult() for _ in calls]
        losses: dict[int, tuple[LossSpec, dict[str, float]]] = {}
        for c, call in enumerate(calls):
            try:
                losses[c] = self._validate(call)
            except ValueError as err:
                results[c].error = str(err)
        planned = [
            _Planned(c, i, calls[c].slot, d.tokens, d.inputs["target_tokens"].tolist())
            for c in losses for i, d in enumerate(calls[c].data)
        ]
        outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        loss_sum = dict.fromkeys(losses, 0.0)
        budget = self.trainer.config.micro_batch_tokens
        for group in split_by_token_budget([len(p.tokens) for p in planned], [p.slot for p in planned], budget):
            mb = [planned[i] for i in group]  # slot order (stable): each slot one contiguous segment

            def loss_of(lp: torch.Tensor, mb: list[_Planned] = mb) -> torch.Tensor:
                total, start = lp.new_zeros(()), 0
                for p in mb:
                    n = len(p.tokens)
                    seg = lp[start : start + n]
                    start += n
                    spec, cfg = losses[p.call]
                    inputs = {k: v.to(lp.device) for k, v in calls[p.call].data[p.datum].inputs.items()}
                    elementwise = spec.fn(seg, inputs, cfg)
                    total = total + elementwise.sum()
                    out = {"logprobs": seg.detach().float().cpu()}
                    if calls[p.call].loss_fn == "cross_entropy":
                        out["elementwise_loss"] = elementwise.detach().float().cpu()
                    outputs[(p.call, p.datum)] = out
                    loss_sum[p.call] += float(elementwise.detach().sum())
                return total

            if backward:
                self.trainer.packed_lora_pass([p.tokens for p in mb], [p.slot for p in mb], [p.targets for p in mb], loss_of)
            else:
                lp = self.trainer.packed_lora_pass([p.tokens for p in mb], [p.slot for p in mb], [p.targets for p in mb])
                with torch.no_grad():
                    loss_of(lp)
        for c in losses:
            results[c].outputs = [outputs[(c, i)] for i in range(len(calls[c].data))]
            results[c].metrics = {"loss:sum": loss_sum[c]}
        return results

    # -- optimizer ----------------------------------------------------------------------------

    def optim_step(self, slot: int, adam: AdamStep) -> dict[str, float]:
        adam.check()
        report = self.trainer.adam_step_slot(
            slot, lr=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
            weight_decay=adam.weight_decay, max_grad_norm=adam.grad_clip_norm or None,
        )
        if report["skipped_nonfinite"]:
            raise ValueError(f"the accumulated gradient is not finite (norm {report['grad_norm']}); "
                             "it was discarded and the weights are unchanged")
        return {"grad_norm": report["grad_norm"], "step": float(report["step"])}
