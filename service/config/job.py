"""The one typed config tree of lorafleet.

* `AdapterConfig`: a tenant's run config (the `config` of `POST /v1/adapters`
  and of each entry of a job file's `adapters:` list), documented field by field;
  the OpenAPI schema at /docs is generated from these descriptions.
* `ServiceSettings`: the service's own settings, from the environment
  (prefix `LORAFLEET_`), an optional YAML settings file, or explicit values.
* `JobConfig`: the batch/service YAML job file; `load_job(path)` validates it
  once, with errors that name the field.

Only shape and value-range checks live here. Checks that need the filesystem
or the service's limits (data file exists and has the keys, paths confined to
the allowed roots, rank <= the trainer's max rank, reward importable) live in
`service.control.config_checks.check_adapter_config`, which the controller calls at
registration. All models forbid unknown fields, so a typo is an error naming
the field rather than a silently ignored setting.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from rollout.config import ADAPTER_NAME_PATTERN, DataConfig, EngineConfig, RewardConfig, RolloutConfig, RolloutSpec, SamplingConfig
from rollout.tenant_code import is_import_path
from service.config.placement import PlacementConfig
from service.config.quotas import Quotas
from service.config.ray import RayConfig
from trainer.config import TARGET_GROUPS, Objective, SlotHyperParams, StrictModel, TargetGroup, TrainerConfig
from trainer.platform.model_folder import read_model_config

AdapterName = Annotated[
    str,
    Field(
        pattern=ADAPTER_NAME_PATTERN,
        description="Adapter name: 1-64 characters, letters, digits, '.', '_' or '-', starting with a letter or digit.",
        examples=["digits"],
    ),
]


def _rebase(path: str | None, info: ValidationInfo) -> str | None:
    """Relative paths in a job file are relative to the job file's folder
    (load_job passes it as validation context); elsewhere they stay as given.
    The joined path is normalized: a job file may reach up ("../data/x.jsonl"), and
    the registration checks refuse any path that still holds a '..' component."""
    base = (info.context or {}).get("base_dir")
    if path is None or base is None or Path(path).is_absolute():
        return path
    return os.path.normpath(Path(base) / path)


class DataSpec(StrictModel):
    """Where an adapter's prompts (RL) or prompt/completion pairs (SFT) come from."""

    path: str = Field(description="Data file on the service host (.jsonl, one JSON object per line, or .parquet), inside an allowed data root. Relative paths: against the first data root (REST) or the job file's folder (job file).")
    input_key: str = Field("prompt", min_length=1, description="Key of the prompt text in each row.")
    label_key: str | None = Field(None, description="Key of the label (RL: passed to the reward) or of the target completion (SFT). Default: 'label' for rl, 'completion' for sft.")
    metadata_key: str | None = Field("metadata", description="Key of an optional per-row metadata object passed to the reward; null for none.")
    apply_chat_template: bool = Field(True, description="Wrap the prompt as a user message with the base model tokenizer's chat template.")
    # Length limits: rows over one are skipped and counted (metrics rows_skipped_*), never sent to an
    # engine or a train call. Registration fills each with the service's limit (GET /v1/adapters/{name}
    # shows them); a tenant may ask for lower ones.
    max_row_bytes: int | None = Field(None, ge=1, description="Skip lines longer than this many bytes (default and maximum: the service's max_row_bytes).")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Skip rows whose prompt (after the chat template) is longer, in tokens. Default and maximum: the service's max_prompt_tokens, and for rl the model's context minus sampling.max_new_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="SFT only: skip rows whose completion (+ EOS) is longer, in tokens (default and maximum: the service's max_completion_tokens). RL completions are bounded by sampling.max_new_tokens.")
    max_sample_tokens: int | None = Field(None, ge=1, description="Skip rows whose prompt + completion is longer, in tokens (default and maximum: the model's context).")

    _rebase_path = field_validator("path")(_rebase)


