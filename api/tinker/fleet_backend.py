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
* ONE mixed step with the training loop: the trainer group asks ``_LoopRiders`` at the
  start of every loop train call for the pending forward_backward runs at the heads of
  the models' queues (the coalescer's ``take_forward_backward``, never past another
  operation of a model); they ride in that call (one packed forward/backward over the
  loop's samples and their datums, trainer/tinker_ops.py ``train_with``) and their
  results go back through the coalescer. While the loop trains, the coalescer leaves a
  forward_backward for it up to ``JOIN_WAIT_S``; when the loop is idle its own rounds run
  them (alone, or coalesced with each other) as before. ``TrainerGroup`` runs one
  collective call at a time (its lock), so nothing interleaves inside a train call;
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

from api.tinker.auth import TenantKeys
from api.tinker.backend import InProcessBackend
from api.tinker.coalescer import Coalescer
from api.tinker.sampling import SglangSampler
from api.tinker.service import TinkerService
from service.config import ServiceSettings
from service.controller import Controller
from service.errors import Conflict
from service.runtime_impl import FleetRuntime
from service.trainer_group import RiderCalls, TrainerGroup
from trainer.tinker_ops import AdamStep, Call, CallResult

log = logging.getLogger(__name__)

# Adapters the sampler keeps loaded in the engine at once: the rollout worker's adapters
# (two versions each during a live update) need the rest of its max_loaded_loras.
SAMPLER_MAX_LOADED = 2
# Joining the loop's train calls: the loop counts as training for LOOP_GAP_S after a train call
# ends (its gap to the next call: collecting the batch, publishing), and while it trains a
# forward_backward waits up to JOIN_WAIT_S for its next call before the coalescer runs it alone.
LOOP_GAP_S = 1.0
JOIN_WAIT_S = 2.0


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
        except Conflict as err:  # NoFreeSlot is a Conflict: the future's user error (holders unnamed, I8)
            raise ValueError(str(err)) from None

    def _give_slot(self, model_id: str) -> None:
        self.controller.release_slot_lease(model_id)

    def _external_demand(self) -> int:
        """Registrations queued for a slot (controller.slot_demand): idle models are evicted for them."""
        return self.controller.slot_demand()


class _LoopRiders:
    """``service.trainer_group.TrainRiders`` over the coalescer: the Tinker calls that ride in
    the loop's next train call, with their model ids turned into slots."""

    def __init__(self, coalescer: Coalescer, backend: FleetBackend) -> None:
        self.coalescer = coalescer
        self.backend = backend

    def take(self) -> RiderCalls | None:
        ops = self.coalescer.take_forward_backward()
        if not ops:
            return None
        # Model ids -> slots without a lock or a swap-in (backend E4: this thread holds the group's
        # lock). The coalescer took only resident models and holds them busy, so none is evicted
        # meanwhile; a model released in between gets its error.
        calls, errors = self.backend._calls([op.call for op in ops], bring_in=False)  # noqa: SLF001
        gone = [i for i, e in enumerate(errors) if e is not None]  # a model without a slot (released)
        if gone:
            self.coalescer.deliver([ops[i] for i in gone], [CallResult(error=errors[i]) for i in gone])
        keep = [i for i, e in enumerate(errors) if e is None]
        if not keep:
            return None
        riding = [ops[i] for i in keep]
        return RiderCalls(calls=[calls[i] for i in keep], max_seq_len=self.backend.max_seq_len,
                          deliver=lambda results: self.coalescer.deliver(riding, results),
                          fail=lambda message: self.coalescer.fail(riding, message))


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
    backend = FleetBackend(runtime.trainer, controller, base_model=job.base_model.name,
                           tokenizer_id=settings.tinker_tokenizer_id or job.base_model.served_name or job.base_model.path,
                           max_seq_len=settings.tinker_max_seq_len,
                           idle_evict_s=controller.capacity.evict_idle_s)  # the keep-warm knob, one for both kinds of run
    url = _engine_url(runtime)
    sampler = SglangSampler(url, max_loaded=SAMPLER_MAX_LOADED) if url else None
    service = TinkerService(backend, keys, settings.tinker_dir, window_s=settings.tinker_window_ms / 1000.0,
                            sampler=sampler, session_timeout_s=settings.tinker_session_timeout_s)
    join_loop(service.coalescer, backend, runtime.trainer)
    return service


def join_loop(coalescer: Coalescer, backend: FleetBackend, group: TrainerGroup,
              join_wait_s: float = JOIN_WAIT_S, loop_gap_s: float = LOOP_GAP_S) -> None:
    """Tinker forward_backward calls ride in the loop's train calls on ``group`` from now on."""
    coalescer.join_loop(lambda: group.loop_active(loop_gap_s), join_wait_s)
    group.attach_riders(_LoopRiders(coalescer, backend))
