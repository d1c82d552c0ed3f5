"""Environments: multi-turn rollouts written as reset/step (docs/environments.md shows one).

An environment is a class named by import path in the adapter's config
(``rollout: {name: "myorg.envs.calc:Calculator", kwargs: {...}}``). The worker makes one
instance per trajectory, ``EnvClass(**kwargs)``, and drives it:

    observation = env.reset(task)          # task: the data row (rollout/data.py PromptRow)
    loop:  the model generates a turn from the context
           result = env.step(Action(...))  # -> StepResult(observation, reward, done)
           the observation's tokens are appended (environment tokens: never learned)
    until result.done, max_turns model turns, or the token budget is used up (truncated)

* ``reset`` returns the first observation: None for the data row's prompt as the data
  source rendered it (chat template applied), a string (tokenized as is: write the chat
  markers yourself) or token ids. All n trajectories of a group must start from the same one.
* ``step`` gets the turn as text and token ids and returns a `StepResult`: the next
  observation (None, a string or token ids), a reward for this turn (any turn may have one;
  the trajectory's reward is their sum) and whether the episode is over.
* ``close()``, when the class has it, is called once the trajectory ends (errors ignored).
* Methods may be plain functions (run in the adapter's own threads: they may block) or
  coroutine functions (awaited on the rollout loop: they must not block it).

A method that raises, a step that returns something other than a StepResult, or a reward that
is not a finite number drops the whole group (counted, never trained on: rollout/worker.py).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

from rollout.context import RolloutContext, TokenBudgetExhausted
from rollout.data import PromptRow
from rollout.trajectory import Generation, Trajectory

log = logging.getLogger(__name__)

Observation = str | list[int] | None


@dataclass(frozen=True)
class Action:
    """The model's turn, as the environment sees it."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (the turn's max_new_tokens)
    turn: int  # 1 for the first turn


@dataclass(frozen=True)
class StepResult:
    observation: Observation = None  # appended before the next turn (ignored when done)
    reward: float = 0.0
    done: bool = False


class EnvironmentContractError(RuntimeError):
    """An environment broke its contract; the message says how."""


def is_environment_class(obj: Any) -> bool:
    return inspect.isclass(obj) and callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))


def observation_ids(ctx: RolloutContext, obs: Any, where: str) -> list[int]:
    if obs is None:
        return []
    if isinstance(obs, str):
        return ctx.encode(obs)
    if isinstance(obs, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs):
        return list(obs)
    raise EnvironmentContractError(f"{where} must return None, a string or a list of token ids, got {type(obs).__name__}")


async def run_environment(ctx: RolloutContext, task: PromptRow, *, env_class: type, kwargs: dict[str, Any]) -> list[Trajectory]:
    """The n trajectories of one prompt, one environment instance each (see the module doc)."""
    envs = [await ctx.call(env_class, **kwargs) for _ in range(ctx.n)]
    try:
        starts = [observation_ids(ctx, await ctx.call(env.reset, task), "reset") for env in envs]
        prompts = {tuple(s) for s in starts}
        if len(prompts) != 1:
            raise EnvironmentContractError("reset returned different observations for one task; a group's trajectories must start alike")
        prompt = starts[0] or list(task.input_ids)
        trajectories = [Trajectory(prompt_ids=list(prompt)) for _ in envs]
        first = await ctx.generate(prompt, n=ctx.n)  # one request per trajectory, on one engine
        await _all_or_none([_episode(ctx, env, traj, gen) for env, traj, gen in zip(envs, trajectories, first)])
        return trajectories
    finally:
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await ctx.call(close)
                except Exception as e:  # noqa: BLE001 - a failing close must not lose the trajectories
                    log.info("environment close failed: %s: %s", type(e).__name__, e)


async def _all_or_none(coros: list) -> None:
    """Run the episodes concurrently; the first to fail cancels the others (their requests in flight
    are aborted on the engine: EnginePool.generate_group) and its exception is raised as it is."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _episode(ctx: RolloutContext, env: Any, traj: Trajectory, gen: Generation) -> None:
    while True:
        traj.add_turn(gen)
        result = await ctx.call(env.step, Action(gen.text, gen.token_ids, gen.finish_reason, traj.turns))
        if not isinstance(result, StepResult):
            raise EnvironmentContractError(f"step must return rollout.environment.StepResult, got {type(result).__name__}")
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
            raise EnvironmentContractError(f"step returned reward {result.reward!r}; rewards must be finite numbers")
        traj.reward += float(result.reward)
        if result.done:
            return
        if traj.turns >= ctx.max_turns:
            traj.truncated = True
            return
        obs = observation_ids(ctx, result.observation, "step")
        if ctx.max_tokens is not None and len(traj.tokens) + len(obs) >= ctx.max_tokens:
            traj.truncated = True  # no room for the observation and one more generated token
            return
        traj.add_observation(obs, result.observation if isinstance(result.observation, str) else ctx.decode(obs))
        try:
            gen = (await ctx.generate(traj.tokens, n=1))[0]
        except TokenBudgetExhausted:
            traj.truncated = True
            return
