"""The service's Tinker backend: Tinker models on the slots of the running fleet's trainer.

``fleet_tinker_service(controller, settings)`` builds the ``TinkerService`` that
``lorafleet serve`` mounts (api/app.py) when ``settings.tinker_keys_file`` is set:

* the trainer is the fleet's ``TrainerGroup`` (every rank a Ray actor); the Tinker
  primitives run on every rank through its typed methods (``tinker_forward_backward``,
  ``tinker_forward``, ``tinker_optim_step``), slot state through the same methods the
  training loop uses;
* a model's trainer slot is a registry slot LEASE (service/registry.py I7) taken through
  the controller, so the registry stays the one owner of slots: a Tinker model counts
  against ``slots.num_slots`` exactly like a dataset-driven run, ``POST /v1/adapters``
  refuses when Tinker models hold the last slots, and a Tinker model beyond the free
  slots gets a clear error in its future;
* serialization with the training loop: ``TrainerGroup`` runs one collective call at a
  time (its lock), so a Tinker call never interleaves inside the loop's train call. The
  two are SEPARATE passes on the same trainer (the loop's ``train`` and the Tinker
  mixed pass of the coalescer), not one mixed step: Tinker calls of several models
  coalesce with each other, not with the loop's batch (docs/tinker.md says so);
* idle eviction (api/tinker/backend.py E1-E4): a model with no call for ``slots.evict_idle_s``
  is swapped out (the trainer group's bit-exact swap) and its lease released when a
  registration is queued for a slot or another Tinker model needs one; its next call
  leases a slot again and swaps it back in;
* sampling goes to the fleet's first SGLang engine (api/tinker/sampling.py).

Only what differs from ``InProcessBackend`` lives here: slot taking/giving and the
trainer handle; everything else (calls, checkpoints, restore on a failed load) is its.
"""

from __future__ import annotations

import logging
from pathlib import Path

from api.tinker.auth import TenantKeys
from api.tinker.backend import InProcessBackend
from api.tinker.sampling import SglangSampler
from api.tinker.service import TinkerService
from service.config import ServiceSettings
from service.controller import Controller
from service.errors import Conflict
from service.runtime_impl import FleetRuntime
from service.trainer_group import TrainerGroup
from trainer.tinker_ops import AdamStep, Call, CallResult

log = logging.getLogger(__name__)

# Adapters the sampler keeps loaded in the engine at once: the rollout worker's adapters
# (two versions each during a live update) need the rest of its max_loaded_loras.
SAMPLER_MAX_LOADED = 2


class _GroupOps:
    """TinkerOps' interface over the trainer group: each call runs on every rank."""

    def __init__(self, group: TrainerGroup, max_seq_len: int) -> None:
        self.group = group
        self.max_seq_len = max_seq_len

    def forward_backward(self, calls: list[Call]) -> list[CallResult]:
        return self.group.tinker_forward_backward(calls, self.max_seq_len)

    def forward(self, calls: list[Call]) -> list[CallResult]:
        return self.group.tinker_forward(calls, self.max_seq_len)

    def optim_step(self, slot: int, adam: AdamStep) -> dict[str, float]:
        adam.check()  # refused here, before any rank is called
        return self.group.tinker_optim_step(slot, adam)


class FleetBackend(InProcessBackend):
    """``InProcessBackend`` over the fleet's trainer group, with slots leased from the registry."""

    def __init__(self, group: TrainerGroup, controller: Controller, *, base_model: str, tokenizer_id: str,
                 lora_alpha: float = 32.0, max_seq_len: int = 4096, idle_evict_s: float | None = None) -> None:
        if group.config.dp != 1:
            raise ValueError(f"the Tinker API needs trainer dp == 1 (per-model optim_step), this job has dp={group.config.dp}")
        super().__init__(group, base_model=base_model, tokenizer_id=tokenizer_id,  # type: ignore[arg-type]
                         lora_alpha=lora_alpha, max_seq_len=max_seq_len, idle_evict_s=idle_evict_s)
        self.ops = _GroupOps(group, max_seq_len)  # type: ignore[assignment]
        self.controller = controller

    def _take_slot(self, model_id: str, tenant: str) -> int:
        try:
            return self.controller.lease_slot(model_id, tenant)
        except Conflict as err:  # NoFreeSlot is a Conflict: the future's user error says which slots are held
            raise ValueError(str(err)) from None

    def _give_slot(self, model_id: str) -> None:
        self.controller.release_slot_lease(model_id)

    def _external_demand(self) -> int:
        """Registrations queued for a slot (controller.slot_demand): idle models are evicted for them."""
        return self.controller.slot_demand()


def _engine_url(runtime: FleetRuntime) -> str | None:
    if runtime.rollout is None:
        return None
    try:
        engines = runtime.rollout.engine_health(timeout_s=30)
    except Exception as err:  # noqa: BLE001 - no sampling, training still served
        log.warning("Tinker sampling disabled: engines unreachable: %s: %s", type(err).__name__, err)
        return None
    return engines[0].url if engines else None


def fleet_tinker_service(controller: Controller, settings: ServiceSettings) -> TinkerService:
    """The TinkerService over the controller's attached FleetRuntime (ValueError when there is none)."""
    if settings.tinker_keys_file is None:
        raise ValueError("tinker_keys_file is not set")
    keys = TenantKeys.from_file(settings.tinker_keys_file)
    runtime = controller.runtime
    if not isinstance(runtime, FleetRuntime):
        raise ValueError("the Tinker API needs the running fleet (a FleetRuntime attached to the controller)")
    job = runtime.job
    backend = FleetBackend(runtime.trainer, controller, base_model=Path(job.base_model.path).name,
                           tokenizer_id=settings.tinker_tokenizer_id or job.base_model.path,
                           max_seq_len=settings.tinker_max_seq_len,
                           idle_evict_s=controller.capacity.evict_idle_s)  # the keep-warm knob, one for both kinds of run
    url = _engine_url(runtime)
    sampler = SglangSampler(url, max_loaded=SAMPLER_MAX_LOADED) if url else None
    return TinkerService(backend, keys, settings.tinker_dir, window_s=settings.tinker_window_ms / 1000.0,
                         sampler=sampler, session_timeout_s=settings.tinker_session_timeout_s)
