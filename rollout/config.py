"""Typed config of the rollout side: engines, per-adapter data / reward / sampling, worker bounds.

All models forbid unknown fields (a typo is an error naming the field) and are
frozen (a validated config cannot drift). Field names of `DataConfig`,
`RewardConfig` and `SamplingConfig` match the service's tenant-facing specs
(service.config.adapter.DataSpec / RewardSpec / SamplingSpec), so the controller turns
one into the other with `DataConfig.model_validate(spec.model_dump())`.

Checks that need the filesystem (data file exists, has the keys) happen when a
data source is opened (rollout.data.open_data_source); checks that need an
import (custom reward, custom rollout) happen in rollout.rewards.load_reward and
rollout.rollouts.load_rollout.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.platform.model_folder import CONFIG_FILE, read_model_config
from trainer.strict_model import StrictModel

# Adapter names become SGLang LoRA names ("<name>@v<k>") and request-id
# prefixes ("<name>::<uuid4hex>"); the pattern excludes ':' and '@', which keeps
# both encodings unambiguous and every rid prefix-free (see rollout.rids).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
ADAPTER_NAME_RE = re.compile(ADAPTER_NAME_PATTERN)

# SGLang 0.5.23's --lora-target-modules choices (sglang.srt.utils.common.SUPPORTED_LORA_TARGET_MODULES
# plus "all"), copied so that this module imports without sglang.
SGLANG_LORA_TARGET_MODULES = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
        "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj",
        "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "all",
    }
)

# Server flags the launcher sets itself; passing them again in extra_server_args
# would silently fight the launcher, so they are refused.
MANAGED_SERVER_FLAGS = frozenset(
    {
        "--model-path", "--model", "--host", "--port", "--tp-size", "--tp", "--device",
        "--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch",
        "--max-loaded-loras", "--lora-backend", "--attention-backend", "--dtype",
    }
)


# SGLang 0.5.23's --dtype names and the dtype each serves in (sglang.srt.configs.model_config
# _STR_DTYPE_TO_TORCH_DTYPE; SGLang lowercases the flag), copied so that this module imports without sglang.
SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}

# Dtypes a publish (handoff) folder can be written in: trainer/export/export_writer.py EXPORT_DTYPES.
PublishDtype = Literal["auto", "float32", "bfloat16", "float16"]


def checkpoint_serving_dtype(model_path: str | Path) -> str:
    """The dtype SGLang serves a checkpoint in under ``--dtype auto`` (its GPU default): config.json's
    ``dtype`` (or ``torch_dtype``), float32 when absent or unknown; a float32 checkpoint is
    downcast, to bfloat16 for Gemma models and float16 for the others (SGLang 0.5.23
    sglang.srt.configs.model_config._get_and_verify_dtype; tests/unit/test_publish_dtype.py checks
    this copy against it)."""
    try:
        cfg = read_model_config(model_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the base model's dtype from {Path(model_path) / CONFIG_FILE}: {e}") from e
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = SGLANG_DTYPES.get(named if isinstance(named, str) else "", "float32")
    if dtype != "float32":
        return dtype
    return "bfloat16" if str(cfg.get("model_type", "")).startswith("gemma") else "float16"


def non_finite_numbers(value: Any, where: str) -> list[str]:
    """Dotted places in a JSON-like value that hold an infinite or NaN float (strict JSON has neither)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [where]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite_numbers(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in non_finite_numbers(v, f"{where}.{i}")]
    return []


