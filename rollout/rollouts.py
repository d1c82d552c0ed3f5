"""The rollout interface: what makes the n trajectories of one prompt, named per adapter.

A rollout is ``async fn(ctx, task) -> list[Trajectory]`` (ctx: rollout/context.py, an engine
client bound to the adapter's newest weights; task: the data row; the trajectories:
rollout/trajectory.py). An adapter names its rollout in its config (`RolloutSpec`):

* ``single_turn`` (built in; also what an adapter without a ``rollout`` gets): one
  generation per sample, scored by the adapter's reward. GRPO as lorafleet always did it.
* an environment class with reset/step (rollout/environment.py), run by `run_environment`;
* an async rollout function ``fn(ctx, task, **kwargs)`` that drives the engines itself.

Custom ones are imported only from under the configured rollout import roots
(rollout/tenant_code.py); `load_rollout` is the one resolution, called at registration
(service/control/config_checks.py) and by the rollout worker, so both accept exactly the same names.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from rollout.config import RolloutSpec
from rollout.context import RolloutContext
from rollout.data import PromptRow
from rollout.environment import is_environment_class, run_environment
from rollout.tenant_code import TenantCodeError, import_confined, is_import_path, split_import_path
from rollout.trajectory import Trajectory

RolloutFn = Callable[[RolloutContext, PromptRow], Awaitable[list[Trajectory]]]


async def single_turn(ctx: RolloutContext, task: PromptRow) -> list[Trajectory]:
    """GRPO's rollout: n completions of the prompt on one engine, each scored by the adapter's reward
    (a failing reward gives 0 with the error recorded: rollout/rewards.py)."""
    gens = await ctx.generate(list(task.input_ids), n=ctx.n)
    outcomes = await asyncio.gather(*(ctx.score(g.text, task) for g in gens))
    out = []
    for g, o in zip(gens, outcomes):
        t = Trajectory(prompt_ids=list(task.input_ids), reward=o.value, reward_error=o.error)
        t.add_turn(g)
        out.append(t)
    return out


BUILTIN_ROLLOUTS: dict[str, RolloutFn] = {"single_turn": single_turn}
SINGLE_TURN = "single_turn"


class RolloutLoadError(TenantCodeError):
    """The rollout config names something that cannot be used; the message says what is allowed, and
    `field` which part of the config is wrong ("name" or "kwargs")."""

    def __init__(self, message: str, field: str = "name"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class LoadedRollout:
    name: str
    run: RolloutFn
    custom: bool  # tenant code: what it raises drops the group (rollout/worker.py); a built-in's errors are the worker's
    kind: str  # "builtin" | "environment" | "function"


WHAT = "environment class (with reset and step) or async rollout function"


def load_rollout(spec: RolloutSpec | None, import_roots: list[str] | tuple[str, ...] = ()) -> LoadedRollout:
    """The rollout `spec` names (None: the built-in single_turn), with its kwargs bound; RolloutLoadError
    saying what is allowed when it names nothing usable, or when its kwargs do not fit its signature."""
    if spec is None:
        return LoadedRollout(SINGLE_TURN, single_turn, custom=False, kind="builtin")
    if spec.name in BUILTIN_ROLLOUTS:
        if spec.kwargs:
            raise RolloutLoadError(f"the built-in rollout {spec.name!r} takes no kwargs (got {sorted(spec.kwargs)})", "kwargs")
        return LoadedRollout(spec.name, BUILTIN_ROLLOUTS[spec.name], custom=False, kind="builtin")
    if not is_import_path(spec.name):
        raise RolloutLoadError(f"unknown built-in rollout {spec.name!r}; built-ins: {sorted(BUILTIN_ROLLOUTS)}, or a custom "
                               f"'package.module:EnvClass' / 'package.module:rollout_fn' under an allowed rollout import root")
    try:
        obj = import_confined(spec.name, import_roots, "rollout", WHAT)
    except TenantCodeError as e:
        raise RolloutLoadError(str(e)) from None
    module, attr = split_import_path(spec.name, "rollout")
    if is_environment_class(obj):
        _check_binds(obj, (), spec.kwargs, f"environment {attr!r}")
        return LoadedRollout(spec.name, partial(run_environment, env_class=obj, kwargs=dict(spec.kwargs)), custom=True,
                             kind="environment")
    if inspect.iscoroutinefunction(obj):
        _check_binds(obj, ("ctx", "task"), spec.kwargs, f"rollout function {attr!r}")
        return LoadedRollout(spec.name, partial(_call_rollout_fn, obj, dict(spec.kwargs)), custom=True, kind="function")
    raise RolloutLoadError(f"{attr!r} in rollout module {module!r} is neither an environment class (a class with reset and "
                           f"step methods) nor an async rollout function (async def {attr}(ctx, task, ...)); it is "
                           f"{type(obj).__name__}")


async def _call_rollout_fn(fn: Callable[..., Awaitable[Any]], kwargs: dict[str, Any], ctx: RolloutContext,
                           task: PromptRow) -> Any:
    return await fn(ctx, task, **kwargs)


def _check_binds(fn: Any, positional: tuple[str, ...], kwargs: dict[str, Any], what: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a C type): the call itself will tell
        return
    try:
        sig.bind(*positional, **kwargs)
    except TypeError as e:
        raise RolloutLoadError(f"the kwargs do not fit the {what}{sig}: {e}", "kwargs") from None
