"""What passes between the runtime and the training loop: step plans, rounds' outcomes, publishes;
and how a whole RL step of rollout groups becomes train samples.

Token alignment follows trainer/batch.py: tokens = prompt + response, loss on the response
tokens the model generated only (a multi-turn sample's environment tokens, tool results and
the like, are in the response but masked: rollout/trajectory.py), rollout log-probabilities
aligned with the tokens (0 on the prompt and on environment tokens, where the mask is 0 and
they are not read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.groups import RolloutGroup
from trainer.batch import TrainSample


@dataclass(frozen=True)
class StepPlan:
    """One run's part of a train call."""

    registration_id: str
    samples: int
    reward_mean: float | None
    staleness_mean: float | None
    reward_failures: int
    version_min: int | None = None  # oldest weight version that generated a sample of this step (RL)
    metrics: dict[str, float] = field(default_factory=dict)  # more per-step metrics (RL: turns_mean, env_token_share)


@dataclass(frozen=True)
class SteppedRun:
    """A run whose slot stepped in a train call: what the loop commits to the registry."""

    registration_id: str
    name: str
    step: int
    samples: int
    metrics: dict[str, float]
    exhausted: bool
    due_checkpoint: bool
    failure: str | None = None  # the step counts, and then the run is FAILED for this (its rewards kept failing)


@dataclass(frozen=True)
class RunFailed:
    """A run that cannot go on (settled by its tenant: non-finite steps, rewards all failing)."""

    registration_id: str
    reason: str


@dataclass(frozen=True)
class CollectedRound:
    """One round as the loop sees it (FleetRuntime.round): the dataset runs that stepped, those to
    fail, the trainer call's time, the samples trained, and how many tenants took part (0: none was
    ready: nothing ran)."""

    stepped: list[SteppedRun] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # registration id -> reason (the loop marks these FAILED)
    seconds: float = 0.0
    samples: list[TrainSample] = field(default_factory=list)
    tenants: int = 0

    @property
    def empty(self) -> bool:
        return self.tenants == 0


@dataclass(frozen=True)
class PublishOutcome:
    """A publish (weights of one RL run to the engines) that finished since the loop last asked."""

    registration_id: str
    name: str
    version: int
    error: str | None  # None: every engine in routing serves `version` (or none is in routing: it is current)
    republish: bool = False  # failed, and it was the run's newest version: the loop publishes it again


class TrainerLost(RuntimeError):
    """The trainer actor(s) died; every slot is gone (restart, then re-prepare from checkpoints)."""


def rl_samples(slot: int, registration_id: str, group: RolloutGroup) -> list[TrainSample]:
    """Prompt + response per sample; loss on the model's response tokens; rollout logprobs aligned with tokens."""
    out = []
    n_prompt = len(group.prompt_ids)
    for s in group.samples:
        # Every sample counts toward the step (the slot steps at prompts x n samples), even an
        # empty response: it then has no learned token and adds nothing to the gradient.
        tokens = [*group.prompt_ids, *s.response_ids]
        out.append(TrainSample(
            slot=slot, tokens=tokens, loss_mask=[0] * n_prompt + s.mask,
            advantage=s.advantage, rollout_logprobs=[0.0] * n_prompt + list(s.logprobs), registration=registration_id,
        ))
    return out


def rl_step(slot: int, registration_id: str, groups: list[RolloutGroup]) -> tuple[list[TrainSample], StepPlan]:
    """The samples of one whole RL step (its groups, in order) and what the loop records about it.
    Staleness: the stamp the rollout buffer put on each group when it handed it out (rollout/groups.py)."""
    samples = [s for g in groups for s in rl_samples(slot, registration_id, g)]
    rewards = [s.reward for g in groups for s in g.samples]
    stale = [g.staleness for g in groups if g.staleness is not None]
    turns = [s.turns for g in groups for s in g.samples]
    response = sum(len(s.response_ids) for g in groups for s in g.samples)
    learned = sum(sum(s.mask) for g in groups for s in g.samples)
    plan = StepPlan(
        registration_id, len(samples),
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        staleness_mean=sum(stale) / len(stale) if stale else None,
        reward_failures=sum(s.reward_error is not None for g in groups for s in g.samples),
        version_min=min(g.version for g in groups),
        # model turns per sample, and the share of response tokens the environment wrote (not learned)
        metrics={"turns_mean": sum(turns) / len(turns), "env_token_share": (response - learned) / response if response else 0.0},
    )
    return samples, plan