class AdapterConfig(StrictModel):
    """A tenant's adapter run: what to train, on what, and for how long."""

    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r; must not exceed the service's max rank (GET /ready shows it).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    learning_rate: float = Field(1e-4, gt=0, le=1.0, description="Peak learning rate (Adam).")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warm-up: constant, or cosine decay to min_lr_ratio * learning_rate at the last step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to learning_rate.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine schedule only: final learning rate as a fraction of learning_rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay (AdamW).")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas (beta1, beta2), each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0, le=1.0, description="AdamW's epsilon (added to the root of the second moment).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip this adapter's gradient to this global norm; null = no clipping.")
    objective: Objective = Field("rl", description="rl: GRPO-style group rollouts scored by `reward`; sft: supervised prompt/completion pairs, no rollout.")
    data: DataSpec = Field(description="The adapter's data source.")
    reward: RewardConfig | None = Field(None, description="RL only: the reward function, a builtin name or 'package.module:function' under an allowed import root. Required unless `rollout` names a custom rollout (which then computes its own rewards, and may use this one).")
    rollout: RolloutSpec | None = Field(None, description="RL only: how a prompt's trajectories are made: a multi-turn environment or an async rollout function by import path under an allowed rollout import root, with per-trajectory time and token budgets (docs/environments.md). Default: the built-in single_turn (one completion per sample, scored by `reward`).")
    prompts_per_step: int = Field(4, ge=1, le=65536, description="Prompts (RL) or examples (SFT) per optimizer step of this adapter.")
    num_step: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (the data repeats until then). At most one of num_step and num_epoch; neither = one epoch.")
    num_epoch: int | None = Field(None, ge=1, description="Stop after this many passes over the data: (rows x num_epoch) // prompts_per_step steps (the passes run on into each other; a final part shorter than a step is dropped).")
    max_staleness: int = Field(1, ge=0, le=1000, description="RL: drop rollout groups generated by weights more than this many versions behind the adapter's newest.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="RL: generation parameters, including n_samples_per_prompt (the group size for group-relative advantages; at least 2 for rl).")
    init_from: str | None = Field(None, description="Start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors, same rank), inside an allowed data root or the state dir.")
    resume_from: str | None = Field(None, description="Resume this run from a lorafleet checkpoint folder (weights, optimizer, step, scheduler, data cursor, seeds), inside an allowed data root or the state dir.")
    checkpoint_interval: int = Field(10, ge=0, description="Save a checkpoint every this many steps; 0 = only at retirement.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for the adapter's initial weights, data order and sampling.")
    lora_experts: bool = Field(True, description="MoE bases: LoRA on every routed expert as well as on attention; false = attention only (servable by SGLang on CPU). No effect on a dense base.")
    target_modules: list[TargetGroup] = Field(
        ["attention", "mlp"],  # pydantic copies a mutable default per instance
        description="What the adapter trains: any non-empty set of attention (q/k/v/o_proj), mlp (gate/up/down_proj, and the routed experts of an MoE base with lora_experts) and unembed (the output projection, lm_head; with tied embeddings the LoRA is on the output projection only). The exported PEFT folder lists the HF modules. A target off has exactly zero LoRA.",
    )

    _rebase_paths = field_validator("init_from", "resume_from")(_rebase)

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError(f"target_modules {list(v)} invalid: need a non-empty set without repeats of "
                             f"{', '.join(TARGET_GROUPS)}")
        return [g for g in TARGET_GROUPS if g in v]  # one order: what the trainer and the export use

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"adam_betas {list(v)}: each must be in [0, 1)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _default_label_key(cls, data: Any) -> Any:
        # label_key's default depends on the objective; fill it here so the stored
        # config is explicit about which key the run reads.
        if isinstance(data, dict) and isinstance(data.get("data"), dict) and data["data"].get("label_key") is None:
            objective = data.get("objective", "rl")
            data = {**data, "data": {**data["data"], "label_key": "completion" if objective == "sft" else "label"}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AdapterConfig:
        if self.num_step is not None and self.num_epoch is not None:
            raise ValueError("set at most one of num_step and num_epoch (got both)")
        if self.init_from is not None and self.resume_from is not None:
            raise ValueError("set at most one of init_from and resume_from: a checkpoint already holds the weights")
        if self.objective == "rl":
            if self.reward is None and not self.custom_rollout:
                raise ValueError("objective 'rl' needs a reward, e.g. {\"name\": \"target_share\"} (or a custom rollout that computes its own)")
            if self.sampling.n_samples_per_prompt < 2:
                raise ValueError("objective 'rl' needs sampling.n_samples_per_prompt >= 2: group-relative advantages of a group of one are always zero")
        elif self.reward is not None:
            raise ValueError("reward applies only to objective 'rl'; remove it for 'sft'")
        elif self.rollout is not None:
            raise ValueError("rollout applies only to objective 'rl'; remove it for 'sft'")
        if self.objective == "rl" and self.data.max_completion_tokens is not None:
            raise ValueError("data.max_completion_tokens applies only to objective 'sft'; rl completions are bounded by sampling.max_new_tokens")
        try:  # the rollout side's own data checks (file formats it can read), once, here
            self.data_config()
        except ValidationError as e:
            raise ValueError("; ".join(str(err["ctx"]["error"]) if "ctx" in err else err["msg"] for err in e.errors())) from None
        return self

    @property
    def custom_rollout(self) -> bool:
        """Whether `rollout` names tenant code (an import path) rather than a built-in."""
        return self.rollout is not None and is_import_path(self.rollout.name)

    @property
    def samples_per_step(self) -> int:
        """Samples in one optimizer step: prompts x group size (rl), examples (sft)."""
        return self.prompts_per_step * (self.sampling.n_samples_per_prompt if self.objective == "rl" else 1)

    def slot_hyper_params(self, total_steps: int | None) -> SlotHyperParams:
        """The trainer's view of this run (trainer.config.SlotHyperParams); knobs the
        tenant config does not expose (RL clipping, KL, loss normalization) keep the
        trainer's defaults."""
        return SlotHyperParams(
            rank=self.rank,
            alpha=self.alpha,
            lr=self.learning_rate,
            lr_schedule=self.lr_schedule,
            warmup_steps=self.warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=self.min_lr_ratio,
            weight_decay=self.weight_decay,
            betas=self.adam_betas,
            eps=self.adam_eps,
            max_grad_norm=self.max_grad_norm,
            samples_per_step=self.samples_per_step,
            objective=self.objective,
            lora_experts=self.lora_experts,
            targets=tuple(self.target_modules),
        )

    def data_config(self) -> DataConfig:
        """The rollout side's view of this run's data: shuffle seeded by `seed`;
        epochs bounded by num_epoch (neither budget set = one epoch; num_step = endless,
        the loop stops at the step count)."""
        epochs = self.num_epoch if self.num_epoch is not None else (None if self.num_step is not None else 1)
        return DataConfig(**self.data.model_dump(), shuffle_seed=self.seed, num_epochs=epochs)


class AdapterSpec(StrictModel):
    """One adapter run to register: its name and its config (REST body and job-file entry)."""

    name: AdapterName
    config: AdapterConfig


def _split_list(value: Any) -> Any:
    # Environment values: a JSON list, or entries separated by os.pathsep / commas.
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [p for p in re.split(rf"[{re.escape(os.pathsep)},]", text) if p]
    return value


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MIN_TOKEN_CHARS_OFF_LOOPBACK = 16


def api_token_problem(host: str, token: str | None) -> str | None:
    """Why `token` cannot protect an API bound to `host`, or None. A token that is set must not be
    blank; off loopback one is required, of at least MIN_TOKEN_CHARS_OFF_LOOPBACK characters
    (whitespace around it does not count: it is stripped)."""
    if token is not None and not token.strip():
        return "api_token is blank (only whitespace); set a real token or leave it unset"
    if is_loopback_host(host):
        return None
    if token is None:
        return (f"host {host!r} is not a loopback address, so an API token is required: set LORAFLEET_API_TOKEN "
                f"(or api_token in the settings file) to at least {MIN_TOKEN_CHARS_OFF_LOOPBACK} characters, or bind to 127.0.0.1")
    if len(token.strip()) < MIN_TOKEN_CHARS_OFF_LOOPBACK:
        return (f"host {host!r} is not a loopback address and the API token has only {len(token.strip())} characters; "
                f"use at least {MIN_TOKEN_CHARS_OFF_LOOPBACK} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), "
                "or bind to 127.0.0.1")
    return None


class ServiceSettings(BaseSettings):
    """Settings of the running service. Sources, highest first: explicit values,
    environment (LORAFLEET_*), the settings file (LORAFLEET_SETTINGS_FILE), defaults."""

    model_config = SettingsConfigDict(env_prefix="LORAFLEET_", extra="forbid", frozen=True, allow_inf_nan=False)

    api_token: SecretStr | None = Field(None, description="Bearer token clients must send (surrounding whitespace stripped); required when host is not a loopback address, and then at least 16 characters.")
    host: str = Field("127.0.0.1", description="Address the REST API binds to.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of the REST API (0 = any free port).")
    state_dir: Path = Field(Path("runs/service"), description="Folder for the registry database, checkpoints and exports.")
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd()], description="Folders that adapter data, init_from and resume_from must lie in (state_dir is also allowed for init_from/resume_from).")
    reward_import_roots: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Python package prefixes custom reward functions may be imported from (e.g. 'myorg.rewards'); builtin rewards are always allowed.")
    rollout_import_roots: Annotated[list[str], NoDecode] = Field(default_factory=list, description="Python package prefixes custom rollouts (environment classes, async rollout functions; an adapter's config.rollout) may be imported from (e.g. 'myorg.envs'); the built-in single_turn is always allowed.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body the API accepts (bytes); larger ones get 413.")
    # Length limits of every adapter's rows (issue 14: one tenant's long rows must not stall the fleet).
    max_row_bytes: int = Field(1 << 20, ge=1024, description="Longest line of a data file (bytes); longer lines are skipped and counted, never loaded.")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest prompt (tokens, after the chat template); longer rows are skipped and counted.")
    max_completion_tokens: int = Field(8192, ge=1, description="Longest completion (tokens): SFT rows with a longer one are skipped; an rl sampling.max_new_tokens above it is refused.")
    max_step_tokens: int = Field(1 << 21, ge=1, description="Per-step token budget of one adapter: samples per step x the longest sample it may have (prompt + completion limits, the model's context) must not exceed it, checked at registration; bounds what one tenant adds to a mixed train call.")
    data_check_bytes: int = Field(64 << 20, ge=1024, description="Registration reads at most this many bytes of a data file to check its rows (a bounded prefix).")
    data_check_s: float = Field(10.0, gt=0, description="Registration spends at most this many seconds checking a data file; rows beyond are counted from the file size.")
    controller_timeout_s: float = Field(30.0, gt=0, description="Timeout of one API -> controller call (seconds).")
    quotas: Quotas = Field(default_factory=Quotas, description="Per-tenant quotas: live and queued runs per tenant key (429 beyond), a share of trained tokens, a priority (service/config/quotas.py).")
    metrics_adapter_series: Literal["none", "top", "all"] = Field("top", description="Per-adapter series of /metrics: none, the metrics_top_k adapters updated most recently (top: a step or a state change), or every adapter (all: one series per adapter name ever registered).")
    metrics_top_k: int = Field(20, ge=1, le=10_000, description="With metrics_adapter_series 'top': how many adapters get per-adapter series.")
    read_cache_s: float = Field(1.0, ge=0, le=60, description="GET /v1/adapters, /metrics and /v1/fleet/stats: concurrent identical requests share one answer, and requests within this many seconds of it get the same answer (steps and states the loop changes show within it; the caller's own writes at once). 0 = share only among concurrent requests.")
    read_stale_s: float = Field(2.0, ge=0, le=60, description="GET /v1/adapters, /metrics and /v1/fleet/stats: an answer older than read_cache_s, but by at most this many seconds more, is sent at once while one new answer is built in the background (a burst of readers waits for no build; what the loop changes shows within read_cache_s + read_stale_s). 0 = always wait for the new answer.")
    api_front: bool = Field(True, description="Serve the API through a front process of its own (api/front/read_front.py) that answers the polled reads (GET /v1/adapters, /metrics, /v1/fleet/stats) from its cache and passes every other request to the coordinator, so reads never take the training loop's interpreter. False: the coordinator serves host:port itself.")
    settings_file: Path | None = Field(None, description="YAML file with any of these settings (lower priority than the environment).")
    # The Tinker API (docs/tinker.md): served under /api/v1 only when a keys file is given.
    tinker_keys_file: Path | None = Field(None, description="YAML file of 'tenant: key' lines (keys start with 'tml-'); when set, the service also serves the Tinker API under /api/v1.")
    tinker_window_ms: float = Field(20.0, ge=0, le=10_000, description="Tinker: pending forward_backward calls of different models arriving within this window run as one mixed pass (milliseconds).")
    tinker_session_timeout_s: float = Field(300.0, gt=0, description="Tinker: a session without a heartbeat for this long has its models saved and their trainer slots freed (seconds).")
    tinker_max_seq_len: int = Field(4096, ge=1, description="Tinker: longest model_input of one datum (tokens); longer ones are refused in the future's result.")
    tinker_tokenizer_id: str | None = Field(None, description="Tinker: the tokenizer id get_info tells clients (the SDK's get_tokenizer loads it with AutoTokenizer), e.g. the base model's Hugging Face hub id. Default: base_model.served_name when the job file sets it, else the base model's folder, which responses show cut to its last part (server paths are never shown), so clients off this machine need this set.")
    tinker_max_body_bytes: int = Field(64 << 20, ge=8 << 20, description="Largest request body of the Tinker API's data-carrying routes (forward, forward_backward); at least 8 MiB.")

    _split = field_validator("data_roots", "reward_import_roots", "rollout_import_roots", mode="before")(lambda cls, v: _split_list(v))

    @field_validator("api_token", mode="after")
    @classmethod
    def _strip_token(cls, token: SecretStr | None) -> SecretStr | None:
        # Clients send the token in a header, where surrounding whitespace does not survive.
        return None if token is None else SecretStr(token.get_secret_value().strip())

    @model_validator(mode="after")
    def _token_off_loopback(self) -> ServiceSettings:
        problem = api_token_problem(self.host, self.api_token.get_secret_value() if self.api_token is not None else None)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def db_path(self) -> Path:
        return self.state_dir / "registry.sqlite3"

    @property
    def tinker_dir(self) -> Path:
        """Tinker checkpoints (save_state, save_weights_for_sampler), one folder per tenant below."""
        return self.state_dir / "tinker"


