"""Slot weights <-> PEFT adapters (Hugging Face module names).

Layers of conversion:
1. rank-local shard <-> *full* tensor in TP=1 Megatron layout (MultiLoraLinear.full_*/local_*,
   collective over TP);
2. full Megatron layout <-> Hugging Face projections (here). Megatron fuses
   q/k/v (interleaved per query group) and gate/up ([gate; up]); one LoRA A
   feeds the fused output, so every HF projection of a fused linear gets the same
   ``lora_A`` and its own rows of ``lora_B``: the exported adapter computes
   exactly the slot's delta.

Importing a PEFT adapter whose fused projections have *different* ``lora_A``
(any adapter trained with HF peft) stacks them: A = [A_q; A_k; A_v] and a
block-diagonal B, an exact rank-3r (2r for gate/up) representation; the slot
then has effective rank up to 3r, which must fit the trainer's max rank.
The HF names come from Megatron-Bridge's own parameter mappings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from trainer.config import target_group
from trainer.lora.multi_lora import MultiLoraLinear
from trainer.export.safetensors_stream import PackedHeader, write_packed, write_safetensors

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PART_ORDER = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up"), "plain": ("",)}


@dataclass(frozen=True)
class HfTarget:
    """One HF projection fed by a Megatron linear."""

    module: str  # e.g. model.layers.0.self_attn.q_proj
    part: str  # "q" | "k" | "v" | "gate" | "up" | ""


def hf_targets(base, layer: MultiLoraLinear) -> list[HfTarget]:  # noqa: ANN001 - FrozenBase
    own = getattr(layer, "hf_module", None)  # the unembedding names its HF module itself (unembed_lora.py)
    if own is not None:
        return [HfTarget(module=own, part="")]
    hf = base.hf_mapping(f"{layer.name}.weight").hf_param
    names = {"": hf} if isinstance(hf, str) else hf
    return [HfTarget(module=names[p].removesuffix(".weight"), part=p) for p in PART_ORDER[layer.kind]]


@cache
def _qkv_permutation(num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """perm with fused_rows = cat(q_rows, k_rows, v_rows)[perm] (Bridge's own QKV interleave)."""
    from types import SimpleNamespace

    from megatron.bridge.models.conversion.param_mapping import merge_qkv_weights

    cfg = SimpleNamespace(num_attention_heads=num_heads, num_query_groups=num_groups, kv_channels=head_dim, hidden_size=num_heads * head_dim)
    q_rows, kv_rows = num_heads * head_dim, num_groups * head_dim
    idx = torch.arange(q_rows + 2 * kv_rows, dtype=torch.float64)
    merged = merge_qkv_weights(cfg, idx[:q_rows], idx[q_rows : q_rows + kv_rows], idx[q_rows + kv_rows :])
    return merged.to(torch.long)


def _qkv_sizes(config) -> tuple[int, int, torch.Tensor]:  # noqa: ANN001 - TransformerConfig
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    perm = _qkv_permutation(config.num_attention_heads, config.num_query_groups, head_dim)
    return config.num_attention_heads * head_dim, config.num_query_groups * head_dim, perm


def split_full_b(config, kind: str, b_full: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
    """Full Megatron lora_B [out, r] -> one tensor per HF part (PART_ORDER)."""
    if kind == "qkv":
        q_rows, kv_rows, perm = _qkv_sizes(config)
        unfused = torch.empty_like(b_full)
        unfused[perm.to(b_full.device)] = b_full
        return list(unfused.split([q_rows, kv_rows, kv_rows], dim=0))
    if kind == "gate_up":
        return list(b_full.chunk(2, dim=0))
    return [b_full]


def merge_full_b(config, kind: str, parts: list[torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    """Inverse of split_full_b."""
    if kind == "qkv":
        _, _, perm = _qkv_sizes(config)
        return torch.cat(parts, dim=0)[perm.to(parts[0].device)]
    return torch.cat(parts, dim=0)


def slot_to_hf(base, layers: list[MultiLoraLinear], a_full: dict[str, torch.Tensor], b_full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Full per-layer A [r, in] / B [out, r] -> PEFT state dict (``base_model.model.<module>.lora_{A,B}.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        targets = hf_targets(base, layer)
        for target, b_part in zip(targets, split_full_b(base.config, layer.kind, b_full[layer.name])):
            out[f"{PEFT_PREFIX}{target.module}.lora_A.weight"] = a_full[layer.name].contiguous()
            out[f"{PEFT_PREFIX}{target.module}.lora_B.weight"] = b_part.contiguous()
    return out


def peft_config_dict(*, rank: int, scale: float, target_modules: list[str], base_model: str,
                     target_parameters: list[str] | None = None) -> dict:
    """PEFT's adapter_config. ``target_parameters``: expert tensors of an MoE base (moe_lora.py),
    kept in the given order (PEFT nests one wrapper per entry in that order)."""
    extra = {"target_parameters": list(target_parameters)} if target_parameters else {}
    return extra | {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def json_target_parameters(folder: str | Path) -> list[str]:
    """The ``target_parameters`` of a PEFT folder's config ([] when absent or unreadable)."""
    try:
        return list(json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("target_parameters") or [])
    except (OSError, ValueError):
        return []


def hf_short_names(base, layers: list[MultiLoraLinear]) -> list[str]:  # noqa: ANN001
    return sorted({t.module.rsplit(".", 1)[-1] for layer in layers for t in hf_targets(base, layer)})


def write_peft_folder(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """adapter_model.safetensors (written from the tensors' own memory: trainer/export/safetensors_stream.py)
    and adapter_config.json. Tensors may share storage (fused q/k/v share one lora_A)."""
    host = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return _peft_folder(out_dir, config, lambda path: write_safetensors(path, host, metadata={"format": "pt"}))


def write_peft_folder_packed(out_dir: str | Path, config: dict, header: PackedHeader, body: torch.Tensor) -> Path:
    """write_peft_folder for tensors packed back to back in ``body`` in file order under a prebuilt
    ``header`` (an export snapshot: trainer/export/slot_export.py export_layout): the weights file in one write."""
    return _peft_folder(out_dir, config, lambda path: write_packed(path, header, body))


def _peft_folder(out_dir: str | Path, config: dict, write_weights) -> Path:  # noqa: ANN001 - Callable[[Path], None]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(peft_config_text(config))
    return out


def peft_config_text(config: dict) -> str:
    """adapter_config.json's text (one format for every writer: the export writer process writes it as it is)."""
    return json.dumps(config, indent=2) + "\n"


@dataclass
class ImportedAdapter:
    rank: int  # effective rank in the slot (r, or up to 3r when fused A's differ)
    scale: float  # lora_alpha / r of the file
    a_full: dict[str, torch.Tensor]  # per Megatron layer, [rank, in] fp32
    b_full: dict[str, torch.Tensor]  # per Megatron layer, [out, rank] fp32
    # HF peft's copy of the base output weight, saved beside lm_head LoRA (save_embedding_layers
    # "auto"); the trainer takes the folder only if it equals its base (UnembedLora.check_base_copy).
    base_output_weight: torch.Tensor | None = None


HF_BASE_OUTPUT = "lm_head.base_layer.weight"


def read_peft_folder(folder: str | Path, base, layers: list[MultiLoraLinear],  # noqa: ANN001
                     other_modules: frozenset[str] = frozenset(),
                     untrained: list[MultiLoraLinear] = ()) -> tuple[dict, ImportedAdapter]:
    """Read a PEFT LoRA folder and express it in full Megatron layout for these layers.
    ``other_modules``: modules of the file another reader takes (MoE experts, moe_lora.py).
    ``untrained``: layers of the trainer that the slot does not train (a target off): LoRA on
    them in the file is refused, naming the modules."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, w_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not cfg_path.is_file() or not w_path.is_file():
        raise FileNotFoundError(f"{folder} is not a PEFT adapter folder: need {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, allowed in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if cfg.get(key, allowed) != allowed:
            raise ValueError(f"{folder}: {key}={cfg[key]!r} is not supported (need {allowed!r})")
    if cfg.get("modules_to_save") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{folder}: modules_to_save / rank_pattern / alpha_pattern are not supported")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    raw = load_file(str(w_path))
    base_output = raw.pop(f"{PEFT_PREFIX}{HF_BASE_OUTPUT}", None)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for key, value in raw.items():
        name = key.removeprefix(PEFT_PREFIX)
        for ab in ("lora_A", "lora_B"):
            for suffix in (f".{ab}.weight", f".{ab}.default.weight"):
                if name.endswith(suffix):
                    tensors[(name[: -len(suffix)], ab)] = value.to(torch.float32)
    if len(tensors) != len(raw):
        raise ValueError(f"{folder}: tensors other than lora_A/lora_B weights: {sorted(set(raw))[:5]}")
    used: set[str] = set()
    a_full, b_full, need = {}, {}, 1
    for layer in layers:
        targets = hf_targets(base, layer)
        present = [t for t in targets if (t.module, "lora_A") in tensors]
        for t in present:
            used.add(t.module)
        if not present:
            continue
        out_sizes = [p.shape[0] for p in split_full_b(base.config, layer.kind, torch.zeros(layer.out_full, 1))]
        size_of = {t.part: n for t, n in zip(targets, out_sizes)}
        for t in present:
            a_shape = tuple(tensors[(t.module, "lora_A")].shape)
            b_shape = tuple(tensors.get((t.module, "lora_B"), torch.zeros(0)).shape)
            if a_shape != (r, layer.in_full) or b_shape != (size_of[t.part], r):
                raise ValueError(
                    f"{folder}: {t.module} has lora_A {a_shape} / lora_B {b_shape}, "
                    f"expected {(r, layer.in_full)} / {(size_of[t.part], r)} for r={r} on this base model"
                )
        a_parts = [tensors[(t.module, "lora_A")] for t in present]
        b_parts = {t.part: tensors[(t.module, "lora_B")] for t in present}
        same_a = all(torch.equal(a_parts[0], a) for a in a_parts[1:])
        if same_a:
            a = a_parts[0]
            blocks = [b_parts.get(t.part, torch.zeros(n, r)) for t, n in zip(targets, out_sizes)]
        else:  # exact block-stacked form: A = [A_p1; A_p2; ...], B block-diagonal
            a = torch.cat(a_parts, dim=0)
            blocks = []
            for t, n in zip(targets, out_sizes):
                b = torch.zeros(n, r * len(present))
                if t.part in b_parts:
                    j = [p.part for p in present].index(t.part)
                    b[:, j * r : (j + 1) * r] = b_parts[t.part]
                blocks.append(b)
        a_full[layer.name] = a
        b_full[layer.name] = merge_full_b(base.config, layer.kind, blocks)
        need = max(need, a.shape[0])
    unknown = sorted({m for m, _ in tensors} - used - other_modules)
    off = {t.module for layer in untrained for t in hf_targets(base, layer)}
    if any(m in off for m in unknown):
        groups = sorted({target_group(layer.name) for layer in untrained
                         if any(t.module in unknown for t in hf_targets(base, layer))})
        raise ValueError(f"{folder}: adapter has LoRA on {[m for m in unknown if m in off][:5]}, which the slot does "
                         f"not train (target groups off: {groups}); turn those targets on or drop the modules")
    if unknown:
        raise ValueError(f"{folder}: adapter has modules this trainer does not target: {unknown[:5]}")
    if base_output is not None and not any(t.module == HF_BASE_OUTPUT.removesuffix(".base_layer.weight")
                                           for layer in layers for t in hf_targets(base, layer)):
        raise ValueError(f"{folder}: {HF_BASE_OUTPUT} is there but no lm_head LoRA is imported")
    if not a_full:
        raise ValueError(f"{folder}: no lora weights for any targeted module")
    for name in list(a_full):  # pad every layer to the slot's effective rank
        a, b = a_full[name], b_full[name]
        a_full[name] = torch.cat([a, a.new_zeros(need - a.shape[0], a.shape[1])])
        b_full[name] = torch.cat([b, b.new_zeros(b.shape[0], need - b.shape[1])], dim=1)
    return cfg, ImportedAdapter(rank=need, scale=alpha / r, a_full=a_full, b_full=b_full,
                                base_output_weight=None if base_output is None else base_output.float())