def _finite(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` (a tenant's keyword arguments) if every number in it is finite, else ValueError."""
    bad = non_finite_numbers(kwargs, "kwargs")
    if bad:
        raise ValueError(f"numbers must be finite; {', '.join(bad)} is Infinity or NaN")
    return kwargs


def check_adapter_name(name: str) -> str:
    """Return `name` if it is a valid adapter name, else raise ValueError saying what is allowed."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise ValueError(
            f"adapter name {name!r} is not allowed: use 1-64 characters, letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (':' and '@' are reserved for request ids and versions)"
        )
    return name


class EngineConfig(StrictModel):
    """The SGLang engines the rollout worker generates with."""

    num_engines: int = Field(1, ge=1, le=64, description="SGLang servers to start.")
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel size of each server (GPUs per engine).")
    host: str = Field(
        "127.0.0.1",
        description="Address the servers bind to and the client calls. Loopback by default: the servers' only "
        "client is the rollout worker, on the coordinator's node. 'node': each server binds its node's address as "
        "Ray knows it (engines on other hosts of a cluster). Must be loopback when the service is.",
    )
    ports: list[int] = Field(
        default_factory=list,
        description="One port per engine; 0 (or an empty list) = pick a free port at launch.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="auto = cuda when torch sees a GPU, else the SGLang CPU engine (rollout.engines.sglang_cpu)."
    )
    dtype: str = Field(
        "auto",
        description="Server --dtype. auto = the checkpoint's dtype on GPU and float32 on CPU "
        "(SGLang's own auto picks float16 on CPU, which would not match the fp32 trainer).",
    )
    cpu_nice: int = Field(
        10, ge=0, le=19,
        description="CPU engines only: the niceness of each server's processes and of its session's autogroup (Linux; "
        "each server leads a session of its own, and where the autogroup scheduler is on the cores are shared between "
        "sessions first). The engines yield the shared cores to the training loop's serial path (the coordinator, the "
        "trainer rank): on the 2-core tiny world a Tinker training call's p50 fell ~40% at 10 against 0 "
        "(docs/BENCHMARKS.md, issue 41). 0 = the service's own priority. GPU engines always keep the service's.",
    )
    max_loaded_loras: int = Field(
        16, ge=1, description="Adapters (versions) the server holds at once (--max-loaded-loras). "
        "A live update holds two versions of one adapter briefly: allow 2 per adapter."
    )
    max_loras_per_batch: int = Field(
        8, ge=1, description="Adapters in one running batch, base-only counted as one (--max-loras-per-batch)."
    )
    max_lora_rank: int = Field(16, ge=1, le=1024, description="Largest LoRA rank the servers accept (--max-lora-rank).")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all"], min_length=1, description="Modules LoRA may target (--lora-target-modules)."
    )
    weight_transfer: Literal["tensors", "disk"] = Field(
        "tensors",
        description="How a new adapter version reaches the servers: 'tensors' = in the HTTP request "
        "(/load_lora_adapter_from_tensors; no shared filesystem needed; pickle + base64 + JSON: about 3 s per 87 MB "
        "adapter on CPU), 'disk' = the trainer writes a PEFT folder under <state_dir>/handoff and the server reads it "
        "(tens of ms; needs trainer rank 0 and the engines on one node, or a shared filesystem at that path; "
        "docs/operations.md, Weight publishing).",
    )
    publish_dtype: PublishDtype = Field(
        "auto",
        description="Dtype of the PEFT folders the trainer writes for the engines (weight_transfer 'disk'; the "
        "trainer casts on its device before the copy to host). auto = the dtype the engines serve in, which they "
        "round a loaded adapter to anyway: engines.dtype when it names one, else float32 on CPU engines and the "
        "checkpoint's dtype on GPU (bfloat16 halves the bytes of an fp32 folder). Checkpoints, export_path at "
        "retire and Tinker save_weights stay float32.",
    )
    startup_deadline_s: float = Field(300.0, gt=0, description="Give up on a server that is not ready after this many seconds.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one /generate call (seconds).")
    admin_timeout_s: float = Field(120.0, gt=0, description="Timeout of load/unload/abort/health calls (seconds).")
    max_total_tokens: int | None = Field(
        None, ge=256, description="KV-cache capacity in tokens (--max-total-tokens); default on CPU 8192, on GPU SGLang's choice."
    )
    cpu_threads: int = Field(
        1, ge=1, le=1024,
        description="CPU engine only: torch/OpenMP threads of each server (OMP_NUM_THREADS). On a small shared "
        "machine 1 is several times faster than SGLang's default of all cores (rollout.engines.sglang_cpu, item 8).",
    )
    log_dir: str | None = Field(None, description="Folder for server logs (engine-<i>.log); default a temporary folder.")
    extra_server_args: list[str] = Field(default_factory=list, description="More SGLang server flags, passed as given.")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str) -> str:
        if dtype != "auto" and dtype.lower() not in SGLANG_DTYPES:
            raise ValueError(f"unknown engine dtype {dtype!r}; allowed: auto, {', '.join(SGLANG_DTYPES)}")
        return dtype

    @field_validator("ports")
    @classmethod
    def _ports_in_range(cls, ports: list[int]) -> list[int]:
        bad = [p for p in ports if not 0 <= p <= 65535]
        if bad:
            raise ValueError(f"ports must be in 0..65535 (0 = pick a free one); got {bad}")
        fixed = [p for p in ports if p != 0]
        dupes = sorted({p for p in fixed if fixed.count(p) > 1})
        if dupes:
            raise ValueError(f"ports must differ between engines; repeated: {dupes}")
        return ports

    @field_validator("lora_target_modules")
    @classmethod
    def _known_modules(cls, modules: list[str]) -> list[str]:
        unknown = sorted(set(modules) - SGLANG_LORA_TARGET_MODULES)
        if unknown:
            raise ValueError(
                f"unknown LoRA target modules {unknown}; allowed: {sorted(SGLANG_LORA_TARGET_MODULES)}"
            )
        return modules

    @field_validator("extra_server_args")
    @classmethod
    def _no_managed_flags(cls, args: list[str]) -> list[str]:
        clashes = sorted({a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in MANAGED_SERVER_FLAGS})
        if clashes:
            raise ValueError(
                f"extra_server_args must not set {clashes}: the launcher sets them from the engine config "
                "(use the matching EngineConfig field instead)"
            )
        return args

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.ports and len(self.ports) != self.num_engines:
            raise ValueError(
                f"ports lists {len(self.ports)} ports for {self.num_engines} engines: give one per engine, or none"
            )
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch "
                f"({self.max_loras_per_batch}): SGLang refuses to start otherwise"
            )
        return self

    def port_for(self, index: int) -> int:
        """The configured port of engine `index` (0 = pick a free one)."""
        return self.ports[index] if self.ports else 0

    # The engines' dtype has this one home: the launcher passes `server_dtype_flag` and the publish
    # resolves `served_dtype` from it, so the two cannot disagree.
    def server_dtype_flag(self, device: Literal["cuda", "cpu"]) -> str | None:
        """The --dtype the launcher passes (rollout.engines.sglang_cpu.build_server_launch): engines.dtype when
        it names one; for auto, float32 on CPU (SGLang's own auto picks float16 there) and none on
        GPU (SGLang's auto: the checkpoint's dtype)."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if device == "cpu" else None

    def served_dtype(self, device: Literal["cuda", "cpu"], model_path: str | Path) -> str:
        """The dtype ('float32' | 'bfloat16' | 'float16') the servers on `device` hold the model and
        every loaded adapter in."""
        flag = self.server_dtype_flag(device)
        return checkpoint_serving_dtype(model_path) if flag is None else SGLANG_DTYPES[flag.lower()]

    def resolved_publish_dtype(self, device: Literal["cuda", "cpu"], model_path: str | Path) -> str:
        """publish_dtype with auto resolved: the dtype the handoff folders are written in."""
        return self.served_dtype(device, model_path) if self.publish_dtype == "auto" else self.publish_dtype


class DataConfig(StrictModel):
    """An adapter's prompt dataset (RL)."""

    path: str = Field(description="A .jsonl file (one JSON object per line) or a .parquet file.")
    input_key: str = Field("prompt", min_length=1, description="Key of the prompt: a string, or a list of chat messages.")
    label_key: str | None = Field("label", description="Key of the label passed to the reward; null = no label.")
    metadata_key: str | None = Field("metadata", description="Key of an optional per-row metadata object; null = none.")
    apply_chat_template: bool = Field(
        True,
        description="Render string prompts as one user message with the tokenizer's chat template. "
        "Prompts that are message lists are always rendered with it.",
    )
    shuffle_seed: int | None = Field(0, description="Seed of the per-epoch shuffle; null = file order every epoch.")
    num_epochs: int | None = Field(None, ge=1, description="Passes over the data before the source reports exhaustion; null = endless.")
    # Limits (the service fills them in at registration; see service.control.config_checks). Null = none.
    max_row_bytes: int | None = Field(None, ge=1, description="Skip (and count) lines longer than this many bytes, without loading them.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Skip (and count) rows whose prompt (after the chat template) has more tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="SFT: skip (and count) rows whose completion (+ EOS) has more tokens.")
    max_sample_tokens: int | None = Field(None, ge=1, description="Skip (and count) rows whose prompt + completion has more tokens.")

    @field_validator("path")
    @classmethod
    def _known_suffix(cls, path: str) -> str:
        if not (path.endswith(".jsonl") or path.endswith(".parquet")):
            raise ValueError(f"data file {path!r} must end in .jsonl or .parquet")
        return path


class RewardConfig(StrictModel):
    """An adapter's reward: a built-in name or a custom function by dotted path."""

    name: str = Field(
        min_length=1,
        description="Built-in: math, exact_match, target_share. Custom: 'package.module:function' or "
        "'package.module.function', under one of RolloutConfig.reward_import_roots.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments given to every call (JSON values; numbers finite).")

    @field_validator("kwargs")
    @classmethod
    def _finite_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return _finite(kwargs)


class RolloutSpec(StrictModel):
    """An adapter's rollout: how the trajectories of one prompt are made (rollout/rollouts.py).

    Built-in: ``single_turn`` (one completion per sample, scored by the adapter's reward: GRPO).
    Custom, by import path under one of RolloutConfig.rollout_import_roots: an environment class
    (reset/step, rollout/environment.py; one instance per trajectory) or an async rollout function
    ``fn(ctx, task, **kwargs) -> list[Trajectory]`` (ctx: rollout/context.py). The budgets bound
    every trajectory, so one tenant's agent cannot stall the others."""

    name: str = Field(
        min_length=1,
        description="Built-in: single_turn. Custom: 'package.module:EnvClass' (an environment with reset and step) or "
        "'package.module:rollout_fn' (an async rollout function), under one of rollout_import_roots.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments given to the environment's constructor or to every call of the rollout function "
        "(JSON values; numbers finite).",
    )
    max_turns: int = Field(
        8, ge=1, le=1024,
        description="Environments: model turns per trajectory at most; a trajectory that reaches it ends there "
        "(truncated) and is trained on with the rewards it got.",
    )
    max_tokens: int | None = Field(
        None, ge=2,
        description="Token budget of one trajectory: prompt + every model and environment turn. Each turn's "
        "max_new_tokens is cut to what is left; a trajectory with nothing left ends (truncated). Default: the model's "
        "context (filled in at registration); more than sampling.max_new_tokens, and rows are read with room for one "
        "turn (data.max_prompt_tokens at most max_tokens - sampling.max_new_tokens).",
    )
    timeout_s: float = Field(
        300.0, gt=0, le=86400,
        description="Time budget of one prompt's trajectories (seconds, from the first request to the last step): a "
        "group past it is aborted, counted (groups_dropped_timeout) and dropped, never trained on.",
    )
    max_failures_in_a_row: int = Field(
        8, ge=1, le=10_000,
        description="Groups in a row whose rollout raised, returned something invalid or timed out before the adapter "
        "stops generating and its run FAILS with the last reason.",
    )

    @field_validator("kwargs")
    @classmethod
    def _finite_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return _finite(kwargs)


class SamplingConfig(StrictModel):
    """How an adapter's rollouts are sampled."""

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = no top-k cut.")
    max_new_tokens: int = Field(64, ge=1, le=32768)
    n_samples_per_prompt: int = Field(4, ge=1, le=1024, description="Group size: responses per prompt.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (in addition to EOS).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS up to max_new_tokens (benchmarks and tests; RL stops at EOS).")

    def sglang_params(self) -> dict[str, Any]:
        """The sampling_params dict of one SGLang /generate request."""
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.ignore_eos:
            params["ignore_eos"] = True
        return params


class RolloutConfig(StrictModel):
    """Bounds of the rollout worker."""

    max_inflight_per_adapter: int = Field(64, ge=1, description="Requests (samples) in flight for one adapter.")
    max_inflight_total: int = Field(256, ge=1, description="Requests in flight over all adapters.")
    max_staleness: int = Field(
        1, ge=0, description="Drop groups generated by a version more than this many versions behind the newest."
    )
    max_buffered_groups_per_adapter: int = Field(
        64, ge=1, description="Stop starting new groups for an adapter while this many wait to be trained on."
    )
    reward_import_roots: list[str] = Field(
        default_factory=list, description="Package prefixes custom rewards may be imported from (e.g. 'myorg.rewards')."
    )
    rollout_import_roots: list[str] = Field(
        default_factory=list,
        description="Package prefixes custom rollouts (environments, rollout functions) may be imported from (e.g. 'myorg.envs').",
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="A reward call running longer is a recorded failure, reward 0.")
    max_rejections_in_a_row: int = Field(
        8, ge=1, description="An adapter whose requests the engines refuse (HTTP 4xx, e.g. a prompt longer than the "
        "context) this many times in a row stops generating and reports a fatal_reason (the service fails the run).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.max_inflight_per_adapter > self.max_inflight_total:
            raise ValueError(
                f"max_inflight_per_adapter ({self.max_inflight_per_adapter}) must be <= max_inflight_total "
                f"({self.max_inflight_total})"
            )
        return self