class ConfigError(ValueError):
    """A job or settings file that does not validate; the message lists every bad field."""


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        got = "" if e["type"] in ("missing", "model_type") else f" (got {e.get('input')!r})"
        lines.append(f"{loc or '<root>'}: {e['msg']}{got}")
    return "\n".join(lines)


def load_settings(settings_file: Path | None = None, *, base: dict[str, Any] | None = None, **explicit: Any) -> ServiceSettings:
    """Settings with the documented precedence: explicit > environment > file > base > defaults.

    The file is `settings_file`, else $LORAFLEET_SETTINGS_FILE, else none; `base`
    is a job file's `service:` section."""
    # Raw environment values (validated below, together with everything else).
    env_values = EnvSettingsSource(ServiceSettings, env_prefix="LORAFLEET_")()
    path = settings_file or explicit.get("settings_file") or env_values.get("settings_file")
    file_values: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read settings file {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"settings file {path}: expected a mapping of setting names to values, got {type(loaded).__name__}")
        file_values = loaded
    # The final constructor call would read the environment again with lower
    # priority than its arguments, so pass the environment explicitly.
    try:
        return ServiceSettings(**{**(base or {}), **file_values, **env_values, **explicit, "settings_file": path})
    except ValidationError as e:
        raise ConfigError(f"invalid service settings:\n{format_validation_error(e)}") from None


