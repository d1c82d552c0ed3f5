"""Pydantic models of the JSON bodies the SDK (tinker 0.38.0) sends and receives under
``/api/v1``. Requests ignore fields added by newer SDKs (the SDK's own ``type`` tags,
telemetry-only fields); what we act on is validated. forward_backward travels as
protobuf (proto_io.py), not JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionRequest(_In):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    display_name: str | None = None  # sessions list/get/search (api/tinker/sessions.py)
    project_id: str | None = None  # a label: lorafleet has no projects


class SessionRequest(_In):
    session_id: str


class FinishReason(_In):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(_In):
    """ServiceClient.close(status, detail): why the client finished (search's client_finished status)."""

    reason: FinishReason | None = None
    detail: str | None = Field(None, max_length=4096)


class LoraConfigIn(_In):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_In):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfigIn | None = None
    optimizer_config: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class ModelRequest(_In):
    model_id: str


class AdamParamsIn(_In):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    type: str | None = None


class OptimStepRequest(_In):
    model_id: str
    adam_params: AdamParamsIn | None = None
    optimizer_params: dict[str, Any] | None = None
    seq_id: int | None = None


class SaveWeightsRequest(_In):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None  # save_weights_for_sampler: also open a sampling session
    ttl_seconds: int | None = None  # api/tinker/checkpoints/runs.py: the checkpoint is deleted this long after the save
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(SaveWeightsRequest):
    path: str  # required, as in the SDK
    age_encryption_recipients: list[str] | None = None


class CheckpointTtlRequest(_In):
    ttl_seconds: int | None


class CreateSamplingSessionRequest(_In):
    session_id: str
    sampling_session_seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None


class ModelInputIn(_In):
    chunks: list[dict[str, Any]]

    def tokens(self) -> list[int]:
        out: list[int] = []
        for c in self.chunks:
            if c.get("type", "encoded_text") != "encoded_text" or "tokens" not in c:
                raise ValueError(f"prompt chunk of type {c.get('type')!r} not supported; only encoded text")
            out.extend(int(t) for t in c["tokens"])
        return out


class SampleRequest(_In):
    num_samples: int = Field(1, ge=1, le=1024)
    prompt: ModelInputIn
    sampling_params: dict[str, Any] = {}
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: Any = None  # not served: refused with a message
    prompt_alt_tokens_k: int = 0  # not served: refused with a message
    record_stability_info: bool | None = None  # record each sequence for stable_reinforce (api/tinker/sampling/sampler.py)


class LoadWeightsRequest(_In):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None  # create-via-load: the new training run's metadata
    path: str
    optimizer: bool = False


class WeightsInfoRequest(_In):
    tinker_path: str


class FutureRequest(_In):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionTarget(_In):
    type: Literal["sampling_session"] = "sampling_session"  # the one target SDK 0.38 polls
    sampling_session_id: str
    cloned_sampler_id: int = Field(0, ge=0)


class FuturesRequest(_In):
    """retrieve_futures (api/tinker/completions.py): a sampling client's batched poll."""

    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0)
    timeout: float | None = Field(None, ge=0)  # 0: answer at once; None: the server's long poll
    retrieved_request_ids: list[str] = Field([], max_length=10000)
