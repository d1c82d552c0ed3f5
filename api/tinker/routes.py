"""``tinker_router(service)``: the Tinker wire protocol under ``/api/v1``.

Thin handlers: authenticate (key -> tenant), check ownership (another tenant's
session, model or future id is 404, as if it did not exist), put the work on the
model's queue (service.py -> service/tenants/tinker_model.py; the scheduler runs it) and answer
the future's id; the result comes through ``retrieve_future``. Bad input that the SDK would only learn about through the future
(bad data, unsupported LoRA options, unknown checkpoint) is reported there, with
category ``user`` and a message saying what is allowed; nothing changes for anyone.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from api.tinker import wire
from api.tinker.completions import target_of
from api.tinker.model_views import note_sample
from api.tinker.custom_losses import CustomLosses, custom_loss_router
from api.tinker.futures import user_error
from api.tinker.outcomes import fb_outcome, optim_outcome
from api.tinker.checkpoints.routes import runs_router
from api.tinker.proto_io import PROTO_CONTENT_TYPE, decode_forward_backward
from api.tinker.resolved_feed import PARKABLE_HEADER
from api.tinker.sampling.sampler import LogprobOptions
from api.tinker.service import TinkerService, lora_flags
from api.tinker.sessions import sessions_router
from api.tinker.sampling.stability import attach_recorded_inputs, with_statistics
from service.tenants.tinker_lora import checkpoint_lora
from trainer.rounds import AdamStep
from trainer.storage.locations import readable_folder
from trainer.storage.slot_state_format import META


def tinker_router(service: TinkerService) -> APIRouter:
    r = APIRouter(prefix="/api/v1", dependencies=[Depends(service.start)])  # revives a restart first
    losses = CustomLosses(service.records)  # server-side custom losses (api/tinker/custom_losses.py)

    def tenant(request: Request) -> str:
        return service.keys.authenticate(request)

    def future(t: str, model_id: str | None) -> tuple[str, dict]:
        rid = service.futures.create(t, model_id)
        body = {"request_id": rid}
        if model_id:
            body["model_id"] = model_id
        return rid, body

    # -- service --------------------------------------------------------------------------------

    @r.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @r.post("/client/config")
    async def client_config(request: Request) -> dict:
        tenant(request)
        # The SDK's own default transport (pyqwest: reqwest under httpx's API, lighter on the client's
        # CPU than httpx's pool), plain protobuf bodies, no JWT exchange.
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": True, "proto_compress_fwdbwd": False,
                "sample_use_retrieve_futures": True,  # batched polling: retrieve_futures (api/tinker/completions.py)
                "custom_loss_server_side": True,  # create_custom_loss, run in the trainer's round (custom_losses.py)
                "sample_join_sampling_session": True}  # a cloned sampling client asks for its id (sessions.py)

    @r.post("/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict:
        tenant(request)
        # cancel_future answers a sample's future but does not stop the engine's work: the SDK need not send it
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @r.post("/telemetry")
    async def telemetry(request: Request) -> dict:
        tenant(request)
        return {"status": "accepted"}

    @r.get("/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        tenant(request)
        b = service.fleet
        return {"supported_models": [{"model_name": b.base_model, "max_context_length": b.max_seq_len,
                                      "trainable": True, "sampleable": service.sampler is not None}]}

    @r.post("/create_session")
    async def create_session(body: wire.CreateSessionRequest, request: Request) -> dict:
        sid = service.create_session(tenant(request), body)
        await service.futures.durable()  # D1: an id is answered only once it is recorded
        return {"type": "create_session", "session_id": sid}

    @r.post("/session_heartbeat")
    async def heartbeat(body: wire.SessionRequest, request: Request) -> dict:
        service.session(tenant(request), body.session_id).touch()
        return {"type": "session_heartbeat"}

    @r.post("/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request, body: wire.FinishSessionRequest | None = None) -> dict:
        reason = body.reason.type if body is not None and body.reason is not None else None
        await service.finish_session(tenant(request), session_id, reason, body.detail if body is not None else None)
        return {}

    # -- models -----------------------------------------------------------------------------------

    @r.post("/create_model")
    async def create_model(body: wire.CreateModelRequest, request: Request) -> dict:
        t = tenant(request)
        service.session(t, body.session_id)
        model_id = service.model_id(body.session_id, body.model_seq_id)
        rid, answer = future(t, model_id)
        service.create_model(t, body, model_id, rid)
        await service.futures.durable()
        return answer

    @r.post("/get_info")
    async def get_info(body: wire.ModelRequest, request: Request) -> dict:
        m = service.model(tenant(request), body.model_id)
        b = service.fleet
        return {"type": "get_info", "model_id": m.model_id, "is_lora": True, "lora_rank": m.rank,
                "model_name": b.base_model,
                "model_data": {"arch": "lorafleet", "model_name": b.base_model, "tokenizer_id": b.tokenizer_id}}

    @r.post("/unload_model")
    async def unload_model(body: wire.ModelRequest, request: Request) -> dict:
        t = tenant(request)
        service.model(t, body.model_id)
        rid, answer = future(t, body.model_id)
        service.submit_unload(t, body.model_id, rid)
        await service.futures.durable()
        return answer

    # -- training ---------------------------------------------------------------------------------

    @r.post("/forward_backward")
    async def forward_backward(request: Request) -> dict:
        t = tenant(request)
        try:
            fb = decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        record = service.model(t, fb.model_id)
        custom = losses.for_call(t, record.session_id, fb)  # loss_fn "custom": its loss (404 if not the session's)
        model = record.model
        rid, answer = future(t, fb.model_id)
        sampler = service.sampler
        try:  # stable_reinforce: its inputs from the server's sampling records (api/tinker/sampling/stability.py)
            data = attach_recorded_inputs(t, fb.loss_fn, fb.data, fb.provenance, sampler.records if sampler else None)
        except ValueError as err:
            service.futures.resolve(rid, user_error(str(err)))
            await service.futures.durable()
            return answer
        ok = with_statistics(fb.loss_fn, fb.loss_fn_config, data, sampler.stable_reinforce if sampler else None, fb_outcome)
        submit = model.forward if fb.forward_only else model.forward_backward
        submit(data, fb.loss_fn, fb.loss_fn_config, custom_loss=custom, **service.op_kw(rid, ok))
        await service.futures.durable()  # the future, and (tinker_durability step) its request: the log
        return answer

    @r.post("/optim_step")
    async def optim_step(body: wire.OptimStepRequest, request: Request) -> dict:
        t = tenant(request)
        model = service.model(t, body.model_id).model
        rid, answer = future(t, body.model_id)
        if body.adam_params is None or body.adam_params.type not in (None, "adam", "adamw"):
            service.futures.resolve(rid, user_error("only Adam(W) optimizer steps are supported: send adam_params"))
            await service.futures.durable()
            return answer
        p = body.adam_params
        adam = AdamStep(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                        weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)
        try:
            model.optim_step(adam, **service.op_kw(rid, optim_outcome))
        except ValueError as err:  # bad adam_params: refused before it is queued
            service.futures.resolve(rid, user_error(str(err)))
        await service.futures.durable()
        return answer

    # -- checkpoints ------------------------------------------------------------------------------

    @r.post("/save_weights")
    async def save_weights(body: wire.SaveWeightsRequest, request: Request) -> dict:
        answer = service.submit_save(tenant(request), body, kind="weights")
        await service.futures.durable()
        return answer

    @r.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(body: wire.SaveWeightsRequest, request: Request) -> dict:
        answer = service.submit_save(tenant(request), body, kind="sampler_weights")
        await service.futures.durable()
        return answer

    @r.post("/load_weights")
    async def load_weights(body: wire.LoadWeightsRequest, request: Request) -> dict:
        answer = service.submit_load(tenant(request), body)
        await service.futures.durable()
        return answer

    @r.post("/weights_info")
    async def weights_info(body: wire.WeightsInfoRequest, request: Request) -> dict:
        t = tenant(request)
        try:
            folder = service.checkpoint_folder(t, body.tinker_path, kinds=("weights",))
            lora = checkpoint_lora(readable_folder(service.store, folder, legacy_marker=META))
        except ValueError as err:
            raise HTTPException(404, str(err)) from None
        return {"base_model": service.fleet.base_model, "is_lora": True, "lora_rank": lora.rank, **lora_flags(lora)}

    # -- sampling ---------------------------------------------------------------------------------

    @r.post("/create_sampling_session")
    async def create_sampling_session(body: wire.CreateSamplingSessionRequest, request: Request) -> dict:
        t = tenant(request)
        service.session(t, body.session_id)
        try:
            folder = service.sampling_folder(t, body.base_model, body.model_path)
        except ValueError as err:
            raise HTTPException(404 if body.model_path else 400, str(err)) from None
        sid = service.sampler.create_session(t, folder, body.model_path)
        service.records.link_sampler(body.session_id, sid)  # get_session's sampler_ids (api/tinker/sessions.py)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        s = service.sampler.session(tenant(request), sampler_id) if service.sampler else None
        if s is None:
            raise HTTPException(404, f"unknown sampler {sampler_id}")
        return {"sampler_id": sampler_id, "base_model": service.fleet.base_model, "model_path": s.model_path}

    @r.post("/asample")
    async def asample(body: wire.SampleRequest, request: Request) -> dict:
        t = tenant(request)
        rid = service.futures.create(t, None, kind="sample", target=target_of(body.sampling_session_id, body.seq_id))
        answer = {"request_id": rid, "sample_sequence_ids": [f"{rid}-{i}" for i in range(body.num_samples)]}
        try:
            if body.target_prompt_logprobs is not None or body.prompt_alt_tokens_k:
                raise ValueError("target_prompt_logprobs and prompt_alt_tokens_k are not served; ask for prompt_logprobs "
                                 "or topk_prompt_logprobs instead")
            prompt = body.prompt.tokens()
            if not prompt or min(prompt) < 0:
                raise ValueError("prompt needs at least one token id >= 0")
            if body.sampling_session_id is not None:
                session = service.sampler.session(t, body.sampling_session_id) if service.sampler else None
                if session is None:
                    raise HTTPException(404, f"unknown sampling session {body.sampling_session_id}")
            else:
                folder = service.sampling_folder(t, body.base_model, body.model_path)
                session = service.sampler.sessions[service.sampler.create_session(t, folder, body.model_path)]
        except ValueError as err:
            service.futures.resolve(rid, user_error(str(err)))
            await service.futures.durable()
            return answer

        note_sample(service, t, session.model_path, body.num_samples)  # its model's sample_calls (model_views.py)

        async def run() -> None:
            options = LogprobOptions(bool(body.prompt_logprobs), body.topk_prompt_logprobs, body.topk_sample_logprobs,
                                     body.prompt_logprobs_last_n)
            service.futures.resolve(rid, await service.sampler.sample(session, prompt, body.num_samples, body.sampling_params,
                                                                      options, rid if body.record_stability_info else None))

        service.background(run())
        await service.futures.durable()  # D1: after a restart its future answers why (never unknown)
        return answer

    # -- futures ----------------------------------------------------------------------------------

    @r.post("/retrieve_future")
    async def retrieve_future(body: wire.FutureRequest, request: Request) -> Response:
        t = tenant(request)
        try:
            outcome = await service.futures.retrieve(t, body.request_id)
        except KeyError:
            raise HTTPException(404, f"unknown request id {body.request_id}") from None
        if outcome is None:  # still running; the front may hold the next polls (api/tinker/resolved_feed.py)
            parkable = {PARKABLE_HEADER: "1"} if service.futures.watch(t, body.request_id) else None
            return JSONResponse({"type": "try_again", "request_id": body.request_id, **service.futures.queue_state(t, body.request_id)},
                                headers=parkable)
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTO_CONTENT_TYPE)
        return JSONResponse(outcome.json, status_code=outcome.status)

    @r.post("/retrieve_futures")
    async def retrieve_futures(body: wire.FuturesRequest, request: Request) -> dict:
        """A sampling client's batched long poll (api/tinker/completions.py Q1-Q5)."""
        t = tenant(request)
        sid = body.target.sampling_session_id
        if service.sampler is None or service.sampler.session(t, sid) is None:
            raise HTTPException(404, f"unknown sampling session {sid}")
        return await service.futures.completions.poll(t, (sid, body.target.cloned_sampler_id), body.prev_cursor, body.timeout,
                                                      body.retrieved_request_ids)

    @r.post("/cancel_future")
    async def cancel_future(body: wire.FutureRequest, request: Request) -> dict:
        try:
            cancelled = service.futures.cancel(tenant(request), body.request_id)
        except KeyError:
            raise HTTPException(404, f"unknown request id {body.request_id}") from None
        return {"cancelled": cancelled}

    r.include_router(custom_loss_router(service, losses))  # create_custom_loss (api/tinker/custom_losses.py)
    r.include_router(sessions_router(service))  # sessions list/get/search, join_sampling_session (api/tinker/sessions.py)
    r.include_router(runs_router(service))  # training runs, checkpoints, external weights (api/tinker/checkpoints/routes.py)
    return r
