"""What the rollout side and the service say to each other: the rollout worker's messages.

* ``AdapterRollout``: what the worker needs to generate for one adapter registration (the service
  builds it: service/fleet/fleet_runtime.py);
* ``AdapterStats``: one adapter's counters in the worker (its groups, requests, failures, data);
* ``EngineHealth``: one engine as the worker sees it (alive, routable, its process and node);
* ``PUBLISH_LOADED`` / ``PUBLISH_SUPERSEDED``: what a publish of a version reports;
* ``RolloutError``: a rollout call with a bad argument.

The worker (rollout/worker.py ``RolloutCore``) and its Ray actor (rollout/worker_actor.py) make
them; the service imports them from here, not from the worker's loop. The models are frozen values.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rollout.config import DataConfig, RewardConfig, RolloutSpec, SamplingConfig
from rollout.data import DataCursor, DataStatus

# What publish_version reports (the coordinator settles on it: service/fleet/fleet_runtime.py settle_publishes)
PUBLISH_LOADED = "loaded"  # every engine in routing loaded the version (or none is in routing: it is current)
PUBLISH_SUPERSEDED = "superseded"  # never loaded: a newer version of the adapter replaced it first


class AdapterRollout(BaseModel):
    """What the rollout worker needs to generate for one adapter registration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    registration_id: str
    data: DataConfig
    reward: RewardConfig | None = None  # required by the built-in single_turn rollout; custom ones may use it (ctx.score)
    sampling: SamplingConfig
    rollout: RolloutSpec | None = None  # None: the built-in single_turn, without budgets (rollout/rollouts.py)
    initial_version: int = 0
    cursor: DataCursor | None = None  # resume the data source here (from a checkpoint)
    max_staleness: int | None = None  # this adapter's bound (publishes behind); None = RolloutConfig.max_staleness


class AdapterStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    registration_id: str
    version: int
    paused: bool
    inflight_requests: int
    inflight_groups: int
    buffered_groups: int
    groups_completed: int  # scored and buffered
    groups_consumed: int  # popped by training
    groups_aborted: int  # re-queued after an abort
    groups_requeued: int  # all re-queues: aborted, engine failure, error, stale
    groups_failed: int  # engine errors (re-queued)
    dropped_stale: int
    refused_foreign: int
    reward_failures: int
    rejections_in_a_row: int  # requests the engines refused (HTTP 4xx) since the last group that completed
    last_error: str | None
    fatal_reason: str | None  # set when the adapter can never make progress (no row fits, requests keep being refused)
    data: DataStatus
    groups_dropped_error: int = 0  # custom rollout raised or returned invalid trajectories: dropped, row not served again
    groups_dropped_timeout: int = 0  # custom rollout ran past RolloutSpec.timeout_s: aborted and dropped likewise
    trajectories_truncated: int = 0  # ended by max_turns / max_tokens (trained on, with the rewards they got)

    def step_metrics(self) -> dict[str, float]:
        """Counters a step's metrics carry (cumulative): the data source's skips and the dropped groups."""
        return {**self.data.skip_metrics(), "groups_dropped_error": float(self.groups_dropped_error),
                "groups_dropped_timeout": float(self.groups_dropped_timeout),
                "trajectories_truncated": float(self.trajectories_truncated)}


class EngineHealth(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int
    url: str
    alive: bool  # the process runs (managed engines) / the server answers (external ones)
    routable: bool  # the pool sends requests to it
    inflight: int
    starts: int = 1
    pid: int | None = None  # the server's process id (managed engines)
    node_id: str = ""  # the Ray node it runs on ("" unknown: an external engine)
    node_ip: str = ""


class RolloutError(ValueError):
    """A rollout call with a bad argument; the message says what was wrong."""
