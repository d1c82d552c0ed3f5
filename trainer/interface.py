"""What the service may ask of a trainer: `TrainerInterface`, the one typed interface.

Implemented by the rank's actor body (trainer/actor.py `TrainWorker`: one rank, in a Ray actor or
in process over a built trainer) and by the trainer group (service/fleet/trainer_group.py
`TrainerGroup`: every rank at once, rank 0 answers). Every caller in service/ is typed against it
(the scheduler, the tenants, the fleet runtime); nothing else of the trainer is reachable from the
service. Light to import: no Megatron, no torch model code.

Every method is collective: all ranks run it with the same arguments, in the same order. The
slot-changing methods answer what the slot holds afterwards (a status dict); a failure raises and
leaves the slot as it was (swap_out raises SwapError without changing it; a load into a slot
that is not free is refused).

Slots: `init_slot` / `load_slot_state` fill a free slot (fresh, from a PEFT folder, or from a
saved state), `clear_slot` frees one; `run_round` trains (trainer/rounds.py: every tenant's work
of a scheduler round in ONE mixed step); `save_slot_state` / `export_peft` / `peft_tensors` read
one (`begin_save_slot_state`: the state taken now, its folder written in the background); `swap_out` / `swap_in` move a slot's whole state out of the device and back under a key
(keep-warm eviction, bit-exact), with `drop_swapped`, `prefetch_swapped` and `swap_tiers` over
what is swapped out; `health` says whether the trainer answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainer.config import SlotHyperParams
from trainer.rounds import RoundResult, RoundWork


@dataclass(frozen=True)
class Health:
    """Whether a component answers, and what it says (the service's ComponentHealth is this type)."""

    ok: bool
    detail: str = ""


class PendingWrite(Protocol):
    """A folder a trainer is writing in the background (`begin_save_slot_state`)."""

    def done(self) -> bool:
        """Whether the write has ended (committed or failed), without waiting."""
        ...

    def result(self) -> str:
        """The committed folder, once written (waits); raises the write's error."""
        ...


@dataclass(frozen=True)
class WrittenFolder:
    """A PendingWrite already committed (a trainer that wrote before it answered)."""

    folder: str

    def done(self) -> bool:
        return True

    def result(self) -> str:
        return self.folder


@runtime_checkable
class TrainerInterface(Protocol):
    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | None = None,
                  registration: str | None = None) -> dict:
        """Fill the free `slot`: A seeded (PEFT's kaiming-uniform), B zero, or the weights of the PEFT
        folder `init_from`; `registration` names the tenant (samples of another are dropped)."""
        ...

    def clear_slot(self, slot: int) -> None:
        """Free `slot`: weights, gradients, optimizer state and pending samples gone (idempotent)."""
        ...

    def run_round(self, work: RoundWork) -> RoundResult:
        """One scheduler round: the dataset samples and the Tinker calls in one mixed step, then the
        Tinker optimizer steps (trainer/rounds.py states the order and the failure isolation)."""
        ...

    def save_slot_state(self, slot: int, out_dir: str | Path) -> str:
        """Everything needed to resume the slot (weights, moments, pending gradient, step) to a folder."""
        ...

    def begin_save_slot_state(self, slot: int, out_dir: str | Path) -> PendingWrite:
        """`save_slot_state` without waiting for the write: the state is taken now (later calls do not
        change what is written), the folder is committed in the background (`PendingWrite`)."""
        ...

    def load_slot_state(self, slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
        """Fill the free `slot` from a folder `save_slot_state` wrote."""
        ...

    def reset_optimizer(self, slot: int) -> None:
        """The slot's Adam moments, update count and pending gradient to zero (weights kept)."""
        ...

    def export_peft(self, slot: int, out_dir: str | Path, dtype: str = "float32", durable: bool = True) -> str:
        """The slot as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors);
        `durable=False`: committed without waiting for the disk (trainer/storage/store.py S5)."""
        ...

    def peft_tensors(self, slot: int) -> Any:
        """(PEFT config, {HF name: tensor}) of the slot, for a transfer without files."""
        ...

    def swap_out(self, slot: int, key: str) -> dict:
        """Evict the slot's whole state under `key` (host memory, then a spill file); SwapError
        leaves the slot as it was. Answers where it went, its bytes and seconds."""
        ...

    def swap_in(self, slot: int, key: str) -> dict:
        """Bring `key`'s state back into the free `slot`, bit-exact."""
        ...

    def drop_swapped(self, key: str) -> bool:
        """Forget `key`'s swapped-out state (the tenant ended)."""
        ...

    def prefetch_swapped(self, key: str) -> str:
        """Start reading `key`'s spill file into host memory (returns at once)."""
        ...

    def swap_tiers(self) -> dict:
        """{"host"|"disk"|"prefetched": {"count", "bytes"[, "budget_bytes"]}} of the swap store."""
        ...

    def health(self) -> Health:
        """Whether the trainer answers (a busy trainer is healthy)."""
        ...
