"""A Tinker model as a tenant: `TinkerModel`, its operations queued in the order its client sent them.

The Tinker face (api/tinker/) turns each request into one operation on the model's queue
(`forward_backward`, `forward`, `optim_step`, `save_state`, `save_sampler_weights`,
`load_state`, `unload`) with a `done(value, error)` callback, and returns the future's id;
the scheduler (service/scheduling/scheduler.py) runs the operations in rounds on the loop's thread and
calls `done` there. Nothing here knows HTTP.

What a model offers a round (`offer`), from the head of its queue:
  * the run of forward_backward / forward calls at the head (all go into the round's ONE
    mixed step: calls of different models pending together share it), then at most one
    optim_step after them (applied after the pass, so the calls before it see the weights
    before it, and the calls after it wait for the next round); or
  * one operation that runs alone (save, load, unload), when that is the head.
So a model's operations run in the order it sent them (T3): an optim_step is never overtaken
by a later forward_backward, nor runs before an earlier one.

Invariants:
  M1 losses are sums and gradients accumulate across forward_backward calls until optim_step
     (trainer/step/round_runner.py); bad input fails only its own call and changes nothing;
  M2 a cancelled operation (its future answered "cancelled" meanwhile) is dropped unrun;
  M3 while the model is evicted its operations wait in its queue, in order, and `waiting_reason`
     says why (the future answers try_again with it); `unload` never waits for a slot;
  M4 a failed load_state leaves the model as it was (its state is saved before and restored).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

from service.scheduling.tenant import Offer, RoundContext, SlotOp, TenantKind
from trainer.storage.slot_state_format import read_slot_meta
from trainer.interface import TrainerInterface
from trainer.rounds import AdamStep, Call, Datum

Done = Callable[[Any, BaseException | None], None]  # (value, error): exactly one is not None... or both None


class OpKind(StrEnum):
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM = "optim_step"
    ALONE = "alone"  # runs alone, after a round's trainer call (save, load, unload)


@dataclass
class TinkerOp:
    kind: OpKind
    done: Done
    data: list[Datum] | None = None  # FORWARD_BACKWARD / FORWARD
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    adam: AdamStep | None = None  # OPTIM
    run: Callable[[int | None], Any] | None = None  # ALONE: given the model's slot (None: evicted)
    needs_slot: bool = True
    cancelled: Callable[[], bool] = lambda: False
    queued_at: float = field(default_factory=time.time)


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


class TinkerModel:
    kind = TenantKind.TINKER

    def __init__(self, model_id: str, owner: str, lora: LoraSpec, *, trainer: TrainerInterface, clock: Callable[[], float],
                 wake: Callable[[], None], end: Callable[[str], None]) -> None:
        """`trainer`: the scheduler's trainer; `wake()`: the scheduler's notify; `end(key)`: the
        scheduler's release (unload)."""
        self.key = self.name = model_id
        self.owner = owner
        self.lora = lora
        self._trainer = trainer
        self._clock = clock
        self._wake = wake
        self._end = end
        self._queue: deque[TinkerOp] = deque()
        self._mu = threading.Lock()  # the API's threads append, the loop's thread takes
        self.steps_in = 0
        self.last_active = clock()
        self.waiting_reason: str | None = None  # M3
        self.ended = False
        self.end_reason = f"model {model_id} is unloaded"  # what a call sent after its end is told

    # --- what the Tinker face calls (any thread) ------------------------------------------------

    def submit(self, op: TinkerOp) -> None:
        if self.ended:
            op.done(None, ValueError(self.end_reason))
            return
        with self._mu:
            self._queue.append(op)
        self._wake()

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.FORWARD_BACKWARD, done, data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kw))

    def forward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.FORWARD, done, data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kw))

    def optim_step(self, adam: AdamStep, done: Done, **kw: Any) -> None:
        adam.check()  # refused now (ValueError), before it is queued
        self.submit(TinkerOp(OpKind.OPTIM, done, adam=adam, **kw))

    def save_state(self, folder: Path, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._trainer.save_slot_state(slot, _new_folder(folder)), **kw))

    def save_sampler_weights(self, folder: Path, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._trainer.export_peft(slot, _new_folder(folder)), **kw))

    def export_with(self, write: Callable[[Callable[[Path], str]], Any], done: Done, **kw: Any) -> None:
        """`write(export)` on the scheduler's thread, where `export(to)` writes the model's PEFT folder
        to `to` (the Tinker face's external weights: it encrypts and renames what export wrote)."""
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: write(lambda to: self._trainer.export_peft(slot, str(to))), **kw))

    def load_state(self, folder: Path, optimizer: bool, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._load(slot, Path(folder), optimizer), **kw))

    def unload(self, done: Done, **kw: Any) -> None:
        self.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: self._end(self.key), needs_slot=False, **kw))

    # --- the tenant interface (the scheduler, on the loop's thread) ------------------------------

    def expects_work(self) -> bool:
        return False  # its calls come when its client sends them: a round never waits for them

    def _head(self) -> TinkerOp | None:
        """The first operation not cancelled (M2: cancelled ones are answered already; dropped)."""
        with self._mu:
            while self._queue and self._queue[0].cancelled():
                self._queue.popleft()
            return self._queue[0] if self._queue else None

    def ready(self) -> bool:
        return self._head() is not None

    def wants_slot(self) -> bool:
        head = self._head()
        return head is not None and head.needs_slot

    def waiting_since(self) -> float:
        head = self._head()
        return head.queued_at if head is not None else time.time()

    def waiting_for_slot(self, reason: str) -> None:
        self.waiting_reason = reason

    def offer(self, slot: int) -> Offer | None:
        taken: list[TinkerOp] = []
        with self._mu:
            while self._queue and self._queue[0].kind in (OpKind.FORWARD_BACKWARD, OpKind.FORWARD):
                op = self._queue.popleft()
                if not op.cancelled():
                    taken.append(op)
            if self._queue and self._queue[0].kind == OpKind.OPTIM:
                taken.append(self._queue.popleft())
            elif not taken and self._queue and self._queue[0].kind == OpKind.ALONE:
                op = self._queue.popleft()
                return Offer(single=SlotOp(op.run, op.needs_slot), context=[op])
        if not taken:
            return None
        calls = [Call(slot, op.data, op.loss_fn, op.loss_fn_config) for op in taken if op.kind == OpKind.FORWARD_BACKWARD]
        forwards = [Call(slot, op.data, op.loss_fn, op.loss_fn_config) for op in taken if op.kind == OpKind.FORWARD]
        optim = next((op.adam for op in taken if op.kind == OpKind.OPTIM), None)
        return Offer(calls=calls, forwards=forwards, optim=optim, context=taken)

    def offer_unplaced(self) -> Offer | None:
        """While evicted: the head operation if it needs no slot (unload), taken."""
        with self._mu:
            if self._queue and self._queue[0].kind == OpKind.ALONE and not self._queue[0].needs_slot:
                op = self._queue.popleft()
                return Offer(single=SlotOp(op.run, needs_slot=False), context=[op])
        return None

    def settle(self, offer: Offer, part: Any, slot: int, ctx: RoundContext) -> None:
        calls, forwards = iter(part.calls), iter(part.forwards)
        for op in offer.context:
            if op.kind == OpKind.FORWARD_BACKWARD:
                op.done(next(calls), None)
            elif op.kind == OpKind.FORWARD:
                op.done(next(forwards), None)
            elif op.kind == OpKind.OPTIM:
                if isinstance(part.optim, dict):
                    self.steps_in += 1
                    op.done(part.optim, None)
                else:
                    op.done(None, ValueError(str(part.optim)))
        self._worked()
        return None

    def settle_single(self, offer: Offer, value: Any, error: BaseException | None) -> None:
        op = offer.context[0]
        self._worked()
        op.done(value, error)

    def give_back(self, offer: Offer, error: str) -> None:
        """The round failed before its work ran: every operation taken gets the error."""
        for op in offer.context:
            op.done(None, RuntimeError(error))

    def _worked(self) -> None:
        self.last_active = self._clock()
        self.waiting_reason = None

    def on_evicted(self) -> None:
        pass

    def on_restored(self) -> None:
        self.steps_in, self.last_active, self.waiting_reason = 0, self._clock(), None

    def release(self, reason: str | None = None, error: type[Exception] = RuntimeError) -> None:
        """It ends; operations still queued get `reason` as `error` (ValueError: the caller's, e.g.
        the model was refused a slot; RuntimeError: the service's, e.g. lost with the trainer)."""
        self.ended = True
        if reason:
            self.end_reason = reason
        with self._mu:
            left, self._queue = list(self._queue), deque()
        for op in left:
            op.done(None, error(self.end_reason))

    # --- slot operations ----------------------------------------------------------------------

    def _load(self, slot: int, folder: Path, optimizer: bool) -> None:
        """M4: the slot's state is saved first and restored if the load fails."""
        lora = checkpoint_lora(folder)
        if lora.rank != self.lora.rank:
            raise ValueError(f"checkpoint has LoRA rank {lora.rank}, the model has rank {self.lora.rank}")
        if lora.targets != self.lora.targets:
            raise ValueError(f"checkpoint trains {list(lora.targets)}, the model trains {list(self.lora.targets)} "
                             "(train_attn / train_mlp / train_unembed must match)")
        backup = Path(tempfile.mkdtemp(prefix="tinker-restore-"))
        t = self._trainer
        t.save_slot_state(slot, backup)
        try:
            t.clear_slot(slot)
            try:
                t.load_slot_state(slot, folder, registration=self.key)
            except Exception:
                t.clear_slot(slot)  # whatever the failed load left (clearing an empty slot is fine)
                t.load_slot_state(slot, backup, registration=self.key)
                raise
            if not optimizer:
                t.reset_optimizer(slot)
        finally:
            shutil.rmtree(backup, ignore_errors=True)


def _new_folder(folder: Path) -> str:
    """A checkpoint is written once: an existing one is refused (ValueError), never overwritten."""
    if Path(folder).exists():
        raise ValueError(f"checkpoint folder {Path(folder).name!r} exists; choose another name")
    return str(folder)