# --- the job file --------------------------------------------------------------------------------


# A served base-model name: a Hugging Face hub id ("org/model") or one plain name.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"


class BaseModelSpec(StrictModel):
    """The frozen base model every adapter trains against."""

    path: str = Field(description="Hugging Face model folder (config.json, weights, tokenizer).")
    served_name: str | None = Field(None, pattern=SERVED_NAME_PATTERN, examples=["Qwen/Qwen3-8B"], description="The name clients use for the base model: the Tinker API's `base_model` (create_model, get_server_capabilities, get_info) and the tokenizer id it tells clients (loaded offline by that name from a Hugging Face cache; tinker_tokenizer_id overrides it). A Hugging Face hub id ('org/model') lets name-based clients (tinker-cookbook's renderer lookup) work. Default: the folder's name.")

    _rebase_path = field_validator("path")(_rebase)

    @property
    def name(self) -> str:
        """What clients call the base model: ``served_name``, else the folder's last part
        (the service never shows its paths)."""
        return self.served_name or Path(self.path).name


# Default bound on live runs (queued and evicted included): DEFAULT_MAX_LIVE_RUNS, or this many per
# trainer slot where that is more (the coordinator's memory per tenant: benchmarks/bench_scale_cpu.py
# measures it); per-key bounds are the quotas (service/config/quotas.py).
DEFAULT_MAX_LIVE_RUNS = 4096
DEFAULT_LIVE_RUNS_PER_SLOT = 4


