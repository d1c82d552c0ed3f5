"""A Tinker model's operations: `TinkerOp` (one queued call), and its *request*: the record that
rebuilds it after a restart (service/registry/tinker_records.py keeps it; a replay runs it again).

A request is plain JSON: its kind and the call's arguments (datums with their loss inputs, a loss
and its config, AdamW parameters, a store reference and options), plus ``answer``: what the Tinker
face needs to answer it again (its JSON answer's fixed fields). Tensors are written as their dtype
and values (Python floats are exact for float32 and float64), so a replayed call computes exactly
what the original did.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable

import torch

from trainer.rounds import AdamStep, Datum

Done = Callable[[Any, BaseException | None], None]  # (value, error)


class OpKind(StrEnum):
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM = "optim_step"
    ALONE = "alone"  # runs alone, after a round's trainer call (save, load, unload, a snapshot)


def _no_answer(value: Any, error: BaseException | None) -> None:
    """A replayed operation's done: its answer was given before the restart and stands."""


@dataclass
class TinkerOp:
    kind: OpKind
    done: Done
    data: list[Datum] | None = None  # FORWARD_BACKWARD / FORWARD
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    custom_loss: dict | None = None  # loss_fn "custom": the tenant's loss as plain data (trainer/rounds.py Call)
    adam: AdamStep | None = None  # OPTIM
    run: Callable[[int | None], Any] | None = None  # ALONE: given the model's slot (None: evicted)
    needs_slot: bool = True
    cancelled: Callable[[], bool] = lambda: False
    queued_at: float = field(default_factory=time.time)
    seq: int = 0  # its place in the model's order (set when queued)
    request_id: str | None = None  # its future (None: an internal operation, e.g. a snapshot)
    request: Callable[[], dict | None] = lambda: None  # its request, built when it must be recorded
    replay: bool = False  # answered before a restore: run for its effect only

    @property
    def name(self) -> str:
        """What it does, as its recorded request says (``forward_backward``, ``optim_step``,
        ``save_state``, ...); an ALONE operation's request is small, so building it is cheap."""
        if self.kind != OpKind.ALONE:
            return self.kind.value
        return (self.request() or {}).get("kind", OpKind.ALONE.value)


# The operations whose effect is in the model's state (weights, gradient, moments, step): one of them
# answered after the last snapshot and not replayable means the model lost work (a restore diverged).
# The others (forward, saves, unload) leave the state as it was: losing them loses nothing.
CHANGES_STATE = frozenset({"create", OpKind.FORWARD_BACKWARD.value, OpKind.OPTIM.value, "load_state"})


# -- requests: encode ----------------------------------------------------------------------------


def _tensor(t: torch.Tensor) -> list:
    return [str(t.dtype).removeprefix("torch."), t.tolist()]


def data_request(kind: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, custom_loss: dict | None = None) -> dict:
    return {"kind": kind, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config, "custom_loss": custom_loss,
            "data": [{"tokens": list(d.tokens), "inputs": {k: _tensor(v) for k, v in d.inputs.items()}} for d in data]}


def optim_request(adam: AdamStep) -> dict:
    return {"kind": OpKind.OPTIM.value, "adam": dataclasses.asdict(adam)}


# -- requests: decode ----------------------------------------------------------------------------


# The dtypes a loss input may have on the wire (api/tinker/proto_io.py reads these).
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "float16": torch.float16, "bfloat16": torch.bfloat16}


def decode_data(request: dict) -> list[Datum]:
    return [Datum(tokens=[int(t) for t in d["tokens"]],
                  inputs={k: torch.tensor(values, dtype=_DTYPES[dtype]) for k, (dtype, values) in d["inputs"].items()})
            for d in request["data"]]


def decode_adam(request: dict) -> AdamStep:
    return AdamStep(**request["adam"])
