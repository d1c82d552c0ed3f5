"""A Tinker model's checkpoints: its LoRA shape (`LoraSpec`, and a saved state's: `checkpoint_lora`),
the rule that a checkpoint folder is written once (`new_folder`), and load_state into its slot
with the slot's state kept aside until the load succeeded (`load_into_slot`, M4 of
service/tenants/tinker_model.py). The saves themselves are the trainer's (`begin_save_slot_state`,
`begin_save_peft`: trainer/interface.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.interface import TrainerInterface
from trainer.storage.locations import readable_folder
from trainer.storage.slot_state_format import META, read_slot_meta


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int
    # What the model trains (trainer.config.TARGET_GROUPS order): the SDK's train_attn, train_mlp
    # and train_unembed.
    targets: tuple[str, ...] = ("attention", "mlp", "unembed")


def checkpoint_lora(folder: str | Path) -> LoraSpec:
    """The LoRA shape of a Tinker training checkpoint (save_state's folder); ValueError if none."""
    meta = read_slot_meta(folder)
    if meta is None:
        raise ValueError("no training checkpoint at that path (save_state makes one)")
    targets = tuple(meta["hyper"].get("targets") or ("attention", "mlp"))  # states saved before targets: attention + MLP
    return LoraSpec(rank=int(meta["hyper"]["rank"]), seed=int(meta["seed"]), targets=targets)


def new_folder(store, folder: str) -> str:  # noqa: ANN001 - a trainer.storage CheckpointStore
    """A checkpoint is written once: an existing one is refused (ValueError), never overwritten."""
    if store.exists(store.key_of(folder)):
        raise ValueError(f"checkpoint folder {Path(folder).name!r} exists; choose another name")
    return folder


def load_into_slot(trainer: TrainerInterface, store, backup: str, slot: int, folder: str, *, optimizer: bool,  # noqa: ANN001
                   lora: LoraSpec, registration: str) -> None:
    """load_state of the saved state `folder` into the model's `slot` (its shape must be `lora`'s):
    the slot's state is saved to the store key `backup` first and restored if the load fails, so a
    failed load leaves the model as it was (M4); `optimizer` False: the moments start at zero."""
    saved = checkpoint_lora(readable_folder(store, folder, legacy_marker=META))
    if saved.rank != lora.rank:
        raise ValueError(f"checkpoint has LoRA rank {saved.rank}, the model has rank {lora.rank}")
    if saved.targets != lora.targets:
        raise ValueError(f"checkpoint trains {list(saved.targets)}, the model trains {list(lora.targets)} "
                         "(train_attn / train_mlp / train_unembed must match)")
    trainer.save_slot_state(slot, store.url(backup))
    try:
        trainer.clear_slot(slot)
        try:
            trainer.load_slot_state(slot, folder, registration=registration)
        except Exception:
            trainer.clear_slot(slot)  # whatever the failed load left (clearing an empty slot is fine)
            trainer.load_slot_state(slot, store.url(backup), registration=registration)
            raise
        if not optimizer:
            trainer.reset_optimizer(slot)
    finally:
        store.delete(backup)
