"""``runs_router(service)``: the RestClient's routes under ``/api/v1``, beside routes.py's.

Training runs (get, list, by tinker path: the SDK parses the path and gets the run),
checkpoints (list per run, list per caller, delete, TTL), ``save_weights_external`` and the
signed download URLs of its files (``tinker_cookbook.weights.download``). Thin handlers over
``api/tinker/checkpoints/runs.py`` (the records, R1-R4) and ``api/tinker/checkpoints/external_weights.py`` (the export
and its URLs, X1-X3). Every route but the signed download takes the caller's key and sees only
the caller's runs (and, with ``access_scope="accessible"``, the runs of checkpoints other tenants
published: api/tinker/checkpoints/runs.py R5): another tenant's id or path is 404. Publishing and
copies: api/tinker/checkpoints/sharing.py. RestClient calls lorafleet does not serve (projects,
traces, audit, billing) answer 400 with what is served instead, so a client learns it at once (the
SDK does not retry a 400).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse

from api.tinker import wire
from api.tinker.checkpoints.external_weights import UrlSigner, file_in, parse_recipients, write_external
from api.tinker.checkpoints.sharing import sharing_router
from api.tinker.futures import user_error
from api.tinker.service import TinkerService

MAX_PAGE = 1000

# RestClient / AdminClient calls that are not served: (method, path) -> why, and what to use.
NOT_SERVED = {
    ("PUT", "/sessions/{session_id}/project"): "projects are not served by lorafleet",
    ("GET", "/sessions/{session_id}/trace_export"): "session traces are not served by lorafleet",
    ("GET", "/audit"): "the audit log is not served by lorafleet",
    ("GET", "/billing/usage/events"): "billing is not served by lorafleet",
    ("GET", "/billing/usage/checkpoints/current"): "billing is not served by lorafleet; list_user_checkpoints shows "
                                                   "each checkpoint's size_bytes",
}


def runs_router(service: TinkerService, signer: UrlSigner | None = None) -> APIRouter:
    r = APIRouter()
    runs = service.runs
    signer = signer or UrlSigner(clock=lambda: runs.clock())  # the records' wall clock (tests move it)

    def tenant(request: Request) -> str:
        return service.keys.authenticate(request)

    # -- training runs --------------------------------------------------------------------------

    @r.get("/training_runs")
    async def list_training_runs(request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE), offset: int = Query(0, ge=0),
                                 access_scope: Literal["owned", "accessible"] = "owned") -> dict:
        # "accessible" adds the runs of checkpoints other tenants published (runs.py R5)
        return runs.list_runs(tenant(request), limit, offset, accessible=access_scope == "accessible")

    @r.get("/training_runs/{run_id}")
    async def get_training_run(run_id: str, request: Request, access_scope: Literal["owned", "accessible"] = "owned") -> dict:
        return runs.get_run(tenant(request), run_id, accessible=access_scope == "accessible")

    # -- checkpoints ----------------------------------------------------------------------------

    @r.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request) -> dict:
        return runs.list_checkpoints(tenant(request), run_id)

    @r.get("/checkpoints")
    async def list_user_checkpoints(request: Request, limit: int = Query(100, ge=1, le=MAX_PAGE),
                                    offset: int = Query(0, ge=0)) -> dict:
        return runs.list_user_checkpoints(tenant(request), limit, offset)

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request) -> dict:
        runs.delete(tenant(request), run_id, kind, name)
        return {}

    @r.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_checkpoint_ttl(run_id: str, kind: str, name: str, body: wire.CheckpointTtlRequest, request: Request) -> dict:
        t = tenant(request)
        try:
            runs.set_ttl(t, run_id, kind, name, body.ttl_seconds)
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        return {}

    # -- external weights -----------------------------------------------------------------------

    @r.post("/save_weights_external")
    async def save_weights_external(body: wire.SaveWeightsExternalRequest, request: Request) -> dict:
        t = tenant(request)
        try:
            recipients = parse_recipients(body.age_encryption_recipients)
        except ValueError as err:
            service.model(t, body.model_id)
            rid = service.futures.create(t, body.model_id)
            service.futures.resolve(rid, user_error(str(err)))
            await service.futures.durable()
            return {"request_id": rid, "model_id": body.model_id}

        def write(export, folder) -> dict:  # noqa: ANN001 - the model's PEFT export, the checkpoint's store reference
            return {"size_bytes": write_external(export, service.store, service.store.key_of(folder), recipients)}

        answer = service.submit_save(t, body, kind="external_weights", write_with=write)
        await service.futures.durable()
        return answer

    @r.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(run_id: str, kind: str, name: str, request: Request) -> dict:
        t = tenant(request)
        object_store = _object_store(service.store)
        if object_store is not None:  # the object store's own presigned GET URLs: nothing is downloaded here
            listed = runs.list_checkpoints(t, run_id)["checkpoints"]  # sweeps expired ones (R3); 404 for another's run
            if not any(c["checkpoint_id"] == f"{kind}/{name}" for c in listed):
                raise HTTPException(404, f"unknown checkpoint {kind}/{name} of training run {run_id}")
        else:
            folder = runs.checkpoint_folder(t, run_id, kind, name)
        if kind != "external_weights":
            raise HTTPException(400, f"only external_weights checkpoints have download URLs, not {kind}: save them with "
                                     "save_weights_external")
        if object_store is not None:
            expires = int(runs.clock() + signer.ttl_s)
            urls = object_store.presigned_urls(runs.key(t, run_id, kind, name), int(signer.ttl_s))
            return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}
        return signer.urls(str(request.base_url), t, run_id, name, folder)

    @r.get("/external_weights_files/{owner}/{run_id}/{name}/{file:path}")
    async def external_weights_file(owner: str, run_id: str, name: str, file: str, expires: int = 0, sig: str = "") -> FileResponse:
        # The URL is the credential (X1): no key; a bad signature, an expired URL and a missing file look alike.
        missing = HTTPException(404, "no such file (the URL is wrong or expired: ask get_external_weights_urls again)")
        if not signer.valid(owner, run_id, name, file, expires, sig):
            raise missing
        try:
            folder = runs.checkpoint_folder(owner, run_id, "external_weights", name)
        except HTTPException:
            raise missing from None
        path = file_in(folder, file)
        if path is None:
            raise missing
        return FileResponse(path, media_type="application/octet-stream")

    r.include_router(sharing_router(service))  # publish, unpublish, copy_weights (api/tinker/checkpoints/sharing.py)

    # -- not served -----------------------------------------------------------------------------

    def refusal(why: str):  # noqa: ANN202 - a route handler
        async def refuse(request: Request) -> dict:
            tenant(request)
            raise HTTPException(400, why)

        return refuse

    for (method, path), why in NOT_SERVED.items():
        r.add_api_route(path, refusal(why), methods=[method], name=f"not_served:{method} {path}")

    return r


def _object_store(store):  # noqa: ANN001, ANN202 - a CheckpointStore; an S3Store or None
    """The store when it is an object store, whose presigned URLs a client downloads from directly."""
    from trainer.storage.s3_store import S3Store  # the object-storage client, imported only where one is used

    return store if isinstance(store, S3Store) else None
