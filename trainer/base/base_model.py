"""The frozen base: a Hugging Face checkpoint converted by Megatron-Bridge.

``build_frozen_base`` turns a HF folder into a Megatron-core ``GPTModel`` through
``AutoBridge`` (weights loaded by Bridge's own mappings), every base parameter
frozen. fp32 on CPU, bf16 on GPU (``dtype="auto"``). Layer specs: TransformerEngine's,
megatron-core's local spec with lorafleet's fused attention (``fused``,
``trainer/base/fused_attention.py``), or the unfused local spec. ``build_frozen_base``'s own
``auto`` is TE where it imports, else the plain local spec; the trainer's ``auto``
(``trainer_layer_spec``) is TE, else fused. Activation recomputation is set on the provider before the
model is built.

Forward passes (the trainer's, and the tests' reference):
* ``token_logprobs``: padded rows [b, s] -> log p(labels) [b, s] fp32, from full
  vocab-parallel logits (megatron-core's vocab-parallel cross entropy) or, with
  ``chunk_tokens``, chunked log-probs that never hold the full logits.
* ``packed_token_logprobs``: one packed stream (``trainer/base/packing.py``) -> per-token
  log-probs in stream order, attention confined to each sequence.
Both correct under tensor parallelism. Only the unfused local spec needs an explicit
causal mask; the fused and TE specs get ``attention_mask=None`` (causal by type).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.platform.cpu_compat import (
    cpu_provider_overrides,
    cuda_available,
    import_megatron_bridge,
    transformer_engine_available,
    triton_available,
)
from trainer.platform.model_folder import read_model_config


def resolve_dtype(dtype: Literal["auto", "float32", "bfloat16"]) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if cuda_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


@dataclass
class FrozenBase:
    """The converted model and the Bridge that knows its HF names."""

    model: torch.nn.Module  # megatron.core GPTModel
    bridge: Any  # megatron.bridge.AutoBridge
    dtype: torch.dtype
    device: torch.device
    layer_spec: str  # "fused" | "local" | "transformer_engine"
    hf_path: str
    recompute: str = "none"  # "none" | "selective" | "full"

    @property
    def config(self):  # megatron TransformerConfig
        return self.model.config

    def hf_mapping(self, megatron_param_name: str):
        """Bridge's param mapping for a Megatron parameter (carries its HF names)."""
        return self.bridge._model_bridge.mapping_registry().megatron_to_hf_lookup(megatron_param_name)


