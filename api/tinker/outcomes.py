"""How an operation's result becomes the SDK's future result, one home for the routes and for the
operations a restart runs again (api/tinker/service.py `revive`): by the operation's kind.

Bad input (ValueError) and what a tenant can cause (service.errors: a quota, a conflict) are the
caller's ``user`` error; anything else a ``server`` error naming it.
"""

from __future__ import annotations

from typing import Any, Callable

from api.tinker import wire
from api.tinker.futures import Outcome, server_error, user_error
from api.tinker.proto_io import encode_forward_backward_output
from service.errors import LorafleetError
from service.tenants.tinker_lora import LoraSpec
from trainer.rounds import CallResult


def outcome_of(value: Any, error: BaseException | None, ok: Callable[[Any], Outcome]) -> Outcome:
    if error is None:
        return ok(value)
    if isinstance(error, (ValueError, LorafleetError)):
        return user_error(str(error))
    return server_error(f"{type(error).__name__}: {error}")


def fb_outcome(result: CallResult) -> Outcome:
    """A forward(_backward) call's result: the SDK's ForwardBackwardOutput, or its refusal."""
    if result.error is not None:
        return user_error(result.error)
    return Outcome(proto=encode_forward_backward_output(result))


def optim_outcome(metrics: dict) -> Outcome:
    return Outcome(json={"type": "optim_step", "metrics": {f"{k}:last": v for k, v in metrics.items()}})


def answer_outcome(answer: dict | None) -> Callable[[Any], Outcome]:
    """An operation answered by a fixed JSON body (creation, saves, loads, unload), extra fields added."""
    def ok(extra: Any) -> Outcome:
        return Outcome(json={**(answer or {}), **(extra if isinstance(extra, dict) else {})})
    return ok


def ok_for(request: dict) -> Callable[[Any], Outcome]:
    """The outcome of an operation rebuilt from its recorded request (service/tenants/tinker_ops.py)."""
    kind = request.get("kind")
    if kind in ("forward_backward", "forward"):
        return fb_outcome
    if kind == "optim_step":
        return optim_outcome
    return answer_outcome(request.get("answer"))


def lora_spec(lc: wire.LoraConfigIn, seed: int) -> LoraSpec:
    """The model's LoRA: rank, seed, and what it trains (the SDK's train_attn, train_mlp, train_unembed)."""
    targets = tuple(g for flag, g in ((lc.train_attn, "attention"), (lc.train_mlp, "mlp"), (lc.train_unembed, "unembed")) if flag)
    return LoraSpec(lc.rank, seed, targets)


def lora_flags(lora: LoraSpec) -> dict[str, bool]:
    """The SDK's view of what a model (or checkpoint) trains: weights_info's fields."""
    return {"train_unembed": "unembed" in lora.targets, "train_mlp": "mlp" in lora.targets,
            "train_attn": "attention" in lora.targets}
