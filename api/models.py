"""Every wire message of the REST API (requests, responses, errors), in one module.

The request body of `POST /v1/adapters` is `service.config.adapter.AdapterSpec` itself
(name + AdapterConfig), so the REST schema and the job file's adapter entries
are one model. Responses are built from the registry's immutable refs with the
`from_*` constructors here, so routes stay thin.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.config.adapter import AdapterConfig, AdapterSpec
from service.registry.registry import AdapterRef, AdapterState, StepRecord

AdapterCreate = AdapterSpec  # POST /v1/adapters body


def finite_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The finite entries: JSON has no Infinity or NaN (a response holding one could not be sent)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AdapterOut(_Out):
    """One adapter run (the newest run of its name, or one run by its registration id)."""

    name: str
    registration_id: str = Field(description="uuid4 hex of this registration (the run's id, GET /v1/runs/{registration_id}); a re-registered name gets a new one.")
    owner: str | None = Field(None, description="The tenant whose key registered the run; null = the admin (the API token or the job file).")
    state: AdapterState
    slot: int | None = Field(description="Trainer slot held; null while queued or evicted, and once COMPLETED or FAILED.")
    queue_position: int | None = Field(None, description="1-based place in the queue for a slot (registered beyond the free slots, or evicted); null while it holds a slot or once ended.")
    residency: str | None = Field(None, description="resident (holds a slot), queued (waits for its first slot), evicted (trained, swapped out of its slot, waits to come back); null once ended.")
    slot_version: int = Field(description="Globally unique version given at registration; never repeats.")
    weight_version: int | None = Field(description="Version of the weights the engines serve for it; null before the first publish.")
    step: int = Field(description="Optimizer steps committed.")
    total_steps: int | None = Field(description="Steps the run will take, and the length of its learning-rate schedule: num_step, else (data rows x num_epoch) // prompts_per_step (fewer when rows turn out over a token limit; rows of a file past data_check_bytes are estimated at registration and counted exactly when the run starts).")
    samples_trained: int
    last_reward: float | None = Field(description="reward_mean of the last step (RL).")
    last_loss: float | None
    last_metrics: dict[str, float]
    failure_reason: str | None
    export_path: str | None = Field(description="PEFT export folder, set when the run retires; relative to the service's state dir (no response shows a server path).")
    checkpoint_path: str | None = Field(description="Newest checkpoint folder, relative to the service's state dir.")
    checkpoint_step: int | None
    created_at: float
    updated_at: float
    finished_at: float | None
    config: AdapterConfig

    @classmethod
    def from_ref(cls, ref: AdapterRef) -> AdapterOut:
        return cls(
            name=ref.name,
            registration_id=ref.registration_id,
            owner=ref.owner,
            state=ref.state,
            slot=ref.slot,
            queue_position=ref.queue_position,
            residency=ref.residency,
            slot_version=ref.slot_version,
            weight_version=ref.weight_version,
            step=ref.step,
            total_steps=ref.total_steps,
            samples_trained=ref.samples_trained,
            last_reward=finite_metrics(ref.last_metrics).get("reward_mean"),
            last_loss=finite_metrics(ref.last_metrics).get("loss"),
            last_metrics=finite_metrics(ref.last_metrics),
            failure_reason=ref.failure_reason,
            export_path=ref.export_path,
            checkpoint_path=ref.checkpoint_path,
            checkpoint_step=ref.checkpoint_step,
            created_at=ref.created_at,
            updated_at=ref.updated_at,
            finished_at=ref.finished_at,
            config=ref.config,
        )


class AdapterList(_Out):
    """One page of the adapter list (GET /v1/adapters: limit, offset or cursor; filters state, owner, q)."""

    adapters: list[AdapterOut]
    total: int = Field(description="Adapters matching the filters, in all pages.")
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page; null on the last page.")


class RunList(_Out):
    """Every run of one adapter name the caller may see, oldest first (a re-registered name keeps its earlier runs)."""

    name: str
    runs: list[AdapterOut]


class StepOut(_Out):
    step: int
    samples: int
    weight_version: int | None
    reward_mean: float | None
    loss: float | None
    learning_rate: float | None
    staleness_mean: float | None
    metrics: dict[str, float] = Field(description="Every metric the trainer reported for the step.")
    recorded_at: float

    @classmethod
    def from_record(cls, r: StepRecord) -> StepOut:
        m = finite_metrics(r.metrics)
        return cls(
            step=r.step,
            samples=r.samples,
            weight_version=r.weight_version,
            reward_mean=m.get("reward_mean"),
            loss=m.get("loss"),
            learning_rate=m.get("learning_rate"),
            staleness_mean=m.get("staleness_mean"),
            metrics=m,
            recorded_at=r.recorded_at,
        )


class MetricsOut(_Out):
    name: str
    registration_id: str
    steps: list[StepOut]


class AbortOut(_Out):
    name: str
    aborted: int = Field(description="In-flight generation requests aborted.")


class HealthOut(_Out):
    status: str
    uptime_s: float
    adapters: dict[str, int] = Field(description="Adapters (newest run per name) by state.")


class ComponentOut(_Out):
    ok: bool
    detail: str | None = Field(None, description="What the component reports (engine URL, in-flight requests...); only with the token.")


class SlotsOut(_Out):
    total: int
    free: int
    max_rank: int


class ReadyOut(_Out):
    ready: bool
    components: dict[str, ComponentOut]
    slots: SlotsOut

    def public(self) -> ReadyOut:
        """What /ready tells a caller without the token: ready or not, per component, nothing internal."""
        return self.model_copy(update={"components": {k: ComponentOut(ok=c.ok) for k, c in self.components.items()}})


class ProcessOut(_Out):
    name: str = Field(description="coordinator, trainer-rank-<r>, rollout-worker, engine-<i>")
    role: str = Field(description="coordinator | trainer | rollout | engine")
    pid: int | None = Field(description="Process id on its node (None: not running, or an external engine).")
    detail: str = ""
    node_id: str = Field("", description="The Ray node it runs on ('' when not known: an external engine, a process not running).")
    node_ip: str = Field("", description="That node's address.")


class TinkerSlotOut(_Out):
    slot: int
    model_id: str
    owner: str


class TinkerFleetOut(_Out):
    """The Tinker models beside the runs (the Tinker API is served)."""

    models: int = Field(description="Live Tinker models.")
    residency: dict[str, int] = Field(description="Models by state: resident (holds a slot), queued (waits for its first slot), evicted (out of its slot).")
    waiting_for_slot: int = Field(description="Models with a call waiting for a trainer slot.")
    sessions: int = Field(description="Live Tinker sessions.")
    slots: list[TinkerSlotOut] = Field(description="The trainer slots Tinker models hold now, in slot order (the runs' are in GET /v1/adapters).")


class FleetOut(_Out):
    """The service's processes, for operators (fault drills: kill one with a real signal), and the Tinker models' share of the slots."""

    processes: list[ProcessOut]
    tinker: TinkerFleetOut | None = Field(None, description="null when the service does not serve the Tinker API.")


class CurvePointOut(_Out):
    step: int
    loss: float


class TinkerModelOut(_Out):
    """One live Tinker model (api/tinker/model_views.py): its tenant, where it is, what it did."""

    model_id: str
    owner: str = Field(description="The tenant whose key created it.")
    session_id: str
    rank: int
    residency: str = Field(description="resident (holds `slot`), queued (waits for its first slot), evicted (trained, out of its slot: `where`).")
    slot: int | None = Field(description="The trainer slot it holds; null while queued or evicted.")
    queue_position: int | None = Field(description="While a call of it waits for a slot: its 1-based place in the scheduler's one queue (runs and models that began to wait before it, plus one); else null.")
    where: str | None = Field(description="An evicted model's state: host (trainer host memory), disk (spilled) or store (its durable snapshot only); null otherwise.")
    waiting_reason: str | None = Field(description="Why its calls wait (what its futures answer with try_again), or null.")
    step: int = Field(description="Optimizer steps applied.")
    tokens_trained: int = Field(description="Datum positions of its forward_backward calls that ran (since the service started).")
    forward_backward_calls: int
    last_loss: float | None = Field(description="loss:sum of its last forward_backward call.")
    loss_curve: list[CurvePointOut] = Field(description="Per optimizer step (the newest 64): the sum of loss:sum over the forward_backward calls the step applied.")
    sample_calls: int = Field(description="Sample requests of sampling sessions on its sampler checkpoints.")
    sampled_sequences: int
    admissions: int = Field(description="Times it came into a slot.")
    waited_grants: int | None = Field(description="Slot grants to Tinker models from its creation to its first slot (its own included; null before it): at most 1 + the models waiting ahead of it (first come, first served).")
    created_at: float
    first_slot_at: float | None
    updated_at: float

    @classmethod
    def from_row(cls, r: Any) -> TinkerModelOut:  # an api.tinker.model_views.ModelRow
        fields = {k: v for k, v in vars(r).items() if k in cls.model_fields and k != "loss_curve"}
        return cls(**fields, loss_curve=[CurvePointOut(step=s, loss=v) for s, v in r.loss_curve if math.isfinite(v)])


class TinkerModelList(_Out):
    """One page of the Tinker models (GET /v1/tinker/models: limit, offset or cursor; filters state, owner, q)."""

    tinker_api: bool = Field(description="Whether the service serves the Tinker API (false: no models ever).")
    models: list[TinkerModelOut]
    total: int = Field(description="Models matching the filters, in all pages.")
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page; null on the last page.")


class ErrorOut(_Out):
    """Body of every error response."""

    error: str = Field(description="Machine-readable code: bad_value, bad_request, unauthorized, forbidden, not_found, method_not_allowed, conflict, no_free_slot, quota_exceeded, too_large, unsupported_media_type, schema, unavailable, internal.")
    detail: str = Field(description="What was wrong and what is allowed.")
    field: str | None = Field(None, description="The offending field, when there is one.")
    errors: list[dict[str, Any]] | None = Field(None, description="422 only: every schema error.")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut, "description": text}
    for code, text in {
        400: "A value that cannot work (missing data file, rank above max, path outside the roots), or a body that cannot be read",
        401: "Missing or wrong bearer token (the API token, or a tenant key when the service has a keys file)",
        403: "A tenant key on an operator route (/v1/fleet, /metrics)",
        404: "Unknown adapter, run or route, or one of another tenant (the same answer)",
        405: "Method not allowed on this route (the Allow header lists the allowed ones)",
        409: "Name in use, still retiring, already retiring, or no free slot",
        413: "Body larger than the service allows",
        429: "A tenant quota is used up (live or queued runs per key); the detail gives the quota and the tenant's usage",
        415: "Body is not sent as JSON (Content-Type must be application/json)",
        422: "Body does not match the schema (including numbers that are not finite)",
        503: "The controller did not answer in time",
    }.items()
}


class FleetRoundOut(_Out):
    """One round of the training loop (service.loop.fleet_stats.RoundRecord)."""

    ended_at: float = Field(description="Wall-clock time (Unix seconds) the round ended.")
    collect_s: float = Field(description="Waiting for whole steps (rollouts generating).")
    train_s: float = Field(description="The mixed train call.")
    publish_s: float = Field(description="Handing the stepped adapters' weights to the engines.")
    checkpoint_s: float
    steps: int
    samples: int
    rollout_tokens: int = Field(description="Response tokens of the RL samples trained.")
    trained_tokens: int = Field(description="Loss tokens of every sample trained (RL and SFT).")


class FleetStatsOut(_Out):
    """Fleet-wide training statistics (GET /v1/fleet/stats): totals since start, rates over the last window_s seconds, and how round time splits."""

    rounds: int
    steps: int
    samples: int
    rollout_tokens: int
    trained_tokens: int
    window_s: float
    steps_per_min: float = Field(description="Adapter steps per minute over the window.")
    rollout_tokens_per_s: float
    trained_tokens_per_s: float
    seconds: dict[str, float] = Field(description="Seconds spent in each part of the rounds since start: collect, train, publish, checkpoint.")
    fractions: dict[str, float] = Field(description="The same as fractions of their sum.")
    recent: list[FleetRoundOut] = Field(description="The newest rounds, oldest first.")
