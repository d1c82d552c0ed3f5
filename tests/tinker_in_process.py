"""A Tinker-only service over an in-process trainer, for tests and the CPU benchmarks: `TinkerHost`
(a scheduler over a private registry and a thread that runs its rounds, as the training loop does
in the fleet) and `in_process_service` / `tinker_app` (the Tinker routes over it).

Not product code (issue 43): the service runs Tinker models as tenants of the fleet's scheduler,
whose rounds the training loop runs (service/loop/training_loop.py); this host repeats that loop's
Tinker part without Ray or engines, so Tinker tests start in seconds.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI

from api.tinker.auth import TenantKeys
from api.tinker.routes import tinker_router
from api.tinker.service import TinkerService
from service.registry.registry import Registry
from service.scheduling.residency import ResidencyKnobs
from service.scheduling.scheduler import Scheduler
from service.config.durability import Durability
from service.registry.tinker_records import TinkerRecords
from service.tenants.tinker_models import TinkerModels
from trainer.storage.locations import open_store

log = logging.getLogger(__name__)


class TinkerHost:
    """A Tinker-only service over an in-process trainer (tests, the CPU benchmark, the
    single-process example in docs/tinker.md): a scheduler over a private registry, and a
    thread that runs its rounds (place, the operations of evicted models that need no slot,
    gather, one round), as the training loop does in the fleet."""

    def __init__(self, trainer: Any, *, base_model: str, tokenizer_id: str, checkpoint_root: str | Path, window_s: float = 0.02,
                 max_seq_len: int = 4096, idle_evict_s: float | None = None, turn_steps: int = 4,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.05, durability: str = "interval:300") -> None:
        cfg = trainer.config
        self._dir = Path(tempfile.mkdtemp(prefix="lorafleet-tinker-host-"))  # its registry (leases, Tinker records), gone at close
        self.registry = Registry(self._dir / "slots.sqlite", cfg.num_slots)
        self.records = TinkerRecords(self.registry.db_path)
        self.store = open_store(Path(checkpoint_root).absolute())
        knobs = ResidencyKnobs(idle_evict_s=math.inf if idle_evict_s is None else idle_evict_s, turn_steps=turn_steps)
        # The scheduler drives the trainer through the one trainer interface (trainer/actor.py
        # TrainWorker: what a TrainerGroup forwards to every rank), made over the in-process trainer.
        from trainer.actor import TrainWorker

        self.scheduler = Scheduler(self.registry, TrainWorker(trainer), knobs, max_seq_len=max_seq_len, window_s=window_s,
                                   clock=clock)
        self.models = TinkerModels(self.scheduler, self.records, self.store, base_model=base_model, tokenizer_id=tokenizer_id,
                                   max_rank=cfg.max_rank, target_groups=cfg.target_groups, max_seq_len=max_seq_len,
                                   durability=Durability.parse(durability))
        self.trainer = trainer  # trainer.core.MultiLoraTrainer
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._rounds, name="tinker-rounds", daemon=True)
        self._thread.start()

    def _rounds(self) -> None:
        s = self.scheduler
        while not self._stop.is_set():
            try:
                s.place()
                s.run_unplaced()
                ready = s.gather(max_wait_s=self.poll_s, stop=self._stop, poll_s=self.poll_s)
                if ready:
                    s.run_round(ready)
            except Exception:  # noqa: BLE001 - a round's failure went to its callers; the host goes on
                log.exception("Tinker round failed")

    def close(self) -> None:
        self._stop.set()
        self.scheduler.notify()
        self._thread.join(timeout=60)
        for t in self.scheduler.tenants():
            t.release("the Tinker host stopped")
        self.records.close()
        self.registry.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def in_process_service(model_dir: str | Path, keys: TenantKeys, checkpoint_root: str | Path, *, num_slots: int = 8,
                       max_rank: int = 16, base_model: str | None = None, tokenizer_id: str | None = None,
                       window_s: float = 0.02,
                       micro_batch_tokens: int = 16384, max_seq_len: int = 4096,
                       sglang_url: str | None = None, session_timeout_s: float | None = 300.0,
                       idle_evict_s: float | None = None, clock=None, durability: str = "interval:300") -> TinkerService:  # noqa: ANN001
    """``base_model``: the served name (default: the folder's name); ``tokenizer_id``: what get_info
    tells clients to load (default: the folder). ``sglang_url``: an SGLang server of the same model
    with LoRA enabled, for sampling.
    ``idle_evict_s``/``clock``: keep-warm eviction of idle models (service/scheduling/residency.py)."""
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(model_dir), num_slots=num_slots, max_rank=max_rank,
                                             micro_batch_tokens=micro_batch_tokens))
    host = TinkerHost(trainer, base_model=base_model or Path(model_dir).name, tokenizer_id=tokenizer_id or str(model_dir),
                      checkpoint_root=checkpoint_root, window_s=window_s, max_seq_len=max_seq_len, idle_evict_s=idle_evict_s,
                      durability=durability,
                      **({"clock": clock} if clock is not None else {}))
    from api.tinker.sampling.sampler import SglangSampler

    sampler = SglangSampler(sglang_url, records=host.registry) if sglang_url else None  # sessions and records in its registry
    service = TinkerService(host.models, keys, sampler=sampler, session_timeout_s=session_timeout_s, on_stop=host.close)
    service.host = host  # tests reach the trainer and the scheduler through it
    return service


def tinker_app(service: TinkerService) -> FastAPI:
    app = FastAPI(title="lorafleet Tinker API")
    app.include_router(tinker_router(service))
    app.state.on_stop = [service.stop]  # api/server.py awaits these on stop
    app.state.on_start = [service.start]
    app.state.tinker_futures = service.futures  # api/server.py start_fronted: the front's feed (F5)
    return app
