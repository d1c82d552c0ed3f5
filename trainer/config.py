"""Typed configuration of the trainer (validated once, passed down).

* ``TrainerConfig``: the resident trainer (base model, slots, parallelism, kernels).
* ``SlotHyperParams``: one adapter's training hyper-parameters; given when a slot
  is initialized and fixed for that slot's tenant.

Loss normalization (``SlotHyperParams.loss_normalization``): every choice is a
*per-slot* quantity that depends only on that slot's own samples, so the sum over
slots in a mixed batch gives each slot exactly the gradient it would get alone:

* ``sequence_mean`` (default, GRPO): mean over each sample's loss tokens, then
  sum over the step's samples / ``samples_per_step``.
* ``token_mean`` (DAPO): sum over all loss tokens of the step's samples / their
  number. The count is only known when the step's last sample has arrived, so
  the trainer accumulates the unnormalized gradient and divides at step time.
* ``constant`` (Dr. GRPO): sum over loss tokens / (``samples_per_step`` *
  ``loss_norm_tokens``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainer.strict_model import StrictModel

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
# What an adapter run trains on, the one declaration (service/config/adapter.py's AdapterConfig uses it too).
Objective = Literal["rl", "sft"]
# How a slot stores its AdamW moments (SlotHyperParams.state_dtype; AdapterConfig.adam_state_dtype uses it too).
OptimizerStateDtype = Literal["float32", "bfloat16"]

# What a slot may train (SlotHyperParams.targets), and which group each Megatron module is in.
# "unembed" is the output projection (the unembedding, ``output_layer`` / HF ``lm_head``): with
# tied embeddings its LoRA is on the output projection only, never on the input embedding.
TARGET_GROUPS = ("attention", "mlp", "unembed")
TargetGroup = Literal["attention", "mlp", "unembed"]
_GROUP_OF_MODULE = {"linear_qkv": "attention", "linear_proj": "attention", "linear_fc1": "mlp", "linear_fc2": "mlp",
                    "output_layer": "unembed"}


def is_target_module(module: str) -> bool:
    """Whether a Megatron module name (its last part) is one of the LoRA target modules."""
    return module.rsplit(".", 1)[-1] in _GROUP_OF_MODULE


def target_group(module: str) -> TargetGroup:
    """The target group of a Megatron LoRA module, by its last name part (``linear_qkv`` -> attention)."""
    try:
        return _GROUP_OF_MODULE[module.rsplit(".", 1)[-1]]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"{module!r} is in no LoRA target group; known modules: {sorted(_GROUP_OF_MODULE)}") from None


class TrainerConfig(StrictModel):
    base_model_path: str = Field(description="Hugging Face checkpoint folder of the frozen base model.")
    random_init: bool = Field(
        False, description="Use only the folder's config.json and random weights (benchmarks)."
    )
    num_slots: int = Field(8, ge=1, le=4096, description="Resident adapter slots.")
    max_rank: int = Field(16, ge=1, le=1024, description="Largest LoRA rank a slot holds.")
    target_modules: tuple[str, ...] = Field(
        LORA_TARGETS,
        description=(
            f"Megatron modules that get LoRA slots (what slots MAY train); any of {', '.join(LORA_TARGETS)}. "
            "output_layer is the unembedding (HF lm_head; LoRA on the output projection only, also with tied "
            "embeddings); each slot chooses its own target groups among these (SlotHyperParams.targets)."
        ),
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Base compute dtype: auto = float32 without CUDA, bfloat16 with CUDA."
    )
    layer_spec: Literal["auto", "fused", "local", "transformer_engine"] = Field(
        "auto",
        description=(
            "Megatron layer spec: auto = TransformerEngine where it imports, else fused; fused = megatron-core's "
            "local spec with PyTorch fused attention (SDPA / varlen flash); local = the unfused local spec."
        ),
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel size.")
    dp: int = Field(1, ge=1, description="Data-parallel size (one trainer process per device: tp * dp).")
    micro_batch_tokens: int = Field(
        16384, ge=1,
        description=(
            "Tokens per forward/backward micro-batch: packed = the stream's real tokens; "
            "padded = samples x longest sample. A longer sample gets a micro-batch of its own. "
            "Larger is faster (per-micro-batch LoRA work is paid once); lower it if memory is short."
        ),
    )
    packed: bool = Field(
        True,
        description=(
            "Pack each micro-batch into one token stream without padding (attention confined to each "
            "sequence); needs layer_spec fused or transformer_engine."
        ),
    )
    chunked_logprobs: bool = Field(
        True, description="Log-probs from the output layer chunk by chunk (no full-vocab fp32 logits)."
    )
    logprob_chunk_tokens: int = Field(2048, ge=1, description="Tokens per chunk of the chunked log-probs.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description=(
            "Activation recomputation: none; selective = the MLPs; full = every layer (keeps only layer "
            "inputs, about a third more compute)."
        ),
    )
    lora_kernel: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto", description="LoRA delta kernel: grouped_mm over slot segments, or a per-segment loop."
    )
    fused_lora: bool = Field(
        True,
        description=(
            "Base GEMM and LoRA delta in one autograd node (packed micro-batches, any tensor-parallel size): "
            "fewer passes over memory, same result; false keeps them separate."
        ),
    )
    lora_rank_kernels: Literal["auto", "triton", "library"] = Field(
        "auto",
        description=(
            "Kernels of the fused node's four GEMMs that reduce a wide operand to the LoRA rank (x A^T, "
            "g B, dA, dB), and of every expert-LoRA GEMM on MoE bases: triton = segment-aware Triton kernels "
            "(CUDA; the CPU only under TRITON_INTERPRET=1), library = lora_kernel's GEMMs; auto = triton on "
            "CUDA for micro-batches of more than one slot, and for every MoE micro-batch (faster there on the "
            "H200), library otherwise."
        ),
    )
    lora_gemm: Literal["library", "cutlass", "auto"] = Field(
        "library",
        description=(
            "The fused node's base GEMM with its LoRA term (forward x W^T + h B^T, input gradient g W + gh A): "
            "library = cuBLAS plus the segmented expand (today's path); cutlass = one CUTLASS GEMM with the "
            "expand as extra K blocks (trainer/kernels/cutlass_lora: sm_90a, bf16, rank a multiple of 8; built "
            "with nvcc on first use, refused where it cannot run); auto = cutlass where it can run and measured "
            "faster on first use, else library. library stays the default until the H200 rows prove the kernel "
            "(docs/BENCHMARKS.md)."
        ),
    )
    overlap_step: bool = Field(
        True,
        description=(
            "CUDA: run the optimizer step on a stream of its own, one decoder layer at a time, so the next "
            "call's forward starts on the first layers while later ones are still updated (same results; "
            "trainer/optim/step_overlap.py). false: the whole step on the main stream before train returns."
        ),
    )
    overlap_step_min_params: int = Field(
        2_000_000_000, ge=0,
        description=(
            "overlap_step applies to steps that update at least this many LoRA parameters (stepping slots x "
            "parameters per slot); smaller steps run in order. Measured on one H200, rounds back to back: "
            "3.4 B parameters (32 MoE slots) 6% faster overlapped; 0.87 B (8 MoE slots) 3% slower; 0.94 B "
            "(64 dense slots) within the noise (docs/BENCHMARKS.md)."
        ),
    )
    swap_host_budget_mb: float = Field(
        16384, ge=0,
        description=(
            "Host memory (MiB per trainer rank; pinned on GPU machines) for evicted slots' state (keep-warm "
            "eviction) and for spill files read ahead (prefetch); beyond it evicted slots spill to "
            "swap_spill_dir. The default, 16 GiB, holds about 29 evicted Qwen3-8B rank-16 slots (weights, "
            "gradient and two Adam moments in fp32: 558 MiB each) per rank, 128 GiB of pinned memory on an "
            "8-GPU node; 0 spills every eviction."
        ),
    )
    swap_spill_dir: str | None = Field(
        None, description="Folder for evicted slots beyond the host-memory budget (the service's default: <state_dir>/swap). "
                          "It belongs to one trainer: files a previous trainer left there are removed at start.")
    swap_disk_budget_mb: float = Field(
        262144, ge=0,
        description=(
            "Disk (MiB per trainer rank) the spill files may take in swap_spill_dir; an eviction that would "
            "pass it fails and the slot stays resident. The default, 256 GiB, holds about 470 evicted "
            "Qwen3-8B rank-16 slots per rank."
        ),
    )
    export_writer_threads: int = Field(
        4, ge=1, le=64,
        description=(
            "Threads on trainer rank 0 that write publish folders in the background (trainer/export/export_writer.py). "
            "A write is mostly memory copies and file writes that release the GIL, so threads add up while "
            "the next train call runs (measured rates: docs/BENCHMARKS.md, weight publishing)."
        ),
    )
    export_writer: Literal["thread", "process"] = Field(
        "process",
        description=(
            "Who writes publish folders on trainer rank 0: thread = the writer threads themselves; process = one "
            "writer process per thread, reading the snapshot from shared host memory, so the file writes take no "
            "GIL from the training thread (trainer/export/export_process.py; measured: docs/BENCHMARKS.md, weight publishing)."
        ),
    )
    seed: int = Field(0, description="Seed of the model-parallel RNG.")
    storage: str | None = Field(
        None, description="Where the trainer commits the folders it writes (slot states, PEFT exports): the service's "
                          "storage (its state dir, or an s3:// location); keys are relative to it. None: the local "
                          "filesystem, folders named by absolute paths.")

    @property
    def target_groups(self) -> tuple[TargetGroup, ...]:
        """The target groups slots of this trainer may train (those of its target_modules)."""
        have = {target_group(m) for m in self.target_modules}
        return tuple(g for g in TARGET_GROUPS if g in have)

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(
                f"target_modules {list(self.target_modules)} invalid: need a non-empty subset of {list(LORA_TARGETS)}"
            )
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules has duplicates: {list(self.target_modules)}")
        if self.packed and self.layer_spec == "local":
            raise ValueError(
                "packed micro-batches need attention confined to each sequence, which the unfused local "
                "layer_spec lacks: use layer_spec auto, fused or transformer_engine, or set packed: false"
            )
        return self


class LossChoice(StrictModel):
    """A loss of the one table (trainer/losses/table.py) by name, with its config, as a Tinker call
    names one (``loss_fn``, ``loss_fn_config``)."""

    name: str = Field(description="A loss of the table: cross_entropy (sft); importance_sampling, ppo, cispo, dro, gspo (rl).")
    config: dict[str, float] = Field(
        default_factory=dict,
        description="The loss's config, as Tinker's loss_fn_config (ppo, cispo, gspo: clip_low_threshold and "
                    "clip_high_threshold, absolute ratio bounds, default 0.8 and 1.2; dro: beta, required).",
    )


class SlotHyperParams(StrictModel):
    rank: int = Field(8, ge=1, description="LoRA rank r (<= the trainer's max_rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the delta is scaled by alpha / r.")
    lr: float = Field(1e-4, gt=0, le=1.0, description="Peak learning rate (AdamW).")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from lr/warmup_steps to lr over these steps.")
    total_steps: int | None = Field(None, ge=1, description="Steps of the cosine schedule (required for cosine).")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine: final lr as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled (AdamW) weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip this slot's gradient norm; null = no clipping.")
    samples_per_step: int = Field(8, ge=1, description="The adapter's batch size: samples per optimizer step.")
    objective: Objective = Field(
        "rl", description="What the slot trains on: rl (sampled rows: the sampler's log-probabilities and advantages) or "
                          "sft (supervised rows); without `loss`, it names the default loss: ppo with the clip "
                          "offsets below (rl), cross_entropy (sft). With `loss`, the loss's kind.")
    loss: LossChoice | None = Field(
        None, description="The loss of the one table (trainer/losses/table.py), named like a Tinker call's loss_fn; "
                          "null = the objective's default.")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="RL default loss: lower clip offset, ratio >= 1 - clip_low (ratio_bounds).")
    clip_high: float = Field(0.28, ge=0.0, description="RL default loss: upper clip offset, ratio <= 1 + clip_high (DAPO: > clip_low).")
    kl_coef: float = Field(0.0, ge=0.0, description="RL: weight of the k3 KL estimate to the base (LoRA off).")
    loss_normalization: Literal["sequence_mean", "token_mean", "constant"] = Field(
        "sequence_mean", description="How token losses become the step's loss (see module doc)."
    )
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="constant normalization: tokens per sample in the denominator."
    )
    targets: tuple[TargetGroup, ...] = Field(
        ("attention", "mlp"),
        description=(
            "What the adapter trains, any non-empty set of attention (q/k/v/o), mlp (gate/up/down, and the "
            "routed experts of an MoE base with lora_experts) and unembed (the output projection, HF lm_head). "
            "A target off has exactly zero LoRA and gets no update."
        ),
    )
    lora_experts: bool = Field(
        True,
        description=(
            "MoE bases: LoRA on every routed expert's fc1/fc2 as well as on the attention linears; "
            "false = attention (and any dense MLP) only. No effect on a dense base."
        ),
    )
    state_dtype: OptimizerStateDtype = Field(
        "float32",
        description=(
            "Storage of the slot's two AdamW moments: float32 (exact); bfloat16 = 2 bytes each, the update "
            "computed in fp32 and its moments stored with stochastic rounding (a quarter less memory traffic "
            "per step: trainer/optim/compact_state.py). Fixed for the slot's tenant."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _objective_of_the_loss(cls, data: object) -> object:
        """A named loss without an objective: the objective is the loss's kind."""
        if isinstance(data, dict) and data.get("loss") is not None and "objective" not in data:
            from trainer.losses.table import LOSSES

            loss = data["loss"]
            name = loss.get("name") if isinstance(loss, dict) else getattr(loss, "name", None)
            if name in LOSSES:
                data = {**data, "objective": LOSSES[name].kind}
        return data

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError(f"targets is empty: at least one target must be on, of {', '.join(TARGET_GROUPS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"targets {list(v)} has duplicates")
        return tuple(g for g in TARGET_GROUPS if g in v)  # one canonical order: equal sets compare equal

    @model_validator(mode="after")
    def _check(self) -> "SlotHyperParams":
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas {self.betas}: each must be in [0, 1)")
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("lr_schedule 'cosine' needs total_steps (the step where the decay ends)")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds total_steps {self.total_steps}")
        if self.loss_normalization == "constant" and self.loss_norm_tokens is None:
            raise ValueError("loss_normalization 'constant' needs loss_norm_tokens (tokens per sample in the denominator)")
        if self.loss_normalization != "constant" and self.loss_norm_tokens is not None:
            raise ValueError("loss_norm_tokens applies only to loss_normalization 'constant'")
        if self.objective == "sft" and self.kl_coef > 0:
            raise ValueError("kl_coef applies only to objective 'rl' (sft has no reference policy term)")
        if self.loss is not None:
            from trainer.losses.table import resolve_loss

            spec, _ = resolve_loss(self.loss.name, self.loss.config)  # ValueError names what is allowed
            if spec.kind != self.objective:
                raise ValueError(f"loss {self.loss.name!r} trains on {spec.kind} rows but the objective is "
                                 f"{self.objective!r}: drop the objective (it follows the loss) or choose a loss of its kind")
            offsets = sorted({"clip_low", "clip_high"} & self.model_fields_set)
            if offsets:
                raise ValueError(f"{offsets} configure the default rl loss (ppo with bounds 1 - clip_low, 1 + clip_high); "
                                 f"with loss {self.loss.name!r} set its config instead (clip_low_threshold, "
                                 "clip_high_threshold: absolute bounds)")
        return self

    @property
    def loss_choice(self) -> tuple[str, dict[str, float]]:
        """The slot's loss: a table entry's name and its full config (the objective's default without
        `loss`: ppo with ``ratio_bounds``, or cross_entropy)."""
        from trainer.losses.table import DEFAULT_LOSS, resolve_loss

        if self.loss is not None:
            return self.loss.name, resolve_loss(self.loss.name, self.loss.config)[1]
        if self.objective == "rl":
            low, high = self.ratio_bounds
            return DEFAULT_LOSS["rl"], {"clip_low_threshold": low, "clip_high_threshold": high}
        return DEFAULT_LOSS["sft"], {}

    @property
    def ratio_bounds(self) -> tuple[float, float]:
        """The PPO clip as the absolute ratio bounds the losses take (trainer/losses/table.py: the one
        clip convention; this is the one place the offsets are converted)."""
        return 1.0 - self.clip_low, 1.0 + self.clip_high

    @property
    def scale(self) -> float:
        """The LoRA delta multiplier alpha / r (as in PEFT without rslora)."""
        return self.alpha / self.rank
