"""The job file: `JobConfig` (base model, placement, slots, trainer, engines, rollout, service and
the adapters to run) and `load_job(path)`, which validates it once, with errors that name the
field. A tenant's run config is service/config/adapter.py; the service settings are
service/config/settings.py. All models forbid unknown fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from rollout.config import EngineConfig, RolloutConfig
from service.config.adapter import AdapterSpec, rebase_path
from service.config.placement import PlacementConfig
from service.config.ray import RayConfig
from service.config.settings import ConfigError, ServiceSettings, format_validation_error, is_loopback_host, load_settings
from trainer.config import TARGET_GROUPS, TargetGroup, TrainerConfig
from trainer.strict_model import StrictModel
from trainer.platform.model_folder import read_model_config

# --- the job file --------------------------------------------------------------------------------


# A served base-model name: a Hugging Face hub id ("org/model") or one plain name.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"


class BaseModelSpec(StrictModel):
    """The frozen base model every adapter trains against."""

    path: str = Field(description="Hugging Face model folder (config.json, weights, tokenizer).")
    served_name: str | None = Field(None, pattern=SERVED_NAME_PATTERN, examples=["Qwen/Qwen3-8B"], description="The name clients use for the base model: the Tinker API's `base_model` (create_model, get_server_capabilities, get_info) and the tokenizer id it tells clients (loaded offline by that name from a Hugging Face cache; tinker_tokenizer_id overrides it). A Hugging Face hub id ('org/model') lets name-based clients (tinker-cookbook's renderer lookup) work. Default: the folder's name.")

    rebase_path_path = field_validator("path")(rebase_path)

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
            path = rebase_path(base["path"], info)
            given = sections["trainer"].get("base_model_path")
            if given is not None and rebase_path(given, info) != path:
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