def default_live_runs(num_slots: int) -> int:
    return max(DEFAULT_MAX_LIVE_RUNS, DEFAULT_LIVE_RUNS_PER_SLOT * num_slots)


class SlotCapacity(StrictModel):
    """What the trainer holds resident; the controller enforces it at registration.
    In a job file this is the `slots:` section, and the trainer's num_slots/max_rank
    are taken from it."""

    num_slots: int = Field(4, ge=1, le=1024, description="Adapter slots resident on the trainer; live runs beyond them wait in a queue (see max_live_runs).")
    max_rank: int = Field(16, ge=1, le=1024, description="Largest LoRA rank a slot holds.")
    max_live_runs: int | None = Field(None, ge=1, description="Most adapter runs live at once (resident, queued for a slot, or evicted), every tenant together; registrations beyond get 409 (per-tenant bounds: the service's quotas, 429). Default: 4,096, or 4 x num_slots where that is more; at least num_slots.")
    evict_idle_s: float = Field(30.0, gt=0, description="While runs wait for a slot, a resident run with no ready step that has not stepped for this many seconds is swapped out (keep-warm eviction, least recently active first).")
    turn_steps: int = Field(4, ge=1, description="While runs wait for a slot, a resident run that has taken this many steps since it came in gives its slot up at the next round boundary (turns: none waits forever).")

    @model_validator(mode="after")
    def _live_runs_cover_slots(self) -> SlotCapacity:
        if self.max_live_runs is not None and self.max_live_runs < self.num_slots:
            raise ValueError(f"max_live_runs ({self.max_live_runs}) must be >= num_slots ({self.num_slots}): every slot may hold a live run")
        return self

    @property
    def live_run_bound(self) -> int:
        """The bound in force: max_live_runs, or its default (default_live_runs)."""
        return self.max_live_runs if self.max_live_runs is not None else default_live_runs(self.num_slots)
    context_tokens: int | None = Field(None, ge=2, description="Longest sample (prompt + completion, tokens) engines and trainer take. Default: the base model's max_position_embeddings (config.json); set it lower when the engines run with a shorter --context-length.")
    rl_expert_lora: bool = Field(True, description="Whether RL adapters may train expert LoRA (lora_experts: true). The service sets it false on an MoE base on a cpu placement (SGLang serves expert LoRA only on CUDA); a job file may only turn it off.")
    target_groups: list[TargetGroup] = Field(list(TARGET_GROUPS), description="What adapters may train (their target_modules). The service sets it from trainer.target_modules (unembed needs output_layer there, which is the default); a job file may only narrow it.")
    rl_unembed_lora: bool = Field(True, description="Whether RL adapters may train the unembedding (target_modules: unembed): the engines must load LoRA on lm_head. The service sets it false when engines.lora_target_modules names neither all nor lm_head; a job file may only turn it off.")


