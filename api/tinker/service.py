"""TinkerService: the state behind the Tinker routes (sessions, model records, checkpoint paths,
futures), and how a request becomes an operation on its model's queue.

The wire face only: each request is checked here (ownership, paths, the LoRA options) and put,
in order, on its model's queue in service/ (service/tenants/tinker_model.py ``TinkerModel``, reached
through service/tenants/tinker_models.py ``TinkerModels``) with a ``done`` callback that turns the
outcome into the SDK's future result (api/tinker/outcomes.py); the scheduler runs it
(service/scheduling/scheduler.py) and calls ``done`` on its own thread, which hands the result to
the serving event loop. No slot, no eviction and no thread that calls the trainer lives here.

Durable (issue 40): sessions, models and futures are records (service/registry/tinker_records.py),
written before an answer names them (the routes await ``futures.durable()``). At start, ``revive``
brings the sessions and models of the previous process back under their ids, re-queues the
operations they still owed (their futures answer when those run), and answers what cannot run
again with why. A client that retries through a restart sees only latency.

Ownership invariant: every session, model and future records its tenant, and every lookup
takes the caller's tenant; a miss and another tenant's object answer the same 404. Checkpoints
live in the store under ``tinker/<tenant>/<model>/<kind>/<name>`` (trainer/storage/layouts.py)
and a ``tinker://<model>/<kind>/<name>`` path is resolved under the CALLER's tenant, so another
tenant's path names nothing the caller may load, unless its owner published that checkpoint (then it
is readable, never writable: api/tinker/checkpoints/runs.py R5).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import HTTPException

from api.tinker import wire
from api.tinker.auth import TenantKeys
from api.tinker.futures import POLL_HOLD_S, FutureStore, Outcome, gone, server_error, user_error
from api.tinker.outcomes import answer_outcome, lora_flags, lora_spec, ok_for, outcome_of  # noqa: F401 - lora_flags: the routes'
from api.tinker.checkpoints.runs import TrainingRuns, check_ttl, check_user_metadata
from api.tinker.sampling.sampler import SglangSampler
from rollout.engines.weights import ADAPTER_CONFIG
from service.errors import LorafleetError
from service.tenants.tinker_lora import LoraSpec, checkpoint_lora
from service.tenants.tinker_model import TinkerModel
from service.tenants.tinker_models import TinkerModels
from trainer.storage.locations import readable_folder
from trainer.storage.slot_state_format import META
from trainer.storage.store import StoreError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
KINDS = ("weights", "sampler_weights")


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
    model: TinkerModel


class TinkerService:
    def __init__(self, fleet: TinkerModels, keys: TenantKeys, *, poll_s: float = POLL_HOLD_S, sampler: SglangSampler | None = None,
                 session_timeout_s: float | None = 300.0, on_stop: Callable[[], None] | None = None,
                 default_seed: int | None = None):
        """``session_timeout_s``: a session without a heartbeat for this long (the SDK sends one
        every 10 s) has its models saved (``tinker://<model>/weights/expired-<unix time>``) and
        their slots freed; None = never. ``on_stop``: called last by ``stop``."""
        self.fleet = fleet  # the models as tenants of the scheduler (service/tenants/tinker_models.py)
        self.records = fleet.records
        self.store = fleet.store
        self.session_timeout_s = session_timeout_s
        self._reaper = None
        self.sampler = sampler
        if sampler is not None:
            sampler.check_folder = self._unreadable_sampler_folder
        self.keys = keys
        self.runs = TrainingRuns(self.records, self.store)  # training runs and checkpoints (RestClient; api/tinker/checkpoints/runs.py)
        self.runs.base_model = fleet.base_model
        self.futures = FutureStore(self.records, poll_s=poll_s)
        self.futures.reason_of = self._waiting_reason
        self.futures.on_cancel = self._model_changed
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelRecord] = {}
        self._tasks: set = set()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._on_stop = on_stop
        self._revived = False
        self.default_seed = default_seed  # a model created without a seed gets it (None: a random one)

    async def start(self) -> None:
        """Run before every Tinker route (the router's dependency): the first one revives the previous
        process's sessions, models and futures on the serving loop, so no request is answered before
        the restart's state is back."""
        if self._revived:
            return
        self._event_loop = asyncio.get_running_loop()
        self._revived = True
        self.revive()
        if self.sessions and self.session_timeout_s is not None and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="tinker-session-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.sampler is not None:
            await self.sampler.aclose()
        if self._on_stop is not None:
            self._on_stop()

    def background(self, coro) -> None:  # noqa: ANN001 - a coroutine run on the serving loop
        """Run ``coro`` as a task that is kept referenced until it ends (sampling)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def metrics(self) -> dict[str, float]:
        """The Tinker gauges of /metrics: the models' residency, the records' group commits, and the
        sampler's counts (per engine)."""
        sampler = self.sampler.metrics() if self.sampler is not None else {}
        r = self.records
        return {**self.fleet.stats(), "models": len(self.models), "sessions": len(self.sessions), "record_commits": r.commits,
                "record_writes": r.committed_writes, "record_commit_seconds": r.commit_seconds,
                "retrieve_try_again": self.futures.try_again,
                "futures_announced": self.futures.feed.announced if self.futures.feed is not None else 0, **sampler}

    def _waiting_reason(self, model_id: str) -> str | None:
        record = self.models.get(model_id)
        return record.model.waiting_reason if record is not None else None

    def _model_changed(self, model_id: str) -> None:
        record = self.models.get(model_id)
        if record is not None:
            record.model.changed()

    # -- a restart: back where the previous process stopped ----------------------------------------

    def revive(self) -> None:
        """Sessions (their heartbeats count from now), models and their owed operations of the previous
        process (module doc); a future that cannot finish any more is answered with why."""
        for sid, tenant in self.records.live_sessions():
            self.sessions[sid] = Session(tenant, sid)

        def answer(request_id: str, request: dict) -> Callable[[Any, BaseException | None], None]:
            row = self.records.future(request_id)
            self.futures.adopt(request_id, row.tenant, row.model_id)
            return self.done(request_id, ok_for(request))

        for model in self.fleet.revive(answer):
            row = self.records.run_of(model.owner, model.key)
            self.models[model.key] = ModelRecord(model.owner, row["session_id"], model.key, model.lora.rank, model)
        for f in self.records.pending_without_model():  # a sample or a check in flight at the stop
            self.futures.adopt(f.request_id, f.tenant, f.model_id)
            message = "the service restarted while this request ran; send it again"
            self.futures.resolve(f.request_id, gone(message) if f.kind == "sample" else server_error(message))

    # -- results: from the scheduler's thread to the serving loop ---------------------------------------

    def done(self, request_id: str, ok: Callable[[Any], Outcome]) -> Callable[[Any, BaseException | None], None]:
        """The ``done`` of an operation whose future is ``request_id``: called on the scheduler's
        thread, it resolves the future on the serving loop."""
        loop = self._event_loop or asyncio.get_running_loop()
        self._event_loop = loop

        def deliver(value: Any, error: BaseException | None) -> None:
            outcome = outcome_of(value, error, ok)
            try:
                loop.call_soon_threadsafe(self.futures.resolve, request_id, outcome)
            except RuntimeError:  # the serving loop closed: the service is stopping; the record stays pending
                pass

        return deliver

    def cancelled(self, request_id: str) -> Callable[[], bool]:
        """Whether the future was answered meanwhile (cancelled by the client): its operation is dropped."""
        def cancelled() -> bool:
            entry = self.futures.entry(request_id)
            return entry is not None and entry.done.done()
        return cancelled

    def op_kw(self, request_id: str, ok: Callable[[Any], Outcome]) -> dict:
        """The keyword arguments every queued operation takes: its done, cancelled and future."""
        return {"done": self.done(request_id, ok), "cancelled": self.cancelled(request_id), "request_id": request_id}

    # -- ownership -----------------------------------------------------------------------------------

    def create_session(self, tenant: str, body: wire.CreateSessionRequest | None = None) -> str:
        """A session, recorded with what the client said of it (sessions list/get/search: api/tinker/sessions.py)."""
        sid = f"s-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = Session(tenant, sid)
        meta = {str(k): str(v) for k, v in body.user_metadata.items()} if body is not None and body.user_metadata else None
        self.records.add_session(sid, tenant, user_metadata=meta, display_name=body.display_name if body else None,
                                 project_id=body.project_id if body else None)
        if self.session_timeout_s is not None and self._reaper is None:  # lazily, on the serving loop
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(), name="tinker-session-reaper")
        return sid

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.session_timeout_s / 4, 5.0))  # a periodic check, not a synchronization
            self.expire_sessions(time.monotonic())
            self.runs.sweep()  # checkpoints past their TTL (runs.py R3)
            self.records.sweep()  # futures' results past their TTL

    def expire_sessions(self, now: float) -> list[str]:
        """Sessions silent for longer than the timeout: save each model, free its slot, forget the session."""
        expired = [s for s in self.sessions.values() if now - s.last_seen > self.session_timeout_s]
        for s in expired:
            for m in [m for m in self.models.values() if m.session_id == s.session_id]:
                name = f"expired-{int(time.time())}"
                rid = self.futures.create(s.tenant, m.model_id)
                m.model.save_state(self.runs.folder(s.tenant, m.model_id, "weights", name),
                                   **self.op_kw(rid, self._saved(s.tenant, m.model_id, "weights", name, None, None)))
                self._unload(m, self.futures.create(s.tenant, m.model_id))
            del self.sessions[s.session_id]
            self.records.end_session(s.session_id, "expired", f"no heartbeat for {self.session_timeout_s:g} s")
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
        m = self.fleet
        if body.base_model != m.base_model:
            return f"base_model {body.base_model!r} is not served here; this server trains {m.base_model!r}"
        lc = body.lora_config
        if lc is None:
            return "only LoRA training is supported: send a lora_config"
        if not (lc.train_attn or lc.train_mlp or lc.train_unembed):
            return "train_attn, train_mlp and train_unembed are all False: at least one must be True (LoRA needs a target)"
        flag_of = {"attention": "train_attn", "mlp": "train_mlp", "unembed": "train_unembed"}
        missing = [flag_of[g] for g in lora_spec(lc, 0).targets if g not in m.target_groups]
        if missing:
            return (f"{', '.join(missing)}=True is not available on this server: its trainer has LoRA layers for "
                    f"{list(m.target_groups)} only (train_unembed needs output_layer in trainer.target_modules)")
        if not 1 <= lc.rank <= m.max_rank:
            return f"LoRA rank {lc.rank} not supported: 1..{m.max_rank} on this server"
        if body.optimizer_config and body.optimizer_config.get("type", "adamw") not in ("adam", "adamw"):
            return f"optimizer {body.optimizer_config.get('type')!r} not supported; only adamw"
        return None

    def _create(self, tenant: str, session_id: str, model_id: str, lora: LoraSpec, done: Callable[[Any, BaseException | None], None],
                request_id: str | None, answer: dict, user_metadata: dict | None = None) -> ModelRecord | None:
        """The model now, waiting for a slot (service/tenants/tinker_models.py: never refused for room);
        `done` is told when its slot holds its init. None (and `done` not called) if the id is taken.
        ValueError / QuotaExceeded: refused (nothing of it stays)."""
        if model_id in self.models:
            return None
        model = self.fleet.create(model_id, tenant, lora, session_id, done, request_id=request_id, user_metadata=user_metadata,
                                  answer=answer)
        record = ModelRecord(tenant, session_id, model_id, lora.rank, model)
        self.models[model_id] = record
        return record

    def create_model(self, tenant: str, body: wire.CreateModelRequest, model_id: str, request_id: str) -> None:
        """Create a model; the future ``request_id`` answers once it holds a slot (try_again with the
        reason while it waits), or why not."""
        problem = self._lora_problem(body)
        if problem:
            self.futures.resolve(request_id, user_error(problem))
            return
        try:
            meta = check_user_metadata(body.user_metadata)
        except ValueError as err:
            self.futures.resolve(request_id, user_error(str(err)))
            return
        seed = body.lora_config.seed if body.lora_config.seed is not None else (
            self.default_seed if self.default_seed is not None else secrets.randbits(31))
        answer = {"type": "create_model", "model_id": model_id}
        try:
            created = self._create(tenant, body.session_id, model_id, lora_spec(body.lora_config, seed),
                                   self.done(request_id, answer_outcome(answer)), request_id, answer, meta)
        except (ValueError, LorafleetError) as err:
            self.futures.resolve(request_id, user_error(str(err)))
            return
        if created is None:
            self.futures.resolve(request_id, user_error(f"model {model_id} exists (model_seq_id reused in this session)"))

    def submit_unload(self, tenant: str, model_id: str, request_id: str) -> None:
        self._unload(self.model(tenant, model_id), request_id)

    def _unload(self, record: ModelRecord, request_id: str) -> None:
        """Queue the unload (after the model's earlier operations); its record goes once it ran
        (operations sent after it are refused by the model: it has ended)."""
        answer = {"type": "unload_model", "model_id": record.model_id}

        def ok(_: Any) -> Outcome:
            self.models.pop(record.model_id, None)
            return Outcome(json=answer)

        record.model.unload(**self.op_kw(request_id, ok))

    def unload(self, model_id: str, timeout_s: float = 120.0) -> None:
        """Unload a model and wait until it is gone (tests and admin tools; NOT from the serving loop)."""
        record = self.models.get(model_id)
        if record is None:
            return
        finished = threading.Event()
        errors: list[BaseException] = []

        def done(_: Any, error: BaseException | None) -> None:
            self.models.pop(model_id, None)
            if error is not None:
                errors.append(error)
            finished.set()

        record.model.unload(done=done)
        if not finished.wait(timeout_s):
            raise TimeoutError(f"unloading {model_id} took longer than {timeout_s} s")
        if errors:
            raise errors[0]

    async def finish_session(self, tenant: str, session_id: str, reason: str | None = None, detail: str | None = None) -> None:
        """The client closed its session (``reason``: success, errored, interrupted): its models are unloaded."""
        self.session(tenant, session_id)
        for m in [m for m in self.models.values() if m.session_id == session_id]:
            self._unload(m, self.futures.create(tenant, m.model_id))
        del self.sessions[session_id]
        self.records.end_session(session_id, reason, detail)

    # -- checkpoints -------------------------------------------------------------------------------------

    def checkpoint_folder(self, tenant: str, tinker_path: str, kinds: tuple[str, ...]) -> str:
        """The store reference of the caller's checkpoint named by ``tinker://<model>/<kind>/<name>``;
        ValueError if none."""
        prefix = "tinker://"
        parts = tinker_path[len(prefix):].split("/") if tinker_path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] not in kinds or not NAME_RE.match(parts[2]) or not parts[0] or ".." in parts[0]:
            raise ValueError(f"checkpoint path {tinker_path!r} invalid: expected tinker://<model_id>/{'|'.join(kinds)}/<name>")
        self.runs.sweep(tenant)  # an expired checkpoint is never resolved (runs.py R3)
        key = self.runs.readable_key(tenant, parts[0], parts[1], parts[2])  # the caller's, or a published one (runs.py R5)
        if not self.store.exists(key) and not _legacy_checkpoint(self.store, key):
            raise ValueError(f"no checkpoint {tinker_path} for this API key")
        return self.store.url(key)

    def _saved(self, tenant: str, model_id: str, kind: str, name: str, ttl: int | None, meta: dict | None,
               answer: dict | None = None, sampling_session_seq_id: int | None = None) -> Callable[[Any], Outcome]:
        """The ok of a save: the checkpoint recorded (runs.py R2: after its folder is committed), then the answer."""
        def ok(extra: Any) -> Outcome:
            self.runs.record_checkpoint(tenant, model_id, kind, name, ttl_seconds=ttl, user_metadata=meta)
            result = {**(answer or {}), **(extra if isinstance(extra, dict) else {})}
            if kind == "sampler_weights" and sampling_session_seq_id is not None and self.sampler is not None:
                result["sampling_session_id"] = self.sampler.create_session(tenant, self.runs.folder(tenant, model_id, kind, name),
                                                                            result.get("path"))
                if model_id in self.models:  # get_session's sampler_ids (api/tinker/sessions.py)
                    self.records.link_sampler(self.models[model_id].session_id, result["sampling_session_id"])
            return Outcome(json=result)
        return ok

    def submit_save(self, tenant: str, body: wire.SaveWeightsRequest, kind: str,
                    write_with: Callable[[Callable[[str], str], str], dict] | None = None) -> dict:
        """Save a checkpoint of ``kind`` (weights, sampler_weights, external_weights) as an operation on
        the model's queue. ``write_with(export, folder)`` (external weights): writes the checkpoint into
        ``folder`` given ``export(to)``, which writes the model's PEFT folder to ``to`` on the
        scheduler's thread, and returns extra answer fields. The checkpoint is recorded with its TTL
        and metadata (runs.py)."""
        record = self.model(tenant, body.model_id)
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
        folder = self.runs.folder(tenant, body.model_id, kind, name)
        path = f"tinker://{body.model_id}/{kind}/{name}"
        if self.store.exists(self.runs.key(tenant, body.model_id, kind, name)):
            self.futures.resolve(rid, user_error(f"checkpoint {path} exists; choose another name"))
            return answer
        wire_type = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler",
                     "external_weights": "save_weights_external"}[kind]
        reply = {"type": wire_type, "path": path}
        kw = self.op_kw(rid, self._saved(tenant, body.model_id, kind, name, body.ttl_seconds, meta, reply,
                                         body.sampling_session_seq_id))
        if kind == "weights":
            record.model.save_state(folder, answer=reply, **kw)
        elif kind == "sampler_weights":  # the SDK's save_weights_and_get_sampling_client: no name, a session
            ephemeral = body.path is None and body.sampling_session_seq_id is not None  # (the SDK: "always ephemeral")
            record.model.save_sampler_weights(folder, answer=reply, durable=not ephemeral, **kw)
        else:
            record.model.export_with(lambda export: write_with(export, folder), **kw)
        return answer

    def submit_load(self, tenant: str, body: wire.LoadWeightsRequest) -> dict:
        if body.model_id is not None:
            record = self.model(tenant, body.model_id)
            model_id = record.model_id
        elif body.session_id is not None and body.model_seq_id is not None:
            self.session(tenant, body.session_id)
            model_id = self.model_id(body.session_id, body.model_seq_id)
            record = None
        else:
            raise HTTPException(400, "load_weights needs model_id, or session_id with model_seq_id")
        rid = self.futures.create(tenant, model_id)
        answer = {"request_id": rid, "model_id": model_id}
        reply = {"type": "load_weights", "path": body.path, "model_id": model_id}
        created = record is None
        try:
            folder = self.checkpoint_folder(tenant, body.path, kinds=("weights",))
            if record is None:  # create-via-load: the model takes the checkpoint's LoRA shape
                lora = checkpoint_lora(readable_folder(self.store, folder, legacy_marker=META))
                record = self._create(tenant, body.session_id, model_id, lora, lambda value, error: None, None,
                                      {"type": "create_model", "model_id": model_id}, check_user_metadata(body.user_metadata))
                if record is None:
                    raise ValueError(f"model {model_id} exists (model_seq_id reused in this session)")
        except (ValueError, LorafleetError) as err:
            self.futures.resolve(rid, user_error(str(err)))
            return answer
        finish = self.done(rid, answer_outcome(reply))

        def loaded(value: Any, error: BaseException | None) -> None:
            if error is not None and created and model_id in self.models:  # a model created for this load does not outlive it
                self._unload(self.models[model_id], self.futures.create(tenant, model_id))
            finish(value, error)

        record.model.load_state(folder, body.optimizer, done=loaded, cancelled=self.cancelled(rid), request_id=rid, answer=reply)
        return answer

    # -- sampling ----------------------------------------------------------------------------------------

    def sampling_folder(self, tenant: str, base_model: str | None, model_path: str | None) -> str | None:
        """The store reference of the PEFT folder to sample with (None = the base model); ValueError
        naming the problem."""
        if self.sampler is None:
            raise ValueError("this server has no sampling engine (sampleable: false)")
        if model_path:
            return self.checkpoint_folder(tenant, model_path, kinds=("sampler_weights",))
        if base_model != self.fleet.base_model:
            raise ValueError(f"base_model {base_model!r} is not served here; this server samples {self.fleet.base_model!r}")
        return None

    def _unreadable_sampler_folder(self, folder: str) -> str | None:
        """Why a sampling session restored after a restart cannot sample its folder, or None (the
        sampler asks once, before the adapter is loaded): its files are checked against the store's
        manifest, since an ephemeral sampler folder is written without waiting for the disk
        (trainer/storage/store.py S5) and may be torn if the machine stopped. A folder from before
        the store (no manifest) is read as it is, as every checkpoint reader does (readable_folder)."""
        try:
            readable_folder(self.store, folder, legacy_marker=ADAPTER_CONFIG)
            return None
        except StoreError as err:
            return (f"this sampling session's weights cannot be read ({err}): a checkpoint deleted since, or "
                    "ephemeral weights (save_weights_and_get_sampling_client writes them without waiting for the disk) "
                    "lost when the machine stopped; save the weights again and sample with a new client")


def _legacy_checkpoint(store, key: str) -> bool:  # noqa: ANN001 - a CheckpointStore
    """A Tinker checkpoint folder written before the store (no manifest): a slot state or a PEFT folder.
    Only a local store has them (CheckpointStore.legacy_folder)."""
    folder = store.legacy_folder(key)
    return folder is not None and any((folder / f).is_file() for f in (META, "adapter_config.json"))
