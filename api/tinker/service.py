"""TinkerService: the state behind the Tinker routes (sessions, models, checkpoints).

Ownership invariant: every session, model and future records its tenant, and every
lookup takes the caller's tenant; a miss and another tenant's object answer the
same 404. Checkpoints live under ``<checkpoint_root>/<tenant>/<model>/<kind>/<name>``
and a ``tinker://<model>/<kind>/<name>`` path is always resolved under the CALLER's
tenant folder, so another tenant's path cannot name anything the caller may load.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fastapi import HTTPException

from api.tinker import wire
from api.tinker.auth import TenantKeys
from api.tinker.backend import LoraSpec, TinkerBackend
from api.tinker.coalescer import Coalescer, Op
from api.tinker.futures import FutureStore, Outcome, user_error
from api.tinker.runs import TrainingRuns, check_ttl, check_user_metadata
from api.tinker.sampling import SglangSampler

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KINDS = ("weights", "sampler_weights")
ADMIT_TICK_S = 0.5  # how often models waiting for a trainer slot are retried when nothing else happens


@dataclass
class Session:
    tenant: str
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_seen = time.monotonic()


@dataclass
class ModelRecord:
    tenant: str
    session_id: str
    model_id: str
    rank: int


class TinkerService:
    def __init__(self, backend: TinkerBackend, keys: TenantKeys, checkpoint_root: str | Path, *,
                 window_s: float = 0.02, poll_s: float = 10.0, sampler: SglangSampler | None = None,
                 session_timeout_s: float | None = 300.0):
        """``session_timeout_s``: a session without a heartbeat for this long (the SDK sends one
        every 10 s) has its models saved (``tinker://<model>/weights/expired-<unix time>``) and
        their slots freed; None = never."""
        self.backend = backend
        self.session_timeout_s = session_timeout_s
        self._reaper = None
        self.sampler = sampler
        self.keys = keys
        self.checkpoint_root = Path(checkpoint_root)
        self.runs = TrainingRuns(self.checkpoint_root)  # training runs and checkpoints (RestClient; api/tinker/runs.py)
        self.futures = FutureStore(poll_s=poll_s)
        # Idle eviction (backend E1-E4) needs the coalescer's admit before each round and a tick
        # that retries models waiting for a slot; a backend that never evicts needs neither.
        # With the loop's train calls taking calls too (api/tinker/fleet_backend.py), the coalescer
        # must know which models are resident (the loop takes only theirs) and the backend must
        # evict only inside the coalescer's hold_idle (never a model with a queued or taken call).
        evicts = getattr(backend, "idle_evict_s", None) is not None
        self.coalescer = Coalescer(backend.forward_backward, self.futures, window_s=window_s,
                                   admit=backend.admit if evicts else None, tick_s=ADMIT_TICK_S if evicts else None,
                                   resident=backend.is_resident if evicts else None)
        if evicts:
            backend.hold_idle = self.coalescer.hold_idle
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelRecord] = {}
        self._tasks: set = set()

    async def start(self) -> None:
        self.coalescer.start()

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await self.coalescer.stop()
        if self.sampler is not None:
            await self.sampler.aclose()

    def background(self, coro) -> None:  # noqa: ANN001 - a coroutine run on the serving loop
        """Run ``coro`` as a task that is kept referenced until it ends (sampling)."""
        import asyncio

        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def metrics(self) -> dict[str, float]:
        evicted = getattr(self.backend, "evicted", lambda: set())()
        return {**self.coalescer.stats(), "models": len(self.models), "sessions": len(self.sessions),
                "models_evicted": len(evicted), "models_waiting_for_slot": len(self.futures.waiting),
                "evictions": getattr(self.backend, "evictions", 0), "restores": getattr(self.backend, "restores", 0)}

    # -- ownership -----------------------------------------------------------------------------------

    def create_session(self, tenant: str) -> str:
        sid = f"s-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = Session(tenant, sid)
        if self.session_timeout_s is not None and self._reaper is None:  # lazily, on the serving loop
            import asyncio

            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="tinker-session-reaper")
        return sid

    async def _reap_forever(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(min(self.session_timeout_s / 4, 5.0))  # a periodic check, not a synchronization
            self.expire_sessions(time.monotonic())
            self.runs.sweep()  # checkpoints past their TTL (runs.py R3)

    def expire_sessions(self, now: float) -> list[str]:
        """Sessions silent for longer than the timeout: save each model, free its slot, forget the session."""
        expired = [s for s in self.sessions.values() if now - s.last_seen > self.session_timeout_s]
        for s in expired:
            for m in [m for m in self.models.values() if m.session_id == s.session_id]:
                folder = self._folder(s.tenant, m.model_id, "weights", f"expired-{int(time.time())}")

                def save_and_unload(m: ModelRecord = m, folder: Path = folder) -> Outcome:
                    if not folder.exists():
                        self.backend.save_state(m.model_id, folder)
                    return self.unload(m.model_id)

                self.coalescer.submit(Op(m.model_id, self.futures.create(s.tenant, m.model_id), run=save_and_unload))
            del self.sessions[s.session_id]
        return [s.session_id for s in expired]

    def session(self, tenant: str, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise HTTPException(404, f"unknown session {session_id}")
        return s

    def model(self, tenant: str, model_id: str) -> ModelRecord:
        m = self.models.get(model_id)
        if m is None or m.tenant != tenant:
            raise HTTPException(404, f"unknown model {model_id}")
        self.runs.touch(tenant, model_id)
        return m

    @staticmethod
    def model_id(session_id: str, model_seq_id: int) -> str:
        return f"{session_id}:train:{model_seq_id}"  # what the SDK derives for create-via-load

    # -- models ------------------------------------------------------------------------------------------

    def _lora_problem(self, body: wire.CreateModelRequest) -> str | None:
        b = self.backend
        if body.base_model != b.base_model:
            return f"base_model {body.base_model!r} is not served here; this server trains {b.base_model!r}"
        lc = body.lora_config
        if lc is None:
            return "only LoRA training is supported: send a lora_config"
        if lc.train_unembed:
            return ("train_unembed=True is not supported: lorafleet puts LoRA on the attention and MLP "
                    "linears only; pass train_unembed=False")
        if not (lc.train_attn and lc.train_mlp):
            return "LoRA goes on both attention and MLP linears here: train_attn and train_mlp must be True"
        if not 1 <= lc.rank <= b.max_rank:
            return f"LoRA rank {lc.rank} not supported: 1..{b.max_rank} on this server"
        if body.optimizer_config and body.optimizer_config.get("type", "adamw") not in ("adam", "adamw"):
            return f"optimizer {body.optimizer_config.get('type')!r} not supported; only adamw"
        return None

    async def _create(self, tenant: str, session_id: str, model_id: str, lora: LoraSpec,
                      user_metadata: dict | None = None) -> Outcome | None:
        if model_id in self.models:
            return user_error(f"model {model_id} exists (model_seq_id reused in this session)")
        try:
            await self.coalescer.run_now(lambda: self.backend.create(model_id, lora, tenant))
        except ValueError as err:
            return user_error(str(err))
        self.models[model_id] = ModelRecord(tenant, session_id, model_id, lora.rank)
        self.runs.record_run(tenant, model_id, base_model=self.backend.base_model, rank=lora.rank, user_metadata=user_metadata)
        return None

    async def create_model(self, tenant: str, body: wire.CreateModelRequest, model_id: str) -> Outcome:
        problem = self._lora_problem(body)
        if problem:
            return user_error(problem)
        try:
            meta = check_user_metadata(body.user_metadata)
        except ValueError as err:
            return user_error(str(err))
        seed = body.lora_config.seed if body.lora_config.seed is not None else secrets.randbits(31)
        failed = await self._create(tenant, body.session_id, model_id, LoraSpec(body.lora_config.rank, seed), meta)
        return failed or Outcome(json={"type": "create_model", "model_id": model_id})

    def unload(self, model_id: str) -> Outcome:
        self.backend.release(model_id)
        self.models.pop(model_id, None)
        return Outcome(json={"type": "unload_model", "model_id": model_id})

    async def finish_session(self, tenant: str, session_id: str) -> None:
        self.session(tenant, session_id)
        for m in [m for m in self.models.values() if m.session_id == session_id]:
            rid = self.futures.create(tenant, m.model_id)
            self.coalescer.submit(Op(m.model_id, rid, run=lambda mid=m.model_id: self.unload(mid), needs_slot=False))
        del self.sessions[session_id]

    # -- checkpoints -------------------------------------------------------------------------------------

    def _folder(self, tenant: str, model_id: str, kind: str, name: str) -> Path:
        return self.runs.folder(tenant, model_id, kind, name)

    def checkpoint_folder(self, tenant: str, tinker_path: str, kinds: tuple[str, ...]) -> Path:
        """The caller's checkpoint folder named by ``tinker://<model>/<kind>/<name>``; ValueError if none."""
        prefix = "tinker://"
        parts = tinker_path[len(prefix):].split("/") if tinker_path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] not in kinds or not NAME_RE.match(parts[2]) or not parts[0] or ".." in parts[0]:
            raise ValueError(f"checkpoint path {tinker_path!r} invalid: expected tinker://<model_id>/{'|'.join(kinds)}/<name>")
        self.runs.sweep(tenant)  # an expired checkpoint is never resolved (runs.py R3)
        folder = self._folder(tenant, parts[0], parts[1], parts[2])
        if not folder.is_dir():
            raise ValueError(f"no checkpoint {tinker_path} for this API key")
        return folder

    def submit_save(self, tenant: str, body: wire.SaveWeightsRequest, kind: str,
                    write: Callable[[str, Path], dict] | None = None) -> dict:
        """``write(model_id, folder)``: writes the checkpoint and returns extra answer fields (default:
        the backend's save for ``kind``). The checkpoint is recorded with its TTL and metadata (runs.py)."""
        self.model(tenant, body.model_id)
        rid = self.futures.create(tenant, body.model_id)
        answer = {"request_id": rid, "model_id": body.model_id}
        name = body.path or f"{kind}-{uuid.uuid4().hex[:8]}"
        if not NAME_RE.match(name):
            self.futures.resolve(rid, user_error(f"checkpoint name {name!r} invalid: letters, digits, '.', '_', '-' (at most 128)"))
            return answer
        try:
            check_ttl(body.ttl_seconds)
            meta = check_user_metadata(body.user_metadata)
        except ValueError as err:
            self.futures.resolve(rid, user_error(str(err)))
            return answer
        folder = self._folder(tenant, body.model_id, kind, name)
        path = f"tinker://{body.model_id}/{kind}/{name}"
        if write is None:
            save = self.backend.save_state if kind == "weights" else self.backend.save_sampler_weights
            write = lambda model_id, to: save(model_id, to) or {}  # noqa: E731
        wire_type = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler",
                     "external_weights": "save_weights_external"}[kind]

        def run() -> Outcome:
            if folder.exists():
                return user_error(f"checkpoint {path} exists; choose another name")
            extra = write(body.model_id, folder)
            self.runs.record_checkpoint(tenant, body.model_id, kind, name, ttl_seconds=body.ttl_seconds, user_metadata=meta)
            answer = {"type": wire_type, "path": path, **extra}
            if kind == "sampler_weights" and body.sampling_session_seq_id is not None and self.sampler is not None:
                answer["sampling_session_id"] = self.sampler.create_session(tenant, folder, path)
            return Outcome(json=answer)

        self.coalescer.submit(Op(body.model_id, rid, run=run))
        return answer

    async def submit_load(self, tenant: str, body: wire.LoadWeightsRequest) -> dict:
        if body.model_id is not None:
            model_id = self.model(tenant, body.model_id).model_id
        elif body.session_id is not None and body.model_seq_id is not None:
            self.session(tenant, body.session_id)
            model_id = self.model_id(body.session_id, body.model_seq_id)
        else:
            raise HTTPException(400, "load_weights needs model_id, or session_id with model_seq_id")
        rid = self.futures.create(tenant, model_id)
        answer = {"request_id": rid, "model_id": model_id}
        try:
            folder = self.checkpoint_folder(tenant, body.path, kinds=("weights",))
            if body.model_id is None:  # create-via-load: the model takes the checkpoint's LoRA shape
                failed = await self._create(tenant, body.session_id, model_id, self.backend.checkpoint_lora(folder),
                                            check_user_metadata(body.user_metadata))
                if failed:
                    self.futures.resolve(rid, failed)
                    return answer
        except ValueError as err:
            self.futures.resolve(rid, user_error(str(err)))
            return answer

        def run() -> Outcome:
            try:
                self.backend.load_state(model_id, folder, body.optimizer)
            except ValueError as err:
                if body.model_id is None:  # a model created for this load does not outlive it
                    self.unload(model_id)
                return user_error(str(err))
            return Outcome(json={"type": "load_weights", "path": body.path, "model_id": model_id})

        self.coalescer.submit(Op(model_id, rid, run=run))
        return answer

    # -- sampling ----------------------------------------------------------------------------------------

    def sampling_folder(self, tenant: str, base_model: str | None, model_path: str | None) -> Path | None:
        """The PEFT folder to sample with (None = the base model); ValueError naming the problem."""
        if self.sampler is None:
            raise ValueError("this server has no sampling engine (sampleable: false)")
        if model_path:
            return self.checkpoint_folder(tenant, model_path, kinds=("sampler_weights",))
        if base_model != self.backend.base_model:
            raise ValueError(f"base_model {base_model!r} is not served here; this server samples {self.backend.base_model!r}")
        return None
