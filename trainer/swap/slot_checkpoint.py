"""On-disk state of one slot: everything the trainer needs to resume that adapter.

Folder layout:
* ``slot_state.json``: format tag, hyper-parameters, effective rank, scale, seed,
  registration, step (the schedule is a pure function of it), pending sample
  count and pending loss statistics, and the model identity it was saved for.
* ``slot_state.safetensors``: ``<megatron layer>.{A,B}.{weight,exp_avg,exp_avg_sq,grad}``,
  full tensors in TP=1 Megatron layout (tp/dp independent), fp32 (the moments in the slot's
  ``hyper.state_dtype``: bf16 for a compact state, its exact bits), for the layers the slot trains
  (its targets: trainer/lora/slots.py ``layer_trained``; the others are exactly zero, so nothing is
  lost). A state loads into any trainer that has LoRA on those layers.

The service adds its own data cursor and seed next to these files. No generator state
is stored because none affects a continuation: the trainer draws no random numbers
after init_slot (dropout is 0; tests/integration/test_trainer_resume.py checks that
train() leaves torch's generators untouched), the init generator is seeded by ``seed``
and used once, and the data order is a function of the seed and the epoch.

``save_slot_state`` / ``load_slot_state`` take a slot of a trainer to such a folder and back;
both are collective (every rank calls them; rank 0 writes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import SlotHyperParams, TrainerConfig
from trainer.lora.slot_buffers import BUFFER_KINDS as KINDS
from trainer.lora.slot_buffers import MOMENT_KINDS, STATE_DTYPES, state_kind
from trainer.lora.slots import SlotState, layer_trained, zero_stats
from trainer.platform.distributed import dp_group
from trainer.storage.locations import open_store, readable_folder
from trainer.storage.slot_state_format import FORMAT, META, TENSORS

# ``trainer`` below is a trainer.core.MultiLoraTrainer and ``writer`` a trainer.export.export_writer.ExportWriter:
# neither is imported (the core composes this room; trainer.swap imports only what test_import_graph allows).


def slot_state_tensors(trainer: "MultiLoraTrainer", slot: int) -> dict[str, tuple[dict, dict]]:
    """{"weight"|"grad"|"exp_avg"|"exp_avg_sq": (A per layer, B per layer)}: the slot's live
    blocks gathered to TP=1 Megatron layout, fp32 on CPU (grad = this DP rank's pending part;
    bf16 moments of a compact state converted exactly). Collective over TP."""
    state = trainer.slots.state(slot)
    layers = trainer.slots.trained_layers(state.hyper)
    return {kind: trainer.slots.read_full(slot, state_kind(kind, state.hyper.state_dtype), state.rank, layers)
            for kind in KINDS}


def save_slot_state(trainer: "MultiLoraTrainer", slot: int, out_dir: str | Path) -> str:
    """LoRA weights, Adam moments, pending gradient and counters, step (= schedule state).

    Tensors are stored gathered in TP=1 layout and summed over DP, so a state
    reloads under any tp/dp. Collective; rank 0 writes.
    """
    state, pending, parts = slot_state_snapshot(trainer, slot)
    if trainer.layout.rank == 0:
        write_slot_state(trainer.config, out_dir, state, pending, parts)
    return str(out_dir)


def save_slot_state_in_background(trainer: "MultiLoraTrainer", slot: int, out_dir: str | Path, writer: "ExportWriter") -> str:
    """`save_slot_state` whose write runs on rank 0's `writer` thread (trainer/export/export_writer.py):
    the state is taken now, as copies no later call changes (collective, in call order with the
    train calls), and the call returns before the folder is written; `writer.wait(out_dir)` returns
    once it is committed, or raises the write's error. Other ranks write nothing."""
    out = str(out_dir)
    try:
        state, pending, parts = slot_state_snapshot(trainer, slot, copy=True)
    except BaseException as e:
        if trainer.layout.rank == 0:
            writer.fail(out, e)  # its waiter raises instead of waiting for a write that never comes
        raise
    if trainer.layout.rank == 0:
        nbytes = sum(t.numel() * t.element_size() for pair in parts.values() for d in pair for t in d.values())
        writer.submit(out, lambda: write_slot_state(trainer.config, out, state, pending, parts), nbytes)
    return out


def slot_state_snapshot(trainer: "MultiLoraTrainer", slot: int, *, copy: bool = False) -> tuple[SlotState, torch.Tensor, dict]:
    """The slot's state as `save_slot_checkpoint` takes it: its counters, its pending statistics and its
    tensors (slot_state_tensors; the pending gradient and statistics summed over DP). Collective.
    `copy`: nothing returned shares memory with the live slot, so later calls cannot change it (on a
    CPU trainer the gathered TP=1 blocks are views of the slot's buffers)."""
    state = trainer.slots.state(slot)
    parts = slot_state_tensors(trainer, slot)
    pending = state.pending.clone()
    if trainer.layout.dp_size > 1:  # pending gradient and statistics are per DP rank: save their sum
        for d in parts["grad"]:
            for name, t in d.items():
                t = t.to(trainer.device, copy=True)  # a copy: on a CPU trainer `t` is a view of the live gradient
                dist.all_reduce(t, group=dp_group())
                d[name] = t.cpu()
        pending_dev = pending.to(trainer.device)
        dist.all_reduce(pending_dev, group=dp_group())
        pending = pending_dev.cpu()
    if copy:
        state = dataclasses.replace(state)  # its counters as they are now
        if trainer.device.type == "cpu":  # on a GPU trainer the gathered tensors are host copies already
            parts = {kind: tuple({name: t.clone() for name, t in d.items()} for d in pair) for kind, pair in parts.items()}
    return state, pending, parts


