"""One round of the scheduler: every tenant's ready work in ONE trainer call.

``MultiLoraTrainer.run_round(work)`` (executed by trainer/step/round_runner.py ``RoundRunner.run_round``)
is the trainer's interface to the service's scheduler (service/scheduling/scheduler.py): the actor exposes
it (trainer/actor.py ``TrainWorker.run_round``), the trainer group forwards it
(service/fleet/trainer_group.py), and an in-process trainer is called directly. A round carries:

* ``batch``: the dataset-driven runs' samples (RL and SFT steps), stepped per slot as
  ``MultiLoraTrainer.train`` steps them;
* ``calls``: Tinker forward_backward calls of other slots, in the SAME packed micro-batches
  (one mixed forward/backward over both kinds; their gradients accumulate, nothing steps:
  trainer/step/round_runner.py ``train_with``);
* ``forwards``: Tinker forward calls (outputs and losses, no gradient);
* ``optim``: Tinker optimizer steps, applied after the pass, in order.

Order inside a round (what keeps each tenant's own operations in order): forwards, then the
mixed pass, then the optimizer steps. The scheduler puts at most one optimizer step of a
model in a round, after that model's forward and forward_backward calls (a model's calls
before its step see the weights before it), so a model's operations run as it sent them.

This module holds the round's types too (a Tinker call, its result, an optimizer step), light to
import (no Megatron), so the coordinator builds rounds without loading the trainer's code.

Failure isolation: a call with bad input, or aimed at a slot the batch trains, gets its
error and changes nothing; a batch the trainer refuses is answered by ``refused`` (its
ValueError's message) while the calls run alone; an optimizer step that fails (a non-finite
gradient, bad parameters) answers its own error. Nothing in one tenant's work changes
another's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.batch import RiderSequence, TrainBatch  # noqa: F401 - a rider is a round's Tinker datum in the pass


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
    # loss_fn "custom": the tenant's server-side custom loss as plain data ({name, inputs, graph}, what
    # create_custom_loss received: trainer/losses/custom_graph.py), rebuilt and run in the round
    custom_loss: dict | None = None


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
class RoundWork:
    batch: TrainBatch | None = None
    calls: list[Call] = field(default_factory=list)
    forwards: list[Call] = field(default_factory=list)
    optim: list[tuple[int, AdamStep]] = field(default_factory=list)  # (slot, step) in order
    max_seq_len: int = 4096  # the longest Tinker datum the service allows

    @property
    def empty(self) -> bool:
        return (self.batch is None or not self.batch.samples) and not (self.calls or self.forwards or self.optim)


@dataclass
class RoundResult:
    train: Any = None  # trainer.core.TrainResult of the batch (None: no batch, or refused)
    refused: str | None = None  # the batch was refused before anything ran (the calls ran alone)
    calls: list[CallResult] = field(default_factory=list)  # one per forward_backward call, in order
    forwards: list[CallResult] = field(default_factory=list)  # one per forward call, in order
    optim: list[dict[str, float] | str] = field(default_factory=list)  # per step: metrics, or its error
