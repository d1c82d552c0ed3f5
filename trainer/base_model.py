"""The frozen base: a Hugging Face checkpoint converted by Megatron-Bridge.

``build_frozen_base`` turns a HF folder into a Megatron-core ``GPTModel`` through
``AutoBridge`` (weights loaded by Bridge's own mappings), every base parameter
frozen. fp32 on CPU, bf16 on GPU (``dtype="auto"``). The layer spec is
TransformerEngine's where TE imports, megatron-core's local spec otherwise.

``token_logprobs`` is the one forward the trainer uses: input ids [b, s] ->
log p(labels) [b, s] in fp32, computed from the vocab-parallel logits with
megatron-core's vocab-parallel cross entropy (correct under tensor parallelism).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from trainer.cpu_compat import (
    cpu_provider_overrides,
    cuda_available,
    import_megatron_bridge,
    transformer_engine_available,
)


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
    layer_spec: str  # "local" | "transformer_engine"
    hf_path: str

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
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto",
    random_init: bool = False,
    seed: int = 0,
) -> FrozenBase:
    """Build the frozen Megatron model. The process group must already exist (init_parallel)."""
    import_megatron_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec, transformer_engine_layer_spec

    hf_path = str(hf_path)
    if not (Path(hf_path) / "config.json").is_file():
        raise FileNotFoundError(f"base model folder {hf_path!r} has no config.json (expected a HF checkpoint)")
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

    if layer_spec == "auto":
        layer_spec = "transformer_engine" if transformer_engine_available() else "local"
    if layer_spec == "transformer_engine" and not transformer_engine_available():
        raise ValueError("layer_spec 'transformer_engine' needs TransformerEngine, which does not import here; use 'local' or 'auto'")
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
    if layer_spec == "local":
        # The fused cross entropy / rope kernels are TE or CUDA-JIT paths; we compute
        # the loss ourselves from the logits anyway.
        provider.cross_entropy_loss_fusion = False
        # The local spec's fused softmax needs the apex/megatron CUDA extension
        # `scaled_masked_softmax_cuda`, which is not installed without TE (seen on the
        # H200: ModuleNotFoundError); torch's softmax path is used instead.
        provider.masked_softmax_fusion = False
    for key, value in cpu_provider_overrides().items():
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
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()  # no dropout anywhere; LoRA params still get gradients
    device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    return FrozenBase(model=model, bridge=bridge, dtype=torch_dtype, device=device, layer_spec=layer_spec, hf_path=hf_path)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked out. Passed explicitly because megatron-core's
    default causal mask is allocated with device="cuda" (fails on CPU)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def token_logprobs(base: FrozenBase, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[b, t] | input_ids[b, :t+1]) for every position, fp32, shape [b, s].

    Right padding is harmless: attention is causal, so pads never influence
    earlier positions; the caller masks the pads' own outputs.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    # [b, s, V/tp]: runtime_gather_output=False keeps the vocab sharded across TP.
    logits = base.model(
        input_ids, position_ids, causal_mask(s, input_ids.device), runtime_gather_output=False
    )
    ce = vocab_parallel_cross_entropy(logits.float(), labels)
    return -ce


def read_hf_config(hf_path: str | Path) -> dict:
    return json.loads((Path(hf_path) / "config.json").read_text())
