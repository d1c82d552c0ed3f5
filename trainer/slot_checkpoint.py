"""On-disk state of one slot: everything the trainer needs to resume that adapter.

Folder layout:
* ``slot_state.json``: format tag, hyper-parameters, effective rank, scale, seed,
  registration, step (the schedule is a pure function of it), pending sample
  count and pending loss statistics, and the model identity it was saved for.
* ``slot_state.safetensors``: ``<megatron layer>.{A,B}.{weight,exp_avg,exp_avg_sq,grad}``,
  full tensors in TP=1 Megatron layout (tp/dp independent), fp32.

The service adds its own data cursor and seed next to these files. No generator state
is stored because none affects a continuation: the trainer draws no random numbers
after init_slot (dropout is 0; tests/integration/test_trainer_resume.py checks that
train() leaves torch's generators untouched), the init generator is seeded by ``seed``
and used once, and the data order is a function of the seed and the epoch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FORMAT = "lorafleet-slot-state-v1"
META = "slot_state.json"
TENSORS = "slot_state.safetensors"
KINDS = ("weight", "exp_avg", "exp_avg_sq", "grad")


def save_slot_checkpoint(out_dir, state, pending: torch.Tensor, parts: dict, config) -> Path:  # noqa: ANN001
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for kind in KINDS:
        a_full, b_full = parts[kind]
        for name in a_full:
            tensors[f"{name}.A.{kind}"] = a_full[name].contiguous()
            tensors[f"{name}.B.{kind}"] = b_full[name].contiguous()
    meta = {
        "format": FORMAT,
        "hyper": state.hyper.model_dump(mode="json"),
        "rank": state.rank,
        "scale": state.scale,
        "seed": state.seed,
        "registration": state.registration,
        "step": state.step,
        "pending_samples": state.pending_samples,
        "pending_stats": pending.tolist(),
        "base_model_path": config.base_model_path,
        "target_modules": list(config.target_modules),
    }
    # Tensors first, metadata last: a folder with a meta file is complete.
    save_file(tensors, str(out / TENSORS), metadata={"format": FORMAT})
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_slot_checkpoint(in_dir, layers, config) -> tuple[dict, dict, torch.Tensor]:  # noqa: ANN001
    from safetensors.torch import load_file

    folder = Path(in_dir)
    if not (folder / META).is_file() or not (folder / TENSORS).is_file():
        raise FileNotFoundError(f"{folder} is not a slot state folder: need {META} and {TENSORS}")
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["rank"] > config.max_rank:
        raise ValueError(f"{folder}: slot rank {meta['rank']} exceeds the trainer's max_rank {config.max_rank}")
    if list(meta["target_modules"]) != list(config.target_modules):
        raise ValueError(f"{folder}: saved for target_modules {meta['target_modules']}, trainer has {list(config.target_modules)}")
    raw = load_file(str(folder / TENSORS))
    parts = {}
    rank = meta["rank"]
    for kind in KINDS:
        a_full, b_full = {}, {}
        for layer in layers:
            a, b = raw.get(f"{layer.name}.A.{kind}"), raw.get(f"{layer.name}.B.{kind}")
            if a is None or b is None:
                raise ValueError(f"{folder}: missing {layer.name} {kind} tensors")
            if tuple(a.shape) != layer.a_full_shape(rank) or tuple(b.shape) != layer.b_full_shape(rank):
                raise ValueError(
                    f"{folder}: {layer.name} {kind} has shapes {tuple(a.shape)}/{tuple(b.shape)}, "
                    f"expected {layer.a_full_shape(rank)}/{layer.b_full_shape(rank)}"
                )
            a_full[layer.name], b_full[layer.name] = a, b
        parts[kind] = (a_full, b_full)
    pending = torch.tensor(meta["pending_stats"], dtype=torch.float64)
    return meta, parts, pending
