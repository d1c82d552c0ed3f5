"""What the Tinker routes need from the trainer, and its in-process implementation.

``TinkerBackend`` speaks in model ids; it owns the model -> slot mapping. Its methods
are synchronous and run on the coalescer's single worker thread (never two at once).
``InProcessBackend`` drives a MultiLoraTrainer in this process (tests, benchmarks,
single-process use); the service's implementation over its trainer group and slot
allocation (api/tinker/fleet_backend.py) reuses it with the trainer group in place of
the trainer and registry slot leases in place of the in-process free-slot search.

Idle eviction (``idle_evict_s``; docs/tinker.md "More models than slots"): a model with no
call for ``idle_evict_s`` seconds is swapped out when something else needs its slot: a
model being created, an evicted model whose next call came, or (in the service) runs
queued for a slot. The swap is the trainer's bit-exact ``swap_out``/``swap_in``
(trainer/slot_swap.py: weights, Adam moments, step counters) and its slot is given back
(in the service: the registry lease is released). Invariants:
  E1 only a resident model with no queued call (not in ``busy``) and idle for at least
     ``idle_evict_s`` is evicted, least recently called first; the eviction itself runs
     inside ``hold_idle`` (the coalescer's), which refuses a model with a queued call or a
     call taken by either taker (one riding in the training loop's train call) and keeps
     both takers off the model while it is swapped out;
  E2 an evicted model's next call brings it back (into any free slot, evicting an idle
     model if none is free) before it runs; while no slot can be had the call waits in
     its queue (``admit`` reports it; the SDK is told "try again", queue paused_capacity);
  E3 a failed swap-out leaves the model resident and unchanged (slot_swap S1); a failed
     swap-in keeps the snapshot and gives the slot back;
  E4 all of it runs on the coalescer's one worker thread, like every other trainer call.
     The training loop's thread (api/tinker/fleet_backend.py ``_LoopRiders``) only reads:
     ``is_resident`` and ``_calls(..., bring_in=False)`` take no lock and swap nothing (that
     thread holds the trainer group's lock, which the worker takes while holding ``_lock``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Protocol

from trainer.actor import TrainWorker
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
    def admit(self, wanted: set[str], busy: set[str]) -> dict[str, str]: ...


class NoSlot(ValueError):
    """No trainer slot can be had for a model now (all held, none idle long enough)."""


class InProcessBackend:
    """Tinker models on the slots of one in-process MultiLoraTrainer (dp == 1)."""

    def __init__(self, trainer: MultiLoraTrainer, *, base_model: str, tokenizer_id: str, lora_alpha: float = 32.0,
                 max_seq_len: int = 4096, idle_evict_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``idle_evict_s``: a model with no call for this long may be swapped out when its slot is
        needed (None: never). ``clock``: monotonic seconds (tests pass their own)."""
        if idle_evict_s is not None and idle_evict_s < 0:
            raise ValueError(f"idle_evict_s must be >= 0 seconds or None (never evict), got {idle_evict_s}")
        self.ops = TinkerOps(trainer, max_seq_len=max_seq_len)
        self.trainer = trainer
        # The trainer's collective calls, typed once: trainer/actor.py TrainWorker over this trainer,
        # the interface service/trainer_group.py TrainerGroup has too (FleetBackend puts its group here).
        self.group: Any = TrainWorker(trainer)
        self.base_model = base_model
        self.tokenizer_id = tokenizer_id
        self.lora_alpha = lora_alpha
        self.max_seq_len = max_seq_len
        self.max_rank = trainer.config.max_rank
        self._slots: dict[str, int] = {}
        self._ranks: dict[str, int] = {}  # model -> LoRA rank (load_state checks the checkpoint's)
        self._tenants: dict[str, str] = {}  # model -> tenant (a lease taken again on swap-in names it)
        self._lock = threading.RLock()  # create/release may come from the worker and from tests
        self.idle_evict_s = idle_evict_s
        self._clock = clock
        self._last_call: dict[str, float] = {}  # resident or evicted model -> clock() of its last call
        self._evicted: set[str] = set()  # models swapped out (no slot; snapshot under _swap_key)
        self._busy: set[str] = set()  # models with queued calls (the coalescer's last admit): never evicted (E1)
        # E1's guard against both takers, set by the service to its coalescer's hold_idle; alone
        # (no coalescer, e.g. a test driving the backend) every model counts as idle for it.
        self.hold_idle: Callable[[str], AbstractContextManager[bool]] = lambda model_id: nullcontext(True)
        self.evictions = 0
        self.restores = 0

    def _slot(self, model_id: str) -> int:
        """The model's slot, swapping it back in first if it was evicted (E2); NoSlot if none can be had."""
        with self._lock:
            if model_id in self._evicted:
                self._bring_in(model_id)
            slot = self._slots.get(model_id)
            if slot is None:
                raise ValueError(f"model {model_id} has no trainer slot (released?)")
            self._last_call[model_id] = self._clock()
            return slot

    def _resident_slot(self, model_id: str) -> int:
        """The slot of a resident model, taking no lock and swapping nothing (E4: the loop's thread)."""
        slot = self._slots.get(model_id)
        if slot is None:
            raise ValueError(f"model {model_id} has no trainer slot (released or swapped out)")
        self._last_call[model_id] = self._clock()
        return slot

    def is_resident(self, model_id: str) -> bool:
        """Whether ``model_id`` holds its slot now. Takes no lock (the coalescer calls it under its own)."""
        return model_id in self._slots

    # -- idle eviction (E1-E4) ----------------------------------------------------------------------

    @staticmethod
    def _swap_key(model_id: str) -> str:
        return "tinker-" + model_id.replace(":", "_")  # never a registration id (those are hex)

    def evicted(self) -> set[str]:
        return set(self._evicted)

    def idle_models(self) -> list[str]:
        """Resident models that may be evicted now (E1), least recently called first."""
        if self.idle_evict_s is None:
            return []
        now = self._clock()
        idle = [m for m in self._slots if m not in self._busy and now - self._last_call.get(m, now) >= self.idle_evict_s]
        return sorted(idle, key=lambda m: (self._last_call.get(m, now), m))

    def evict(self, model_id: str) -> bool:
        """Swap the resident ``model_id`` out and give its slot back (E3: SwapError leaves it as it
        was); False (nothing done) when ``hold_idle`` finds a call of it queued or taken (E1)."""
        with self._lock, self.hold_idle(model_id) as idle:
            if not idle:
                return False
            slot = self._slots[model_id]
            self.group.swap_out(slot, self._swap_key(model_id))
            del self._slots[model_id]  # before hold_idle ends: no taker sees it resident from here on
            self._evicted.add(model_id)
            self._give_slot(model_id)
            self.evictions += 1
            return True

    def evict_idle(self, need: int) -> list[str]:
        """Evict up to ``need`` idle models (E1), least recently called first."""
        out: list[str] = []
        with self._lock:
            for m in self.idle_models():
                if len(out) >= need:
                    break
                if self.evict(m):
                    out.append(m)
        return out

    def _take_slot_evicting(self, model_id: str) -> int:
        """A slot for ``model_id``: a free one, else one freed by evicting the least recently
        called idle model; NoSlot naming what holds the slots when neither can be had."""
        try:
            return self._take_slot(model_id, self._tenants.get(model_id, ""))
        except ValueError as err:
            if not any(self.evict(m) for m in self.idle_models() if m != model_id):  # stops at the first evicted
                raise NoSlot(str(err)) from None
        return self._take_slot(model_id, self._tenants.get(model_id, ""))

    def _bring_in(self, model_id: str) -> None:
        slot = self._take_slot_evicting(model_id)
        try:
            self.group.swap_in(slot, self._swap_key(model_id))
        except BaseException:
            self._give_slot(model_id)  # E3: the snapshot stays stored for another try
            raise
        self._evicted.discard(model_id)
        self._slots[model_id] = slot
        self.restores += 1

    def admit(self, wanted: set[str], busy: set[str]) -> dict[str, str]:
        """Before a coalescer round: ``busy`` = models with queued or taken calls (never evicted), ``wanted``
        = those whose next call needs its slot. Brings every evicted wanted model back in (E2)
        and evicts idle models for runs queued outside (``_external_demand``). Returns
        model -> reason for the wanted models that must wait (no slot now)."""
        waiting: dict[str, str] = {}
        with self._lock:
            self._busy = set(busy)
            for m in sorted(wanted & self._evicted, key=lambda m: (self._last_call.get(m, 0.0), m)):
                try:
                    self._bring_in(m)
                except NoSlot as err:
                    waiting[m] = f"waiting for a trainer slot: {err}"
            if not waiting:
                self.evict_idle(self._external_demand())
        return waiting

    def _external_demand(self) -> int:
        """How many slots runs outside this backend wait for (in process: none)."""
        return 0

    def create(self, model_id: str, lora: LoraSpec, tenant: str = "") -> None:
        if not 1 <= lora.rank <= self.max_rank:
            raise ValueError(f"LoRA rank {lora.rank} not supported: 1..{self.max_rank} on this server")
        with self._lock:
            if model_id in self._slots:
                raise ValueError(f"model {model_id} exists")
            self._tenants[model_id] = tenant
            try:
                slot = self._take_slot_evicting(model_id)
            except NoSlot:
                self._tenants.pop(model_id, None)
                raise
            try:
                self.group.init_slot(slot, SlotHyperParams(rank=lora.rank, alpha=self.lora_alpha), seed=lora.seed,
                                     registration=model_id)
            except BaseException:
                self._give_slot(model_id)
                self._tenants.pop(model_id, None)
                raise
            self._slots[model_id] = slot
            self._ranks[model_id] = lora.rank
            self._last_call[model_id] = self._clock()

    def release(self, model_id: str) -> None:
        with self._lock:
            slot = self._slots.pop(model_id, None)
            self._ranks.pop(model_id, None)
            self._tenants.pop(model_id, None)
            self._last_call.pop(model_id, None)
            if model_id in self._evicted:  # out of its slot: only its snapshot is left to forget
                self._evicted.discard(model_id)
                self.group.drop_swapped(self._swap_key(model_id))
            if slot is not None:
                self.group.clear_slot(slot)
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

    def _calls(self, calls: list[ModelCall], bring_in: bool = True) -> tuple[list[Call], list[str | None]]:
        """Model ids -> slots, with an error for each call whose model has none. ``bring_in``:
        swap an evicted model back in (E2, the worker); False: resident models only (E4, the loop)."""
        slot_of = self._slot if bring_in else self._resident_slot
        out, errors = [], []
        for c in calls:
            try:
                slot, error = slot_of(c.model_id), None
            except ValueError as err:
                slot, error = -1, str(err)
            errors.append(error)
            out.append(Call(slot, c.data, c.loss_fn, c.loss_fn_config))
        return out, errors

    def _run(self, calls: list[ModelCall], backward: bool) -> list[CallResult]:
        self._busy |= {c.model_id for c in calls}  # bringing one of them in never evicts another (E1)
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
        self.group.save_slot_state(self._slot(model_id), folder)

    def save_sampler_weights(self, model_id: str, folder: Path) -> None:
        self.group.export_peft(self._slot(model_id), folder)

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
        self.group.save_slot_state(slot, backup)
        try:
            self.group.clear_slot(slot)
            try:
                self.group.load_slot_state(slot, folder, registration=model_id)
            except Exception:
                self.group.clear_slot(slot)  # whatever the failed load left (clearing an empty slot is fine)
                self.group.load_slot_state(slot, backup, registration=model_id)
                raise
            if not optimizer:
                self.group.reset_optimizer(slot)
        finally:
            shutil.rmtree(backup, ignore_errors=True)
