"""Trajectories: what one rollout of one sample is, turn by turn, before it becomes a train sample.

A trajectory is its prompt and then segments in order: *model* segments (tokens the
adapter generated, with the sampler's log-probability of each, the request id and the
weight version that made them) and *environment* segments (tokens the environment or the
rollout function appended: tool results, the next user message). Flattened for training
(`Trajectory.flat`), every token after the prompt is in the response, the loss mask is 1
exactly on model tokens and the rollout log-probabilities are the sampler's there and 0.0 on
environment tokens (masked, never read: trainer/batch.py).

Invariants:
* Model segments are only made from a `Generation` (`add_turn`), i.e. from what an engine
  returned for a request of this adapter; the rollout worker also checks each one against the
  generations its context recorded (rollout/context.py `RolloutContext.check`), so a custom
  rollout cannot label environment tokens as the model's own.
* The trajectory's version is its first turn's (its staleness: rollout/groups.py), the oldest
  weights that generated any of its tokens; later turns may come from newer versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Generation:
    """One engine answer for this adapter: the tokens the model generated after the given context."""

    rid: str  # "<adapter>::<uuid>" (rollout/naming.py)
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # one per token: log p(token | context, earlier tokens) under `version`
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | ...
    version: int  # the adapter weight version that served the request
    engine: int = 0


@dataclass(frozen=True)
class Segment:
    source: str  # "model" | "env"
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # model segments only
    text: str = ""
    rid: str | None = None  # model segments only
    version: int | None = None  # model segments only
    finish_reason: str | None = None  # model segments only


@dataclass
class FlatTrajectory:
    """A trajectory as one train sample's response (aligned lists)."""

    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    text: str


@dataclass
class Trajectory:
    """One sample's rollout; build it with `add_turn` / `add_observation` (see the module doc)."""

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0  # the return: the sum of the rewards of every turn
    reward_error: str | None = None  # the reward failed (it is then 0): counted, the sample still trains
    truncated: bool = False  # ended by a budget (max_turns, max_tokens), not by the environment

    def add_turn(self, gen: Generation) -> None:
        """The model's turn: learned tokens with the sampler's log-probabilities."""
        self.segments.append(Segment("model", tuple(gen.token_ids), tuple(gen.logprobs), gen.text, gen.rid, gen.version,
                                     gen.finish_reason))

    def add_observation(self, token_ids: list[int], text: str = "") -> None:
        """Environment tokens (a tool result, the next user message): in the context, never learned."""
        if token_ids:
            self.segments.append(Segment("env", tuple(int(t) for t in token_ids), None, text))

    @property
    def tokens(self) -> list[int]:
        """The whole context so far: prompt, then every segment (what the next turn is generated from)."""
        return [*self.prompt_ids, *(t for s in self.segments for t in s.token_ids)]

    @property
    def turns(self) -> int:
        return sum(s.source == "model" for s in self.segments)

    @property
    def version(self) -> int | None:
        """The first turn's weight version (None before any turn)."""
        return next((s.version for s in self.segments if s.source == "model"), None)

    @property
    def finish_reason(self) -> str:
        """"truncated" when a budget ended it, else its last turn's ("stop", "length")."""
        if self.truncated:
            return "truncated"
        return next((s.finish_reason or "stop" for s in reversed(self.segments) if s.source == "model"), "empty")

    def flat(self) -> FlatTrajectory:
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for s in self.segments:
            ids.extend(s.token_ids)
            learned = s.source == "model"
            mask.extend([int(learned)] * len(s.token_ids))
            lps.extend(s.logprobs if learned else [0.0] * len(s.token_ids))
        return FlatTrajectory(ids, mask, lps, "".join(s.text for s in self.segments))

    def problem(self, vocab_size: int | None = None) -> str | None:
        """Why this trajectory cannot be trained on, or None (checked before it is buffered)."""
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            return f"reward must be a finite number, got {self.reward!r}"
        if not self.prompt_ids:
            return "the prompt is empty"
        if self.turns == 0:
            return "no model turn (a trajectory must hold at least one generation)"
        for s in self.segments:
            if s.source == "model" and (s.logprobs is None or len(s.logprobs) != len(s.token_ids)):
                return "a model segment's log-probabilities do not match its tokens"
        if vocab_size is not None:
            bad = [t for t in self.tokens if not 0 <= t < vocab_size]
            if bad:
                return f"token ids outside the vocabulary (0..{vocab_size - 1}): {bad[:5]}"
        return None
