"""What the Tinker routes need from the trainer, and its in-process implementation.

``TinkerBackend`` speaks in model ids; it owns the model -> slot mapping. Its methods
are synchronous and run on the coalescer's single worker thread (never two at once).
``InProcessBackend`` drives a MultiLoraTrainer in this process (tests, benchmarks,
single-process use); the service's implementation over its trainer group and slot
allocation (api/tinker/fleet_backend.py) reuses it with the trainer group in place of
the trainer and registry slot leases in place of the in-process free-slot search.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trainer.config import SlotHyperParams
from trainer.core import MultiLoraTrainer
from trainer.slot_checkpoint import META as SLOT_META
from trainer.tinker_ops import AdamStep, Call, CallResult, Datum, TinkerOps


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int


@dataclass
class ModelCall:
    model_id: str
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class TinkerBackend(Protocol):
    base_model: str  # the served base model's name (get_server_capabilities, create_model)
    tokenizer_id: str  # what AutoTokenizer.from_pretrained loads offline
    max_seq_len: int
    max_rank: int

    def create(self, model_id: str, lora: LoraSpec, tenant: str = "") -> None: ...
    def release(self, model_id: str) -> None: ...
    def forward_backward(self, calls: list[ModelCall]) -> list[CallResult]: ...
    def forward(self, calls: list[ModelCall]) -> list[CallResult]: ...
    def optim_step(self, model_id: str, adam: AdamStep) -> dict[str, float]: ...
    def save_state(self, model_id: str, folder: Path) -> None: ...
    def save_sampler_weights(self, model_id: str, folder: Path) -> None: ...
    def load_state(self, model_id: str, folder: Path, optimizer: bool) -> None: ...
    def checkpoint_lora(self, folder: Path) -> LoraSpec: ...


class InProcessBackend:
    """Tinker models on the slots of one in-process MultiLoraTrainer (dp == 1)."""

    def __init__(self, trainer: MultiLoraTrainer, *, base_model: str, tokenizer_id: str, lora_alpha: float = 32.0,
                 max_seq_len: int = 4096):
        self.ops = TinkerOps(trainer, max_seq_len=max_seq_len)
        self.trainer = trainer
        self.base_model = base_model
        self.tokenizer_id = tokenizer_id
        self.lora_alpha = lora_alpha
        self.max_seq_len = max_seq_len
        self.max_rank = trainer.config.max_rank
        self._slots: dict[str, int] = {}
        self._ranks: dict[str, int] = {}  # model -> LoRA rank (load_state checks the checkpoint's)
        self._lock = threading.Lock()  # create/release may come from the worker and from tests

    def _slot(self, model_id: str) -> int:
        slot = self._slots.get(model_id)
        if slot is None:
            raise ValueError(f"model {model_id} has no trainer slot (released?)")
        return slot

    def create(self, model_id: str, lora: LoraSpec, tenant: str = "") -> None:
        if not 1 <= lora.rank <= self.max_rank:
            raise ValueError(f"LoRA rank {lora.rank} not supported: 1..{self.max_rank} on this server")
        with self._lock:
            if model_id in self._slots:
                raise ValueError(f"model {model_id} exists")
            slot = self._take_slot(model_id, tenant)
            try:
                self.trainer.init_slot(slot, SlotHyperParams(rank=lora.rank, alpha=self.lora_alpha), seed=lora.seed,
                                       registration=model_id)
            except BaseException:
                self._give_slot(model_id)
                raise
            self._slots[model_id] = slot
            self._ranks[model_id] = lora.rank

    def release(self, model_id: str) -> None:
        with self._lock:
            slot = self._slots.pop(model_id, None)
            self._ranks.pop(model_id, None)
            if slot is not None:
                self.trainer.clear_slot(slot)
                self._give_slot(model_id)

    # Slot ownership: which trainer slot a new model may take. Here: any slot this trainer
    # leaves empty; the service's backend (api/tinker/fleet_backend.py) leases it from the
    # registry instead, so Tinker models and dataset-driven runs share one count.
    def _take_slot(self, model_id: str, tenant: str) -> int:
        used = set(self._slots.values())
        free = [s for s in range(self.trainer.config.num_slots) if s not in used and self.trainer.slots[s] is None]
        if not free:
            raise ValueError(f"no free trainer slot: all {self.trainer.config.num_slots} are in use; unload a model first")
        return free[0]

    def _give_slot(self, model_id: str) -> None:
        """The slot taken for ``model_id`` is free again (nothing to record in process)."""

    def _calls(self, calls: list[ModelCall]) -> tuple[list[Call], list[str | None]]:
        out, errors = [], []
        for c in calls:
            slot = self._slots.get(c.model_id)
            errors.append(None if slot is not None else f"model {c.model_id} has no trainer slot (released?)")
            out.append(Call(slot if slot is not None else -1, c.data, c.loss_fn, c.loss_fn_config))
        return out, errors

    def _run(self, calls: list[ModelCall], backward: bool) -> list[CallResult]:
        converted, errors = self._calls(calls)
        keep = [i for i, e in enumerate(errors) if e is None]
        run = self.ops.forward_backward if backward else self.ops.forward
        results = dict(zip(keep, run([converted[i] for i in keep]))) if keep else {}
        return [results.get(i) or CallResult(error=errors[i]) for i in range(len(calls))]

    def forward_backward(self, calls: list[ModelCall]) -> list[CallResult]:
        return self._run(calls, backward=True)

    def forward(self, calls: list[ModelCall]) -> list[CallResult]:
        return self._run(calls, backward=False)

    def optim_step(self, model_id: str, adam: AdamStep) -> dict[str, float]:
        return self.ops.optim_step(self._slot(model_id), adam)

    def save_state(self, model_id: str, folder: Path) -> None:
        self.trainer.save_slot_state(self._slot(model_id), folder)

    def save_sampler_weights(self, model_id: str, folder: Path) -> None:
        self.trainer.export_peft(self._slot(model_id), folder)

    def checkpoint_lora(self, folder: Path) -> LoraSpec:
        meta_file = Path(folder) / SLOT_META
        if not meta_file.is_file():
            raise ValueError("no training checkpoint at that path (save_state makes one)")
        meta = json.loads(meta_file.read_text())
        return LoraSpec(rank=int(meta["hyper"]["rank"]), seed=int(meta["seed"]))

    def load_state(self, model_id: str, folder: Path, optimizer: bool) -> None:
        slot = self._slot(model_id)
        lora = self.checkpoint_lora(folder)
        have = self._ranks.get(model_id)
        if have is not None and have != lora.rank:
            raise ValueError(f"checkpoint has LoRA rank {lora.rank}, the model has rank {have}")
        backup = Path(tempfile.mkdtemp(prefix="tinker-restore-"))  # keep the slot if the load fails
        self.trainer.save_slot_state(slot, backup)
        try:
            self.trainer.clear_slot(slot)
            try:
                self.trainer.load_slot_state(slot, folder, registration=model_id)
            except Exception:
                self.trainer.clear_slot(slot)  # whatever the failed load left (clearing an empty slot is fine)
                self.trainer.load_slot_state(slot, backup, registration=model_id)
                raise
            if not optimizer:
                self.trainer.reset_optimizer(slot)
        finally:
            shutil.rmtree(backup, ignore_errors=True)
