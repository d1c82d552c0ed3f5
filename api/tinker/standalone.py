"""A Tinker-only app over an in-process trainer: tests, the CPU benchmark, and the
single-process example in docs/tinker.md. (The service mounts ``tinker_router`` in
its own app instead.) The rounds run on the scheduler's host thread (service/tinker_models.py
``TinkerHost``), as the training loop runs them in the fleet."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from api.tinker.auth import TenantKeys
from api.tinker.routes import tinker_router
from api.tinker.service import TinkerService


def in_process_service(model_dir: str | Path, keys: TenantKeys, checkpoint_root: str | Path, *, num_slots: int = 8,
                       max_rank: int = 16, base_model: str | None = None, tokenizer_id: str | None = None,
                       window_s: float = 0.02,
                       micro_batch_tokens: int = 16384, max_seq_len: int = 4096,
                       sglang_url: str | None = None, session_timeout_s: float | None = 300.0,
                       idle_evict_s: float | None = None, clock=None) -> TinkerService:  # noqa: ANN001
    """``base_model``: the served name (default: the folder's name); ``tokenizer_id``: what get_info
    tells clients to load (default: the folder). ``sglang_url``: an SGLang server of the same model
    with LoRA enabled, for sampling.
    ``idle_evict_s``/``clock``: keep-warm eviction of idle models (service/residency.py)."""
    from service.tinker_models import TinkerHost
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(model_dir), num_slots=num_slots, max_rank=max_rank,
                                             micro_batch_tokens=micro_batch_tokens))
    host = TinkerHost(trainer, base_model=base_model or Path(model_dir).name, tokenizer_id=tokenizer_id or str(model_dir),
                      window_s=window_s, max_seq_len=max_seq_len, idle_evict_s=idle_evict_s,
                      **({"clock": clock} if clock is not None else {}))
    from api.tinker.sampling import SglangSampler

    sampler = SglangSampler(sglang_url) if sglang_url else None
    service = TinkerService(host.models, keys, checkpoint_root, sampler=sampler, session_timeout_s=session_timeout_s,
                            on_stop=host.close)
    service.host = host  # tests reach the trainer and the scheduler through it
    return service


def tinker_app(service: TinkerService) -> FastAPI:
    app = FastAPI(title="lorafleet Tinker API")
    app.include_router(tinker_router(service))
    app.state.on_stop = [service.stop]  # api/server.py awaits these on stop
    return app