def write_slot_state(config: TrainerConfig, out_dir: str | Path, state: SlotState, pending: torch.Tensor, parts: dict) -> None:
    """Rank 0's write: committed whole in the trainer's store (trainer/storage/store.py)."""
    with open_store(config.storage).write_folder(out_dir) as tmp:
        save_slot_checkpoint(tmp, state, pending, parts, config)


@torch.no_grad()
def load_slot_state(trainer: "MultiLoraTrainer", slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
    """Restore into the free ``slot`` a state saved by save_slot_state. ``registration``: the
    tenant that resumes it (a run resumed under a new registration id); default the one that
    saved it. Collective."""
    slots = trainer.slots
    slots.require_free(slot, "clear it before loading a state into it")
    folder = readable_folder(open_store(trainer.config.storage), in_dir, legacy_marker=META)
    meta, parts, pending = load_slot_checkpoint(folder, slots.layers, trainer.config)
    rank, state_dtype = meta["rank"], SlotHyperParams(**meta["hyper"]).state_dtype
    slots.buffers.zero_slot(slot)
    for kind in KINDS:
        if kind != "grad" or trainer.layout.dp_rank == 0:  # the summed pending gradient lives on DP rank 0
            slots.write_full(slot, state_kind(kind, state_dtype), rank, *parts[kind])
    on_rank = pending if trainer.layout.dp_rank == 0 else zero_stats()
    slots.occupy(slot, SlotState.from_counters(meta, on_rank, registration))
    return slots.status(slot)


def save_slot_checkpoint(out_dir: str | Path, state: SlotState, pending: torch.Tensor, parts: dict,
                         config: TrainerConfig) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for kind in KINDS:
        a_full, b_full = parts[kind]
        dtype = stored_dtype(kind, state.hyper.state_dtype)  # bf16 moments came as fp32 (exact): back, exactly
        for name in a_full:
            tensors[f"{name}.A.{kind}"] = a_full[name].to(dtype).contiguous()
            tensors[f"{name}.B.{kind}"] = b_full[name].to(dtype).contiguous()
    meta = {
        "format": FORMAT,
        **state.counters(),
        "pending_stats": pending.tolist(),
        "base_model_path": config.base_model_path,
        "target_modules": list(config.target_modules),
    }
    # Tensors first, metadata last: a folder with a meta file is complete.
    save_file(tensors, str(out / TENSORS), metadata={"format": FORMAT})
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def stored_dtype(kind: str, state_dtype: str) -> torch.dtype:
    """The dtype a checkpoint stores ``kind`` in: the moments in the slot's state dtype, the rest fp32."""
    return STATE_DTYPES[state_dtype] if kind in MOMENT_KINDS else torch.float32


def load_slot_checkpoint(in_dir: str | Path, layers: list, config: TrainerConfig) -> tuple[dict, dict, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(in_dir)
    if not (folder / META).is_file() or not (folder / TENSORS).is_file():
        raise FileNotFoundError(f"{folder} is not a slot state folder: need {META} and {TENSORS}")
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["rank"] > config.max_rank:
        raise ValueError(f"{folder}: slot rank {meta['rank']} exceeds the trainer's max_rank {config.max_rank}")
    raw = load_file(str(folder / TENSORS))
    hyper = SlotHyperParams(**meta["hyper"])
    trained = [layer for layer in layers if layer_trained(layer, hyper)]
    known = {f"{layer.name}.{ab}.{kind}" for layer in trained for ab in "AB" for kind in KINDS}
    foreign = sorted({k.split(".A.")[0].split(".B.")[0] for k in raw if k not in known})
    if foreign:
        raise ValueError(f"{folder}: the state has LoRA on {foreign[:4]}, which this trainer has none of for the "
                         f"slot's targets {list(meta['hyper'].get('targets', ['attention', 'mlp']))} (saved by a trainer "
                         f"with target_modules {meta['target_modules']}; this one has {list(config.target_modules)})")
    parts = {}
    rank = meta["rank"]
    for kind in KINDS:
        a_full, b_full = {}, {}
        for layer in trained:
            a, b = raw.get(f"{layer.name}.A.{kind}"), raw.get(f"{layer.name}.B.{kind}")
            if a is None or b is None:
                raise ValueError(f"{folder}: missing {layer.name} {kind} tensors (saved by a trainer with "
                                 f"target_modules {meta['target_modules']}; this one has {list(config.target_modules)})")
            if tuple(a.shape) != layer.a_full_shape(rank) or tuple(b.shape) != layer.b_full_shape(rank):
                raise ValueError(
                    f"{folder}: {layer.name} {kind} has shapes {tuple(a.shape)}/{tuple(b.shape)}, "
                    f"expected {layer.a_full_shape(rank)}/{layer.b_full_shape(rank)}"
                )
            want = stored_dtype(kind, hyper.state_dtype)
            if a.dtype != want or b.dtype != want:
                raise ValueError(f"{folder}: {layer.name} {kind} is {a.dtype}/{b.dtype}; a slot with state_dtype "
                                 f"{hyper.state_dtype} stores it as {want}")
            a_full[layer.name], b_full[layer.name] = a, b
        parts[kind] = (a_full, b_full)
    pending = torch.tensor(meta["pending_stats"], dtype=torch.float64)
    return meta, parts, pending
