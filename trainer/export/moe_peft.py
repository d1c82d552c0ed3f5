"""Expert LoRA <-> PEFT adapters (transformers >= 5 fused expert tensors, PEFT target_parameters).

Transformers 5 holds a Qwen3-MoE layer's experts as two 3D parameters,
``mlp.experts.gate_up_proj [E, 2I, H]`` (rows [gate; up], as Megatron's fc1) and
``mlp.experts.down_proj [E, H, I]``; PEFT (0.21) trains and loads LoRA on them through
``target_parameters``. Its layout, per targeted parameter: ``lora_A [E * r, in]`` (row
e*r + j = A_e[j]) and ``lora_B [out, r * E]`` (column j*E + e = B_e[:, j]); the delta of
expert e is ``scale * B_e @ A_e``. With several target_parameters PEFT nests one wrapper
per entry, the first innermost: its tensors sit under ``experts.base_layer.`` once per
wrapper outside it. The attention LoRA of the same adapter is written by peft_io.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from trainer.lora.moe_lora import EXPERT_TARGETS, ExpertLoraWeights

# PEFT target_parameters of the fused expert tensors, in the order the trainer exports them.
HF_EXPERT_PARAMS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}


def expert_target_parameters(layers: list[ExpertLoraWeights]) -> list[str]:
    """PEFT ``target_parameters`` for these expert layers, fc1 (gate_up_proj) first."""
    kinds = {layer.name.rsplit(".", 1)[-1] for layer in layers}
    return [f"mlp.experts.{HF_EXPERT_PARAMS[k]}" for k in EXPERT_TARGETS if k in kinds]


def _hf_experts_module(base, layer: ExpertLoraWeights) -> str:  # noqa: ANN001 - FrozenBase
    """HF module path of the layer's experts (``model.layers.<i>.mlp.experts``), from Bridge's
    mapping of the same layer's router."""
    prefix = layer.name.rsplit(".experts.", 1)[0]  # decoder.layers.<i>.mlp
    hf = base.hf_mapping(f"{prefix}.router.weight").hf_param  # model.layers.<i>.mlp.gate.weight
    return re.sub(r"\.gate\.weight$", ".experts", hf)


def expert_peft_tensors(base, layers: list[ExpertLoraWeights], a_full: dict, b_full: dict) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Full A [E, r, in] / B [E, out, r] -> PEFT ParamWrapper tensors.

    PEFT stores expert LoRA of a 3D parameter as ``lora_A [E * r, in]`` (row e*r + j = A_e[j])
    and ``lora_B [out, r * E]`` (column j*E + e = B_e[:, j]); its delta for expert e is
    ``scale * B_e @ A_e`` in the (experts, out, in) layout of ``gate_up_proj`` / ``down_proj``.
    With several target_parameters PEFT nests the wrappers, the first innermost: its tensors
    sit under ``experts.base_layer.`` once per wrapper outside it."""
    from trainer.export.peft_io import PEFT_PREFIX

    params = expert_target_parameters(layers)
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        param = f"mlp.experts.{HF_EXPERT_PARAMS[layer.name.rsplit('.', 1)[-1]]}"
        nesting = "base_layer." * (len(params) - 1 - params.index(param))
        module = f"{PEFT_PREFIX}{_hf_experts_module(base, layer)}.{nesting}"
        a, b = a_full[layer.name], b_full[layer.name]
        e, r = a.shape[0], a.shape[1]
        out[f"{module}lora_A.weight"] = a.reshape(e * r, a.shape[2]).contiguous()
        out[f"{module}lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return out


def read_expert_peft(folder, base, layers: list[ExpertLoraWeights], hyper) -> tuple[dict, dict, frozenset[str]]:  # noqa: ANN001
    """The expert LoRA of a PEFT folder (the inverse of ``expert_peft_tensors``): full A
    [E, r, in] / B [E, out, r] per expert layer, and the PEFT module names it took (so the
    dense reader does not call them unknown). A folder without target_parameters: nothing."""
    from safetensors.torch import load_file

    from trainer.export.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, json_target_parameters

    folder = Path(folder)
    params = json_target_parameters(folder)
    if not params:  # (a folder that is not a PEFT adapter is reported by read_peft_folder)
        return {}, {}, frozenset()
    cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    ours = expert_target_parameters(layers)
    if [p for p in ours if p in params] != params:
        raise ValueError(f"{folder}: target_parameters {params} not supported here: this trainer's expert LoRA "
                         f"covers {ours} (in that order)")
    if not hyper.lora_experts:
        raise ValueError(f"{folder}: the adapter has expert LoRA ({params}) but the slot's lora_experts is false")
    r, raw = int(cfg["r"]), load_file(str(folder / ADAPTER_WEIGHTS))
    a_full, b_full, modules = {}, {}, set()
    for layer in layers:
        param = f"mlp.experts.{HF_EXPERT_PARAMS[layer.name.rsplit('.', 1)[-1]]}"
        if param not in params:
            continue
        module = f"{_hf_experts_module(base, layer)}{'.base_layer' * (len(params) - 1 - params.index(param))}"
        a, b = raw.get(f"{PEFT_PREFIX}{module}.lora_A.weight"), raw.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        e = layer.num_experts
        if a is None or b is None or tuple(a.shape) != (e * r, layer.in_full) or tuple(b.shape) != (layer.out_full, r * e):
            raise ValueError(f"{folder}: {module} needs lora_A [{e * r}, {layer.in_full}] and lora_B "
                             f"[{layer.out_full}, {r * e}] for r={r}, got {None if a is None else tuple(a.shape)} / "
                             f"{None if b is None else tuple(b.shape)}")
        a_full[layer.name] = a.float().reshape(e, r, layer.in_full)
        b_full[layer.name] = b.float().reshape(layer.out_full, r, e).permute(2, 0, 1).contiguous()
        modules.add(module)
    return a_full, b_full, frozenset(modules)