def model_context_tokens(model_path: str | Path) -> int | None:
    """The base model's context in tokens (config.json max_position_embeddings, also under text_config); None if unknown."""
    try:
        cfg = read_model_config(model_path)
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value >= 2:
            return value
    return None


# Facts the job file states once, and the trainer/engine fields derived from them:
# (section, field) <- (source section, source field). A job file that also sets the
# derived field to a different value is refused, naming both places.
_DERIVED_FIELDS = (
    ("trainer", "num_slots", "slots", "num_slots"),
    ("trainer", "max_rank", "slots", "max_rank"),
    ("trainer", "tp", "placement.trainer", "tensor_parallel"),
    ("trainer", "dp", "placement.trainer", "data_parallel"),
    ("engines", "num_engines", "placement.engines", "count"),
    ("engines", "tp", "placement.engines", "tensor_parallel"),
)


class JobConfig(StrictModel):
    """A lorafleet job file: base model, placement, slots, trainer, engines, rollout, service and the adapters to run."""

    base_model: BaseModelSpec
    ray: RayConfig = Field(default_factory=RayConfig, description="Which Ray cluster to run on: a cluster joined on purpose, else a private local Ray.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Which devices engines and trainer get.")
    slots: SlotCapacity = Field(default_factory=SlotCapacity, description="Resident adapter slots and their max rank.")
    trainer: TrainerConfig = Field(description="Trainer settings; base_model_path, num_slots, max_rank, tp and dp come from base_model, slots and placement.")
    engines: EngineConfig = Field(default_factory=EngineConfig, description="SGLang rollout engines; num_engines and tp come from placement.engines.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Bounds of the rollout worker.")
    service: dict[str, Any] = Field(default_factory=dict, description="ServiceSettings values; the environment overrides them.")
    adapters: list[AdapterSpec] = Field(default_factory=list, description="Adapter runs registered at start.")

    @model_validator(mode="before")
    @classmethod
    def _derive_once_stated_facts(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        try:
            sources = {
                "slots": SlotCapacity.model_validate(data.get("slots") or {}).model_dump(),
                "placement.trainer": PlacementConfig.model_validate(data.get("placement") or {}).trainer.model_dump(),
                "placement.engines": PlacementConfig.model_validate(data.get("placement") or {}).engines.model_dump(),
            }
        except ValidationError:
            return data  # the field validation reports it, naming the field
        sections = {name: dict(data.get(name) or {}) for name in ("trainer", "engines")}
        base = data.get("base_model")
        if isinstance(base, dict) and isinstance(base.get("path"), str):
            path = _rebase(base["path"], info)
            given = sections["trainer"].get("base_model_path")
            if given is not None and _rebase(given, info) != path:
                raise ValueError(f"trainer.base_model_path ({given}) disagrees with base_model.path ({base['path']}); state it once, in base_model.path")
            sections["trainer"]["base_model_path"] = path
        for section, key, source, source_key in _DERIVED_FIELDS:
            value = sources[source][source_key]
            given = sections[section].get(key)
            if given is not None and given != value:
                raise ValueError(f"{section}.{key} ({given}) disagrees with {source}.{source_key} ({value}); state it once, in {source}")
            sections[section][key] = value
        return {**data, **sections}

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(dupes)}")
        if len(self.adapters) > self.slots.live_run_bound:
            raise ValueError(f"{len(self.adapters)} adapters but at most {self.slots.live_run_bound} live runs "
                             f"(slots.max_live_runs; {self.slots.num_slots} slots, the rest wait in the queue)")
        if self.engines.max_lora_rank < self.slots.max_rank:
            raise ValueError(
                f"engines.max_lora_rank ({self.engines.max_lora_rank}) must be >= slots.max_rank ({self.slots.max_rank}): "
                "the engines could not load an adapter of the largest rank the trainer accepts"
            )
        for roots, given in (("reward_import_roots", self.rollout.reward_import_roots),
                             ("rollout_import_roots", self.rollout.rollout_import_roots)):
            if given:
                raise ValueError(
                    f"rollout.{roots} is taken from the service settings: set service.{roots} "
                    f"(or LORAFLEET_{roots.upper()}), the one place both the registration check and the rollout worker read"
                )
        too_big = [f"{a.name} (rank {a.config.rank})" for a in self.adapters if a.config.rank > self.slots.max_rank]
        if too_big:
            raise ValueError(f"adapter rank above slots.max_rank {self.slots.max_rank}: {', '.join(too_big)}")
        unembed_rl = [a.name for a in self.adapters if a.config.objective == "rl" and "unembed" in a.config.target_modules]
        if unembed_rl and not _engines_serve_lm_head(self.engines):
            raise ValueError(
                f"RL adapters {', '.join(unembed_rl)} train the unembedding (target_modules: unembed), which the engines "
                f"must serve, but engines.lora_target_modules {self.engines.lora_target_modules} has neither all nor "
                "lm_head: add lm_head there, or drop unembed from those adapters' target_modules"
            )
        untrainable = [f"{a.name} ({g})" for a in self.adapters for g in a.config.target_modules
                       if g not in self.trainer.target_groups]
        if untrainable:
            raise ValueError(
                f"adapters train targets the trainer has no LoRA layers for: {', '.join(untrainable)}; trainer.target_modules "
                f"{list(self.trainer.target_modules)} allows {list(self.trainer.target_groups)} (unembed needs output_layer)"
            )
        served_experts = [a.name for a in self.adapters if a.config.objective == "rl" and a.config.lora_experts]
        if served_experts and self.placement.accelerator == "cpu" and _is_moe(self.base_model.path):
            raise ValueError(
                f"RL adapters {', '.join(served_experts)} train expert LoRA (lora_experts: true) on an MoE base, but "
                "SGLang 0.5.23 serves expert LoRA only on CUDA: on a cpu placement set lora_experts: false for RL "
                "adapters (SFT adapters are not served and may keep it)"
            )
        return self

    @property
    def capacity(self) -> SlotCapacity:
        """The slots section, with the model's context filled in from the base model when not stated, and
        rl_expert_lora off where the engines cannot serve expert LoRA (what registration checks)."""
        update: dict[str, Any] = {}
        if self.slots.context_tokens is None:
            update["context_tokens"] = model_context_tokens(self.base_model.path)
        if self.slots.rl_expert_lora and self.placement.accelerator == "cpu" and _is_moe(self.base_model.path):
            update["rl_expert_lora"] = False
        groups = [g for g in self.slots.target_groups if g in self.trainer.target_groups]
        if groups != list(self.slots.target_groups):
            update["target_groups"] = groups
        if self.slots.rl_unembed_lora and not _engines_serve_lm_head(self.engines):
            update["rl_unembed_lora"] = False
        return self.slots.model_copy(update=update) if update else self.slots

    def rollout_config(self, settings: ServiceSettings) -> RolloutConfig:
        """The rollout worker's config, with the reward and rollout import roots of the running service."""
        return self.rollout.model_copy(update={"reward_import_roots": list(settings.reward_import_roots),
                                               "rollout_import_roots": list(settings.rollout_import_roots)})

    def engine_config(self, settings: ServiceSettings) -> EngineConfig:
        """The engines' config for a service bound to `settings.host`. The engines' only client is the
        rollout worker that starts them on its own node, so they bind to loopback unless the job names
        another interface in engines.host; a service on loopback keeps them there (a job that asks for
        another interface is refused: it would open ports the service itself does not)."""
        if is_loopback_host(settings.host) and not is_loopback_host(self.engines.host):
            raise ConfigError(
                f"engines.host {self.engines.host!r} is not a loopback address but the service binds to "
                f"{settings.host!r}: remove engines.host (engines then bind to 127.0.0.1) or bind the service elsewhere"
            )
        return self.engines

    def service_settings(self, **explicit: Any) -> ServiceSettings:
        """The job's service section under the usual precedence (explicit > env > this section)."""
        return load_settings(base=self.service, **explicit)


