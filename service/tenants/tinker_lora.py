"""What a Tinker model trains: its LoRA (`LoraSpec`: rank, init seed, target groups), and the LoRA
of a Tinker training checkpoint (`checkpoint_lora`, for create_training_client_from_state and
load_state's check)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.storage.slot_state_format import read_slot_meta


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int
    # What the model trains (trainer.config.TARGET_GROUPS order): the SDK's train_attn, train_mlp and train_unembed.
    targets: tuple[str, ...] = ("attention", "mlp", "unembed")


def checkpoint_lora(folder: str | Path) -> LoraSpec:
    """The LoRA shape of a Tinker training checkpoint (save_state's folder); ValueError if none."""
    meta = read_slot_meta(folder)
    if meta is None:
        raise ValueError("no training checkpoint at that path (save_state makes one)")
    targets = tuple(meta["hyper"].get("targets") or ("attention", "mlp"))  # states saved before targets: attention + MLP
    return LoraSpec(rank=int(meta["hyper"]["rank"]), seed=int(meta["seed"]), targets=targets)