def build_frozen_base(
    hf_path: str | Path,
    *,
    tp: int,
    dtype: Literal["auto", "float32", "bfloat16"] = "auto",
    layer_spec: Literal["auto", "fused", "local", "transformer_engine"] = "auto",
    random_init: bool = False,
    seed: int = 0,
    recompute: Literal["none", "selective", "full"] = "none",
) -> FrozenBase:
    """Build the frozen Megatron model. The process group must already exist (init_parallel)."""
    import_megatron_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec, transformer_engine_layer_spec

    hf_path = str(hf_path)
    read_model_config(hf_path)  # a clear error for a folder that is not a HF checkpoint, before Bridge's own
    torch_dtype = resolve_dtype(dtype)
    if random_init:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_path)
        hf_config.torch_dtype = torch_dtype
        bridge = AutoBridge.from_hf_config(hf_config)
        provider = bridge.to_megatron_provider(load_weights=False)
    else:
        bridge = AutoBridge.from_hf_pretrained(hf_path, dtype=torch_dtype)
        provider = bridge.to_megatron_provider(load_weights=True)

    if layer_spec == "auto":  # the plain conversion; the trainer resolves its own "auto" (trainer_layer_spec)
        layer_spec = "transformer_engine" if transformer_engine_available() else "local"
    if layer_spec == "transformer_engine" and not transformer_engine_available():
        raise ValueError(
            "layer_spec 'transformer_engine' needs TransformerEngine, which does not import here; "
            "use 'auto', 'fused' or 'local'"
        )
    if layer_spec == "fused":
        from trainer.base.fused_attention import lorafleet_gpt_layer_spec

        # Called by Bridge with the provider as the config. provider.attention_backend stays
        # as it is (auto): 'local' would make Bridge put DotProductAttention back.
        provider.transformer_layer_spec = functools.partial(lorafleet_gpt_layer_spec, prefer_te=False)
    else:
        provider.transformer_layer_spec = local_layer_spec if layer_spec == "local" else transformer_engine_layer_spec
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.sequence_parallel = False
    provider.context_parallel_size = 1
    # LoRA training has no dropout in the base; it also keeps the mixed step deterministic.
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    provider.params_dtype = torch_dtype
    provider.bf16 = torch_dtype == torch.bfloat16
    provider.fp16 = False
    if layer_spec != "transformer_engine":
        # The fused cross entropy / rope kernels are TE or CUDA-JIT paths; we compute
        # the loss ourselves from the logits anyway.
        provider.cross_entropy_loss_fusion = False
        # The local spec's fused softmax needs the apex/megatron CUDA extension
        # `scaled_masked_softmax_cuda`, which is not installed without TE (seen on the
        # H200: ModuleNotFoundError); torch's softmax path is used instead.
        provider.masked_softmax_fusion = False
        if not getattr(provider, "rotary_interleaved", False):
            provider.apply_rope_fusion = triton_rope_enabled()
    for key, value in cpu_provider_overrides().items():
        setattr(provider, key, value)
    if getattr(provider, "num_moe_experts", None):
        from trainer.lora.moe_lora import moe_provider_overrides

        for key, value in moe_provider_overrides().items():
            setattr(provider, key, value)
    from trainer.base.fused_attention import recompute_overrides

    for key, value in recompute_overrides(recompute, num_layers=1).items():
        setattr(provider, key, value)
    if random_init:
        provider.perform_initialization = True
        torch.manual_seed(seed)
    provider.finalize()
    models = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=not cuda_available(),
        mixed_precision_wrapper=None,
        bf16=provider.bf16,
        fp16=False,
    )
    if len(models) != 1:
        raise ValueError(f"expected one model chunk (no virtual pipeline), got {len(models)}")
    model = models[0]
    freeze_in_dtype(model, torch_dtype)
    # Dropout is 0 everywhere, so train/eval only matters for recomputation, which
    # megatron-core does in training mode only. LoRA params get gradients either way.
    model.train(recompute != "none")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    return FrozenBase(model=model, bridge=bridge, dtype=torch_dtype, device=device, layer_spec=layer_spec,
                      hf_path=hf_path, recompute=recompute)


def triton_rope_enabled() -> bool:
    """Whether RoPE runs as the Triton kernel (triton_rope.py, one pass per direction instead
    of about eight eager ones): on CUDA with Triton, without TransformerEngine's fused RoPE.
    Installs the kernel as megatron-core's fused-RoPE hook; set ``apply_rope_fusion`` to the
    result. Triton is probed as for the other kernels (triton_adamw, triton_lora)."""
    if not (cuda_available() and triton_available()):
        return False
    from trainer.kernels import triton_rope

    return triton_rope.install()


def freeze_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """No gradients for the base, and every floating parameter in the compute dtype.

    Megatron's torch-norm wrapper makes its weight fp32 (it counts on a Float16Module
    wrapper, which a frozen base does not need); against bf16 activations torch's rms_norm
    then falls back to an unfused composite: 90 ms of elementwise ops per 16k-token
    forward+backward of the 1.7B shape on the H200 (docs/benchmarks-history.md, "Third version")."""
    for p in model.parameters():
        p.requires_grad_(False)
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked out. Passed explicitly because megatron-core's
    default causal mask is allocated with device="cuda" (fails on CPU)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def trainer_layer_spec(layer_spec: Literal["auto", "fused", "local", "transformer_engine"]) -> str:
    """The trainer's reading of ``TrainerConfig.layer_spec``: auto = TransformerEngine where it
    imports, else megatron-core's local spec with fused attention (never the unfused one)."""
    if layer_spec == "auto":
        return "transformer_engine" if transformer_engine_available() else "fused"
    return layer_spec


