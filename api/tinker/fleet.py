"""The Tinker API over the running fleet: ``fleet_tinker_service(controller, settings)`` builds the
``TinkerService`` that ``lorafleet serve`` mounts (api/app.py) when ``settings.tinker_keys_file``
is set.

Tinker models are tenants of the fleet's one scheduler (service/scheduling/scheduler.py, the runtime's):
their slots are registry leases counted with the dataset runs' slots, the same keep-warm and
turns policy evicts and restores both kinds, and their calls ride in the training loop's rounds
(ONE mixed step with the runs' samples). Sampling goes to every SGLang engine of the fleet
(api/tinker/sampling/sampler.py, api/tinker/sampling/engines.py): the sampler follows the rollout worker's
engine list, and each engine keeps ``sampler_capacity(job)`` Tinker adapters loaded.
"""

from __future__ import annotations

import logging

from api.tinker.auth import TenantKeys
from api.tinker.sampling.engines import EngineEntry, EngineSource
from api.tinker.sampling.sampler import SglangSampler
from api.tinker.service import TinkerService
from service.config.durability import Durability
from service.config.settings import ServiceSettings
from service.control.controller import Controller
from service.fleet.fleet_runtime import FleetRuntime
from service.tenants.tinker_models import TinkerModels

log = logging.getLogger(__name__)


def sampler_capacity(job) -> int:  # noqa: ANN001 - a JobConfig
    """Sampler adapters per engine: what ``engines.max_loaded_loras`` leaves once the dataset runs have
    what they may hold there (each resident run's adapter, at most ``slots.num_slots``, in two versions
    during a live update). At least 1 (then the engines may refuse loads while the runs fill them: the
    job should give ``max_loaded_loras`` room)."""
    room = job.engines.max_loaded_loras - 2 * job.slots.num_slots
    if room < 1:
        log.warning("engines.max_loaded_loras (%d) leaves no room for Tinker sampler adapters beside 2 x %d slots: "
                    "the sampler keeps 1 per engine; raise max_loaded_loras", job.engines.max_loaded_loras, job.slots.num_slots)
    return max(1, room)


def rollout_engines(runtime: FleetRuntime) -> EngineSource:
    """The rollout worker's engine list, read anew each time (an engine restarted or replaced is a new
    URL or a new start: api/tinker/sampling/engines.py follows it)."""
    async def source() -> list[EngineEntry]:
        rollout = runtime.rollout
        if rollout is None:
            return []
        health = await rollout.engine_health_async(10.0)
        return [EngineEntry(h.index, h.url, h.alive and h.routable, h.inflight, h.starts) for h in health]

    return source


def fleet_tinker_service(controller: Controller, settings: ServiceSettings) -> TinkerService:
    """The TinkerService over the controller's attached FleetRuntime (ValueError when there is none)."""
    if settings.tinker_keys_file is None:
        raise ValueError("tinker_keys_file is not set")
    keys = TenantKeys.from_file(settings.tinker_keys_file)
    runtime = controller.runtime
    if not isinstance(runtime, FleetRuntime) or runtime.scheduler is None:
        raise ValueError("the Tinker API needs the running fleet (a FleetRuntime attached to the controller)")
    job = runtime.job
    models = TinkerModels(runtime.scheduler, runtime.tinker_records, runtime.store, base_model=job.base_model.name,
                          tokenizer_id=settings.tinker_tokenizer_id or job.base_model.served_name or job.base_model.path,
                          max_rank=controller.capacity.max_rank, max_seq_len=settings.tinker_max_seq_len,
                          target_groups=tuple(controller.capacity.target_groups),
                          durability=Durability.parse(settings.tinker_durability), quotas=settings.quotas)
    sampler = (SglangSampler(rollout_engines(runtime), records=controller.registry, max_loaded=sampler_capacity(job))
               if runtime.rollout is not None else None)
    service = TinkerService(models, keys, sampler=sampler, session_timeout_s=settings.tinker_session_timeout_s,
                                  default_seed=settings.tinker_default_seed)
    return service