def _engines_serve_lm_head(engines: EngineConfig) -> bool:
    """Whether the SGLang engines load LoRA on lm_head (--lora-target-modules all or lm_head;
    SGLang 0.5.23 serves it, on the CPU torch_native backend too: docs/tinker.md)."""
    return bool({"all", "lm_head"} & set(engines.lora_target_modules))


def _is_moe(model_path: str) -> bool:
    """Whether the HF checkpoint's config.json describes routed experts (num_experts /
    num_local_experts > 0); False when the file cannot be read (the trainer reports that)."""
    try:
        cfg = read_model_config(model_path)
    except (OSError, ValueError):
        return False
    return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job file once. Relative paths in it are relative to its folder."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read job file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"job file {path} is not valid YAML: {e}") from None
    try:
        job = JobConfig.model_validate(raw, context={"base_dir": str(path.resolve().parent)})
    except ValidationError as e:
        raise ConfigError(f"job file {path} is invalid:\n{format_validation_error(e)}") from None
    try:
        settings = job.service_settings()  # validated now, with the environment it will run under
    except ConfigError as e:
        raise ConfigError(f"job file {path}: service section: {e}") from None
    try:
        job.engine_config(settings)
    except ConfigError as e:
        raise ConfigError(f"job file {path}: {e}") from None
    return job
