"""The context a rollout runs in: an engine client bound to one adapter's newest weights.

The rollout worker makes one `RolloutContext` per group (the n trajectories of one prompt)
and hands it to the adapter's rollout (rollout/rollouts.py). Everything the rollout sends
to the engines goes through `generate`, which is what makes a tenant's agent safe to run
beside the others:

* **Weights and request ids.** Each call goes through the engine pool
  (rollout/engines/pool.py `generate_group`): the adapter's newest published version at the time of
  the call, a fresh request id ``<adapter>::<uuid>`` per request, tracked while in flight. So
  retiring or aborting the run (`EnginePool.abort_adapter`) reaches every turn of every agent.
* **Abort between turns.** An abort also raises `RolloutAborted` at the next `generate` of a
  group that started before it (a turn the abort did not catch in flight, because the
  environment was stepping, never starts).
* **Budgets.** At most n requests of the group in flight at once (the n the worker reserved
  for it: rollout/worker.py `_can_start`); each request's max_new_tokens is cut so that the
  context plus the generation stays within the trajectory's token budget
  (RolloutSpec.max_tokens); with no room left `TokenBudgetExhausted` is raised. The time
  budget is the worker's (`asyncio.timeout` around the whole group).
* **Sync tenant code off the loop.** `call` runs a plain function in the adapter's own thread
  pool (one tenant's slow environment cannot hold the worker's event loop or another
  tenant's threads) and awaits a coroutine function on the loop.
* **Records.** Every generation is recorded by request id; `check` refuses trajectories whose
  model segments are not exactly what the engines returned.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any

from rollout.config import SamplingConfig
from rollout.data import PromptRow
from rollout.rewards import RewardFn, RewardOutcome, score_async
from rollout.trajectory import Generation, Trajectory

# Sampling parameters a rollout may set per call (the rest of SamplingConfig is the adapter's).
OVERRIDABLE = frozenset({"temperature", "top_p", "top_k", "max_new_tokens", "stop", "ignore_eos"})


class RolloutAborted(Exception):
    """The adapter's requests were aborted (abort, retire, pause): the group is re-queued, not trained on."""


class TokenBudgetExhausted(Exception):
    """The trajectory's token budget (RolloutSpec.max_tokens) leaves no room for another generated token."""


class InvalidRollout(ValueError):
    """A rollout returned trajectories that cannot be trained on; the message says why."""


class _Permits:
    """A counting limit on the group's requests in flight (asyncio, one thread: no lock needed)."""

    def __init__(self, total: int):
        self.total = total
        self.free = total
        self._changed = asyncio.Event()

    async def acquire(self, k: int) -> None:
        while self.free < k:
            self._changed.clear()
            await self._changed.wait()
        self.free -= k

    def release(self, k: int) -> None:
        self.free += k
        self._changed.set()


