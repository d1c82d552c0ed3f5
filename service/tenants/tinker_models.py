"""The Tinker face's one handle on the scheduler: `TinkerModels`.

`TinkerModels` creates models (an admission at the scheduler's next placement: a free slot
now, or one freed by evicting an idle tenant, else refused) and finds them; their operations
go straight onto each model's queue (service/tenants/tinker_model.py). In the fleet, the training
loop runs the rounds (service/loop/training_loop.py); the scheduler is the only thing that calls the
trainer: api/tinker/ starts no thread of its own.

Latency of a Tinker call (docs/tinker.md): a submission wakes the scheduler's wait at once; a
call then waits at most `window_s` for calls of other models to join it, plus the round in
progress when it came (the loop's train call, or a placement's swaps), plus its own round. It
never waits for a dataset run's step: a round with a ready Tinker call does not wait for the
other tenants beyond `window_s`.
"""

from __future__ import annotations

import logging
from typing import Callable

from service.scheduling.scheduler import Admission, Scheduler
from service.tenants.tinker_model import LoraSpec, TinkerModel
from service.scheduling.tenant import TenantKind
from trainer.config import TARGET_GROUPS, SlotHyperParams

log = logging.getLogger(__name__)


class TinkerModels:
    def __init__(self, scheduler: Scheduler, *, base_model: str, tokenizer_id: str, max_rank: int, lora_alpha: float = 32.0,
                 max_seq_len: int = 4096, target_groups: tuple[str, ...] = TARGET_GROUPS) -> None:
        """``target_groups``: what the trainer has LoRA layers for (TrainerConfig.target_groups)."""
        self.scheduler = scheduler
        self.base_model = base_model  # the served base model's name (get_server_capabilities, create_model)
        self.tokenizer_id = tokenizer_id  # what AutoTokenizer.from_pretrained loads offline
        self.max_rank = max_rank
        self.target_groups = tuple(target_groups)
        self.lora_alpha = lora_alpha
        self.max_seq_len = max_seq_len

    def create(self, model_id: str, owner: str, lora: LoraSpec, done: Callable[[BaseException | None], None]) -> TinkerModel:
        """Queue the model's admission (any thread); `done(None)` once it holds an initialized slot,
        `done(error)` when refused (NoFreeSlot: every slot held and none idle) or the init failed.
        Operations may be queued on the returned model at once: they run after it is admitted."""
        if not 1 <= lora.rank <= self.max_rank:
            raise ValueError(f"LoRA rank {lora.rank} not supported: 1..{self.max_rank} on this server")
        missing = [t for t in lora.targets if t not in self.target_groups]
        if missing:
            raise ValueError(f"LoRA on {missing} is not available on this server: its trainer has LoRA layers for "
                             f"{list(self.target_groups)} (train_unembed needs output_layer in trainer.target_modules)")
        s = self.scheduler
        model = TinkerModel(model_id, owner, lora, trainer=s.trainer, clock=s.clock, wake=s.notify, end=s.release)

        def enter(slot: int) -> None:
            s.trainer.init_slot(slot, SlotHyperParams(rank=lora.rank, alpha=self.lora_alpha, targets=lora.targets),
                                seed=lora.seed, registration=model_id)

        def admitted(error: BaseException | None) -> None:
            if error is not None:  # its queued operations get the reason, as the caller's error
                model.release(f"model {model_id} was not created: {error}", error=ValueError)
            done(error)

        s.admit(Admission(model, enter, admitted))
        return model

    def get(self, model_id: str) -> TinkerModel | None:
        t = self.scheduler.get(model_id)
        return t if isinstance(t, TinkerModel) else None

    def models(self) -> list[TinkerModel]:
        return [t for t in self.scheduler.tenants(TenantKind.TINKER) if isinstance(t, TinkerModel)]

    def stats(self) -> dict[str, float]:
        """The Tinker gauges of GET /metrics (the scheduler's counters and the models' residency)."""
        c = self.scheduler.counters
        models = self.models()
        resident = {h.key for h in self.scheduler.slot_holders().values()}
        return {
            "mixed_steps": c["mixed_steps"], "forward_backward_calls": c["forward_backward_calls"],
            "coalescing_factor": c["forward_backward_calls"] / c["mixed_steps"] if c["mixed_steps"] else 0.0,
            "largest_step": c["largest_step"], "joined_steps": c["joined_steps"], "joined_calls": c["joined_calls"],
            "models_evicted": sum(1 for m in models if m.key not in resident),
            "models_waiting_for_slot": sum(1 for m in models if m.waiting_reason is not None),
            "evictions": c["evictions"], "restores": c["restores"],
        }
