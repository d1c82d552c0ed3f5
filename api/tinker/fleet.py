"""The Tinker API over the running fleet: ``fleet_tinker_service(controller, settings)`` builds the
``TinkerService`` that ``lorafleet serve`` mounts (api/app.py) when ``settings.tinker_keys_file``
is set.

Tinker models are tenants of the fleet's one scheduler (service/scheduling/scheduler.py, the runtime's):
their slots are registry leases counted with the dataset runs' slots, the same keep-warm and
turns policy evicts and restores both kinds, and their calls ride in the training loop's rounds
(ONE mixed step with the runs' samples). Sampling goes to the fleet's first SGLang engine
(api/tinker/sampling.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from api.tinker.auth import TenantKeys
from api.tinker.sampling import SglangSampler
from api.tinker.service import TinkerService
from service.config.settings import ServiceSettings
from service.control.controller import Controller
from service.fleet.fleet_runtime import FleetRuntime
from service.tenants.tinker_models import TinkerModels

log = logging.getLogger(__name__)

# Adapters the sampler keeps loaded in the engine at once: the rollout worker's adapters
# (two versions each during a live update) need the rest of its max_loaded_loras.
SAMPLER_MAX_LOADED = 2


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
    if not isinstance(runtime, FleetRuntime) or runtime.scheduler is None:
        raise ValueError("the Tinker API needs the running fleet (a FleetRuntime attached to the controller)")
    job = runtime.job
    models = TinkerModels(runtime.scheduler, base_model=job.base_model.name,
                          tokenizer_id=settings.tinker_tokenizer_id or job.base_model.served_name or job.base_model.path,
                          max_rank=controller.capacity.max_rank, max_seq_len=settings.tinker_max_seq_len,
                          dp=runtime.trainer.config.dp, target_groups=tuple(controller.capacity.target_groups))
    url = _engine_url(runtime)
    sampler = SglangSampler(url, max_loaded=SAMPLER_MAX_LOADED) if url else None
    service = TinkerService(models, keys, settings.tinker_dir, sampler=sampler, session_timeout_s=settings.tinker_session_timeout_s)
    return service
