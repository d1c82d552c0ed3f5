"""Environments and rollout functions for the rollout tests, importable only because the tests list this
module under their rollout import roots.

Environments that run in the test's own process (the rollout worker used without Ray) record what
they saw and appended in `EPISODES`, so a test can rebuild each trajectory from the environment's own
log (independently of the worker's flattening) and compare."""

from __future__ import annotations

import asyncio
import time

from examples.tiny_agent.calculator import Calculator
from rollout.environment import Action, StepResult
from rollout.rewards import target_share
from rollout.trajectory import Generation, Trajectory

EPISODES: list[dict] = []  # one per closed environment: {"actions": [token ids...], "observations": [text...], ...}
STEPS: list[tuple[str, int]] = []  # (environment kind, turn) of every step called, in order


class _Logged:
    """Records each action's tokens and each observation it returns; appends the record on close."""

    kind = "logged"

    def __init__(self, **kwargs):
        self.record = {"kind": self.kind, "actions": [], "observations": [], "rewards": [], "done": False}

    def _log(self, action: Action, result: StepResult) -> StepResult:
        STEPS.append((self.kind, action.turn))
        self.record["actions"].append(list(action.token_ids))
        self.record["rewards"].append(result.reward)
        if result.done:
            self.record["done"] = True
        elif result.observation is not None:
            self.record["observations"].append(result.observation)
        return result

    def close(self) -> None:
        EPISODES.append(self.record)


class ThreeTurns(_Logged):
    """Three model turns: the first two answered by a short system message (environment tokens),
    the third scored by the digit share. Rewards on every turn (0.1, 0.1, share)."""

    kind = "three_turns"

    def __init__(self, note: str = "ok"):
        super().__init__()
        self.note = note

    def reset(self, task) -> None:
        self.label = task.label
        return None

    def step(self, action: Action) -> StepResult:
        if action.turn < 3:
            return self._log(action, StepResult(observation=f"\n<|system|>{self.note} {action.turn}\n<|assistant|>", reward=0.1))
        return self._log(action, StepResult(reward=target_share(action.text, self.label), done=True))


class AsyncThreeTurns(ThreeTurns):
    """ThreeTurns with coroutine methods (awaited on the rollout loop)."""

    kind = "async_three_turns"

    async def reset(self, task) -> None:
        await asyncio.sleep(0)
        return super().reset(task)

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(0)
        return super().step(action)


GATE: asyncio.Event | None = None  # GatedTurns' steps wait on it (a test sets it in its own event loop)


class GatedTurns(ThreeTurns):
    """ThreeTurns whose steps wait for `GATE` (on the rollout loop): a test holds every trajectory between
    turns, with no request in flight, for as long as it wants."""

    kind = "gated"

    async def step(self, action: Action) -> StepResult:
        STEPS.append(("gated", action.turn))
        await GATE.wait()
        return ThreeTurns.step(self, action)


class LoggedCalculator(_Logged, Calculator):
    """The example's calculator (examples/tiny_agent/calculator.py), logging what it saw and answered."""

    kind = "calculator"

    def __init__(self, **kwargs):
        _Logged.__init__(self)
        Calculator.__init__(self, **kwargs)

    def step(self, action: Action) -> StepResult:
        return self._log(action, Calculator.step(self, action))


class Broken:
    """Fails on the model's first turn, every time."""

    def reset(self, task) -> None:
        return None

    def step(self, action: Action) -> StepResult:
        raise RuntimeError("environment crashed (on purpose, for the test)")


class Sleepy:
    """Blocks its thread in every step (a slow tool): past any short time budget."""

    def __init__(self, seconds: float = 30.0):
        self.seconds = seconds

    def reset(self, task) -> None:
        return None

    def step(self, action: Action) -> StepResult:
        STEPS.append(("sleepy", action.turn))
        time.sleep(self.seconds)
        return StepResult(done=True)


class Chatty:
    """Never done: every turn is answered (until max_turns or the token budget ends the trajectory)."""

    def reset(self, task) -> None:
        return None

    def step(self, action: Action) -> StepResult:
        STEPS.append(("chatty", action.turn))
        return StepResult(observation="\n<|user|>go on\n<|assistant|>", reward=1.0)


class WrongStep:
    """A step that returns a tuple (gym style) instead of a StepResult."""

    def reset(self, task) -> None:
        return None

    def step(self, action: Action):
        return None, 1.0, True


async def two_tries(ctx, task, hint: str = "\n<|user|>again\n<|assistant|>"):
    """An async rollout function: a first answer, a hint (environment tokens), a second answer scored."""
    out = []
    hint_ids = ctx.encode(hint)
    for first in await ctx.generate(list(task.input_ids), n=ctx.n):
        t = Trajectory(prompt_ids=list(task.input_ids))
        t.add_turn(first)
        t.add_observation(hint_ids, hint)
        out.append(t)
    seconds = await asyncio.gather(*(ctx.generate(t.tokens) for t in out))
    for t, (second,) in zip(out, seconds):
        t.add_turn(second)
        t.reward = target_share(second.text, task.label)
    return out


async def claims_env_tokens(ctx, task):
    """Labels environment text as the model's own (a forged Generation): must be refused, not trained on."""
    out = []
    for g in await ctx.generate(list(task.input_ids), n=ctx.n):
        t = Trajectory(prompt_ids=list(task.input_ids))
        t.add_turn(g)
        forged = ctx.encode("\n<|system|>123\n")
        t.add_turn(Generation(g.rid, tuple(forged), tuple([-0.1] * len(forged)), "123", "stop", g.version))
        out.append(t)
    return out


def not_a_rollout(ctx, task):
    """A plain function (not async): refused at registration."""
    return []
