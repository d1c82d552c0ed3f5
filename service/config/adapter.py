"""A tenant's run config: `AdapterConfig` (the `config` of `POST /v1/adapters` and of each entry
of a job file's `adapters:` list), documented field by field (the OpenAPI schema at /docs is
generated from these descriptions), and `AdapterSpec` (a name and its config).

Only shape and value-range checks live here. Checks that need the filesystem or the service's
limits (data file exists and has the keys, paths confined to the allowed roots, rank <= the
trainer's max rank, reward importable) live in `service.control.config_checks.check_adapter_config`,
which the controller calls at registration. Unknown fields are refused, so a typo is an error
naming the field rather than a silently ignored setting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from rollout.config import ADAPTER_NAME_PATTERN, DataConfig, RewardConfig, RolloutSpec, SamplingConfig
from rollout.tenant_code import is_import_path
from trainer.config import TARGET_GROUPS, LossChoice, Objective, OptimizerStateDtype, SlotHyperParams, TargetGroup
from trainer.losses.table import LOSSES, resolve_loss
from trainer.strict_model import StrictModel

AdapterName = Annotated[
    str,
    Field(
        pattern=ADAPTER_NAME_PATTERN,
        description="Adapter name: 1-64 characters, letters, digits, '.', '_' or '-', starting with a letter or digit.",
        examples=["digits"],
    ),
]


def rebase_path(path: str | None, info: ValidationInfo) -> str | None:
    """Relative paths in a job file are relative to the job file's folder
    (load_job passes it as validation context); elsewhere they stay as given.
    The joined path is normalized: a job file may reach up ("../data/x.jsonl"), and
    the registration checks refuse any path that still holds a '..' component."""
    base = (info.context or {}).get("base_dir")
    if path is None or base is None or Path(path).is_absolute() or "://" in path:  # a URL (s3://) is not a file path
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

    _rebase_path = field_validator("path")(rebase_path)


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
    adam_state_dtype: OptimizerStateDtype = Field("float32", description="How AdamW's two moments are stored: float32 (exact) or bfloat16 (stochastically rounded after each fp32 update; a quarter less memory traffic in the optimizer step, and 12 instead of 16 bytes per parameter while the adapter is swapped out: docs/operations.md, 'Compact optimizer state').")
    objective: Objective = Field("rl", description="rl: GRPO-style group rollouts scored by `reward`; sft: supervised prompt/completion pairs, no rollout. Without `loss` it also names the default loss (rl: ppo with clip bounds 0.8 / 1.28; sft: cross_entropy); with `loss` it follows the loss's kind and may be left out.")
    loss: LossChoice | None = Field(None, description="The loss, named like a Tinker call's loss_fn with its loss_fn_config: cross_entropy (sft); importance_sampling, ppo, cispo, dro (config beta, required), gspo (rl). ppo, cispo and gspo take clip_low_threshold and clip_high_threshold (absolute ratio bounds, default 0.8 and 1.2). null = the objective's default.")
    data: DataSpec = Field(description="The adapter's data source.")
    reward: RewardConfig | None = Field(None, description="RL only: the reward function, a builtin name or 'package.module:function' under an allowed import root. Required unless `rollout` names a custom rollout (which then computes its own rewards, and may use this one).")
    rollout: RolloutSpec | None = Field(None, description="RL only: how a prompt's trajectories are made: a multi-turn environment or an async rollout function by import path under an allowed rollout import root, with per-trajectory time and token budgets (docs/environments.md). Default: the built-in single_turn (one completion per sample, scored by `reward`).")
    prompts_per_step: int = Field(4, ge=1, le=65536, description="Prompts (RL) or examples (SFT) per optimizer step of this adapter.")
    num_step: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (the data repeats until then). At most one of num_step and num_epoch; neither = one epoch.")
    num_epoch: int | None = Field(None, ge=1, description="Stop after this many passes over the data: (rows x num_epoch) // prompts_per_step steps (the passes run on into each other; a final part shorter than a step is dropped).")
    max_staleness: int = Field(1, ge=0, le=1000, description="RL: drop rollout groups generated by weights more than this many versions behind the adapter's newest.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="RL: generation parameters, including n_samples_per_prompt (the group size for group-relative advantages; at least 2 for rl).")
    init_from: str | None = Field(None, description="Start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors, same rank), inside an allowed data root or the state dir, or a folder of the service's s3:// storage by its URL (a tenant: its own runs' and Tinker folders).")
    resume_from: str | None = Field(None, description="Resume this run from a lorafleet checkpoint folder (weights, optimizer, step, scheduler, data cursor, seeds), inside an allowed data root or the state dir, or a folder of the service's s3:// storage by its URL (a tenant: its own runs' and Tinker folders).")
    export_to: str | None = Field(None, description="Also copy the final PEFT export here when the run completes: a folder (s3://bucket/prefix/... or an absolute local path) below a location the operator allows for the caller (service.export_destinations); a failed copy fails the run with the reason (its export_path stays the service's own copy).")
    checkpoint_interval: int = Field(10, ge=0, description="Save a checkpoint every this many steps; 0 = only at retirement.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for the adapter's initial weights, data order and sampling.")
    lora_experts: bool = Field(True, description="MoE bases: LoRA on every routed expert as well as on attention; false = attention only (servable by SGLang on CPU). No effect on a dense base.")
    target_modules: list[TargetGroup] = Field(
        ["attention", "mlp"],  # pydantic copies a mutable default per instance
        description="What the adapter trains: any non-empty set of attention (q/k/v/o_proj), mlp (gate/up/down_proj, and the routed experts of an MoE base with lora_experts) and unembed (the output projection, lm_head; with tied embeddings the LoRA is on the output projection only). The exported PEFT folder lists the HF modules. A target off has exactly zero LoRA.",
    )

    _rebase_paths = field_validator("init_from", "resume_from")(rebase_path)

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
    def _defaults_of_the_objective(cls, data: Any) -> Any:
        # A named loss without an objective: the objective is the loss's kind. Then label_key's
        # default depends on the objective; fill it here so the stored config is explicit about
        # which key the run reads.
        if isinstance(data, dict) and isinstance(data.get("loss"), dict) and "objective" not in data:
            spec = LOSSES.get(data["loss"].get("name"))
            if spec is not None:
                data = {**data, "objective": spec.kind}
        if isinstance(data, dict) and isinstance(data.get("data"), dict) and data["data"].get("label_key") is None:
            objective = data.get("objective", "rl")
            data = {**data, "data": {**data["data"], "label_key": "completion" if objective == "sft" else "label"}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AdapterConfig:
        if self.loss is not None:
            try:
                spec, _ = resolve_loss(self.loss.name, self.loss.config)
            except ValueError as err:  # the table's message, with the key a REST tenant wrote
                raise ValueError(f"loss: {err}") from None
            if spec.kind != self.objective:
                raise ValueError(f"loss {self.loss.name!r} trains on {spec.kind} data but objective is {self.objective!r}: "
                                 f"leave objective out (it follows the loss) or choose a loss of its kind")
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
        tenant config does not expose (the default loss's clip offsets, KL, loss normalization)
        keep the trainer's defaults."""
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
            state_dtype=self.adam_state_dtype,
            samples_per_step=self.samples_per_step,
            objective=self.objective,
            loss=self.loss,
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