class RolloutContext:
    """What one group's rollout gets (see the module doc). Public: `n`, `sampling`, `tokenizer`,
    `max_tokens`, `max_turns`, `generate`, `score`, `call`, `encode`, `decode`."""

    def __init__(self, pool, adapter: str, *, n: int, sampling: SamplingConfig, tokenizer,  # noqa: ANN001 - EnginePool
                 max_tokens: int | None = None, max_turns: int = 1, reward: RewardFn | None = None,
                 reward_timeout_s: float = 30.0, aborted: Callable[[], bool] = lambda: False,
                 executor: Executor | None = None):
        self.pool = pool
        self.adapter = adapter
        self.n = n
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self._reward = reward
        self._reward_timeout_s = reward_timeout_s
        self._aborted = aborted
        self._executor = executor
        self._permits = _Permits(n)
        self.was_aborted = False
        self.generated: dict[str, Generation] = {}  # rid -> what the engine returned

    # --- the engines --------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], n: int = 1, **sampling: Any) -> list[Generation]:
        """`n` generations after `input_ids` with the adapter's newest weights, on one engine (they
        share the context's KV cache there). `sampling` overrides the adapter's sampling parameters
        for this call (keys: OVERRIDABLE). Raises RolloutAborted, TokenBudgetExhausted, or the
        engine's error (rollout/engines/client.py EngineError: the worker re-queues the group)."""
        if not 1 <= n <= self.n:
            raise ValueError(f"generate: n must be 1..{self.n} (the group's size), got {n}")
        unknown = sorted(set(sampling) - OVERRIDABLE)
        if unknown:
            raise ValueError(f"generate: unknown sampling parameter(s) {unknown}; allowed: {sorted(OVERRIDABLE)}")
        params = {**self.sampling.sglang_params(), **sampling}
        if self.max_tokens is not None:
            room = self.max_tokens - len(input_ids)
            if room < 1:
                raise TokenBudgetExhausted(f"the context has {len(input_ids)} tokens; the trajectory's budget is {self.max_tokens}")
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), room)
        await self._permits.acquire(n)
        try:
            # The abort check and the pool's registration of the request ids happen in one step
            # (nothing is awaited between them), so an abort either sees these requests or came first.
            if self._aborted():
                self.was_aborted = True
                raise RolloutAborted(f"adapter {self.adapter}: aborted")
            group = await self.pool.generate_group(self.adapter, list(input_ids), params, n)
        finally:
            self._permits.release(n)
        if group.aborted:
            self.was_aborted = True
            raise RolloutAborted(f"adapter {self.adapter}: a request was aborted")
        out = [Generation(r.rid, tuple(r.token_ids), tuple(r.logprobs), r.text, r.finish_reason, group.version, group.engine)
               for r in group.results]
        for g in out:
            self.generated[g.rid] = g
        return out

    # --- rewards and tenant code --------------------------------------------------------------

    async def score(self, text: str, task: PromptRow) -> RewardOutcome:
        """The adapter's configured reward on `text` (failure-safe: rollout/rewards.py score_async)."""
        if self._reward is None:
            raise ValueError(f"adapter {self.adapter} has no reward configured (config.reward); the rollout must compute its own")
        return await score_async(self._reward, text, task.label, task.metadata, self._reward_timeout_s)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`: awaited on the loop if it is a coroutine function, else run in the
        adapter's own threads; a returned awaitable is awaited too."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        out = await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args, **kwargs))
        return await out if inspect.isawaitable(out) else out

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as it is (no special tokens added: write chat markers into the text)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    # --- the worker's checks ------------------------------------------------------------------

    def check(self, trajectories: Any) -> list[Trajectory]:
        """`trajectories` if they can be trained on as one group, else InvalidRollout saying why:
        exactly n Trajectory objects, one prompt, each well formed, every model segment exactly a
        generation of this context (its rid, tokens and log-probabilities)."""
        if not isinstance(trajectories, (list, tuple)) or not all(isinstance(t, Trajectory) for t in trajectories):
            raise InvalidRollout(f"a rollout must return a list of rollout.trajectory.Trajectory, got {_type_name(trajectories)}")
        if len(trajectories) != self.n:
            raise InvalidRollout(f"a rollout must return n_samples_per_prompt = {self.n} trajectories, got {len(trajectories)}")
        if len({tuple(t.prompt_ids) for t in trajectories}) != 1:
            raise InvalidRollout("the trajectories of one group must share one prompt (group-relative advantages compare them)")
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        for i, t in enumerate(trajectories):
            problem = t.problem(vocab)
            if problem is not None:
                raise InvalidRollout(f"trajectory {i}: {problem}")
            for s in t.segments:
                if s.source != "model":
                    continue
                g = self.generated.get(s.rid)
                if g is None or g.token_ids != s.token_ids or g.logprobs != s.logprobs:
                    raise InvalidRollout(f"trajectory {i}: a model segment is not a generation of this group "
                                         "(build model turns only with Trajectory.add_turn(ctx.generate(...)[k]))")
        return list(trajectories)


def _type_name(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__