def attention_mask(base: FrozenBase, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """The mask to pass for causal padded rows: None (causal by the layer's mask type) except
    for the unfused local spec, whose default mask would be allocated on "cuda"."""
    return causal_mask(seq_len, device) if base.layer_spec == "local" else None


def _decoder_input(
    base: FrozenBase, ids: torch.Tensor, position_ids: torch.Tensor, input_grad: bool = False
) -> torch.Tensor | None:
    """The embeddings as a leaf that requires grad, or None (the model embeds itself).

    Needed with recomputation: a checkpointed block whose inputs need no gradient would
    hand none to the LoRA weights inside it (the base and its embedding are frozen), so
    the block input must carry one. ``input_grad`` asks for it anyway (the frozen-base
    benchmark: backward to the input embeddings, no LoRA)."""
    if not torch.is_grad_enabled() or (base.recompute == "none" and not input_grad):
        return None
    return base.model.embedding(ids, position_ids).detach().requires_grad_()


def token_logprobs(
    base: FrozenBase,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    tp_group=None,  # noqa: ANN001 - the TP process group, for chunked log-probs under TP > 1
    input_grad: bool = False,
) -> torch.Tensor:
    """log p(labels[b, t] | input_ids[b, :t+1]) for every position, fp32, shape [b, s].

    Right padding is harmless: attention is causal, so pads never influence
    earlier positions; the caller masks the pads' own outputs. Inputs may sit on any
    device; the result is on the inputs' device. ``chunk_tokens``: chunked log-probs
    (no [b, s, V] logits); None = full logits and megatron-core's vocab-parallel CE.
    ``input_grad``: let the backward reach the input embeddings (frozen-base benchmark).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    out_device = input_ids.device
    input_ids, labels = input_ids.to(base.device), labels.to(base.device)
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=base.device).unsqueeze(0).expand(b, s)
    mask = attention_mask(base, s, base.device)
    emb = _decoder_input(base, input_ids, position_ids, input_grad)
    if chunk_tokens is not None:
        from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

        lp = base.model(input_ids, position_ids, mask, decoder_input=emb,
                        output_processor=LogprobOutputProcessor(chunk_tokens, tp_group=tp_group),
                        output_processor_context=labels)
        return lp.to(out_device)
    # [b, s, V/tp]: runtime_gather_output=False keeps the vocab sharded across TP.
    logits = base.model(input_ids, position_ids, mask, decoder_input=emb, runtime_gather_output=False)
    ce = vocab_parallel_cross_entropy(logits.float(), labels)
    return (-ce).to(out_device)


def packed_token_logprobs(
    base: FrozenBase,
    packed,  # noqa: ANN001 - trainer.base.packing.PackedBatch
    targets: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    tp_group=None,  # noqa: ANN001
    input_grad: bool = False,
) -> torch.Tensor:
    """Per-token log-probs [T] fp32 of one packed stream, in stream order.

    ``targets`` [T]: the token each position predicts, ``IGNORE_TARGET`` where there is
    none (each sequence's last token), whose log-prob is 0. Attention stays inside each
    sequence and positions restart at 0 per sequence, so every sequence gets what it
    would get alone. The LoRA routing (if any) must be set for the stream by the caller.
    """
    from trainer.kernels.chunked_logprobs import IGNORE_TARGET, LogprobOutputProcessor

    if base.layer_spec == "local":
        raise ValueError("packed streams need the fused or TransformerEngine layer spec, not the unfused local one")
    ids, pos = packed.tokens, packed.position_ids
    emb = _decoder_input(base, ids, pos, input_grad)
    params = packed.packed_seq_params
    if chunk_tokens is not None:
        lp = base.model(ids, pos, None, decoder_input=emb, packed_seq_params=params,
                        output_processor=LogprobOutputProcessor(chunk_tokens, tp_group=tp_group),
                        output_processor_context=targets.unsqueeze(0))
        return lp[0]
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = base.model(ids, pos, None, decoder_input=emb, packed_seq_params=params, runtime_gather_output=False)
    valid = targets != IGNORE_TARGET
    ce = vocab_parallel_cross_entropy(logits.float(), torch.where(valid, targets, 0).unsqueeze(0))[0]
    return torch.where(valid, -ce, torch.zeros_like(ce))
