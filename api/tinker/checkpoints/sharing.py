"""``sharing_router(service)``: a checkpoint read beyond its run: ``publish``/``unpublish`` (RestClient
``publish_checkpoint_from_tinker_path``, ``unpublish_checkpoint_from_tinker_path``) and ``copy_weights``
(``ServiceClient.copy_weights``, ``RestClient.copy_weights``).

Publishing is a column of the checkpoint's record (api/tinker/checkpoints/runs.py R5): only the owner
publishes or unpublishes (another tenant's path is 404, as if unknown; both are idempotent: the SDK
sends a request again when its answer was lost); once published, every tenant of the service may read it through its tinker path, and none but
the owner may change it.

A copy (within the caller's tenant): the source is a checkpoint the caller may read (its own, or a
published one); the copy keeps the source's kind and name, in a new training run of a new session
(``<session>:train:0``, as the SDK documents: a run that cannot be trained on; load the copy to train
from it), with the request's TTL (the source's expiry is not inherited) and the source's user
metadata. The store copies by hard link (local disks) or server-side (S3): no bytes travel through
the service. The SDK sends an ``X-Idempotency-Key`` and retries with the same key: the new session's
id is derived from the tenant and that key, so a retried copy answers the first copy's path (K1).
Invariants: K2 the copy's folder is committed before its record (runs.py R2); K3 the source's owner,
record and files are not changed.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from fastapi import APIRouter, HTTPException, Request

from api.tinker.checkpoints.runs import KIND_TYPES, check_ttl
from api.tinker.service import TinkerService
from api.tinker.wire import _In

COPY_SESSION_REASON = ("success", "holds a copy made by copy_weights")


class CopyWeightsIn(_In):
    """The SDK's CopyWeightsRequest."""

    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


def sharing_router(service: TinkerService) -> APIRouter:
    r = APIRouter()
    runs = service.runs

    def tenant(request: Request) -> str:
        return service.keys.authenticate(request)

    @r.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request) -> None:
        runs.set_public(tenant(request), run_id, kind, name, True)

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request) -> None:
        runs.set_public(tenant(request), run_id, kind, name, False)

    @r.post("/copy_weights")
    async def copy_weights(body: CopyWeightsIn, request: Request) -> dict:
        t = tenant(request)
        path = copy_checkpoint(service, t, body, request.headers.get("x-idempotency-key"),
                               request.headers.get("x-tinker-weights-access-token"))
        await service.futures.durable()  # the copy's records are committed before its path is answered
        return {"tinker_path": path}

    return r


def copy_checkpoint(service: TinkerService, tenant: str, body: CopyWeightsIn, idempotency_key: str | None,
                    access_token: str | None) -> str:
    """The copy's tinker path (module doc); HTTPException 400 for a request this server does not serve,
    404 for a source the caller may not read."""
    if access_token is not None or body.weights_access_token is not None:
        raise HTTPException(400, "weights_access_token is not served by lorafleet: a published checkpoint is readable "
                                 "without one, and another tenant's private checkpoint is never readable")
    if body.session_id is not None or body.model_seq_id is not None or body.destination_project_id is None:
        raise HTTPException(400, "copy_weights takes destination_project_id (a label here: lorafleet has no projects) "
                                 "and puts the copy in a new session, as the SDK's copy_weights asks; session_id and "
                                 "model_seq_id are not served")
    try:
        check_ttl(body.ttl_seconds)
    except ValueError as err:
        raise HTTPException(400, str(err)) from None
    parts = body.source_path.removeprefix("tinker://").split("/") if body.source_path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KIND_TYPES:
        raise HTTPException(400, f"source_path {body.source_path!r} invalid: expected tinker://<run_id>/"
                                 f"{'|'.join(KIND_TYPES)}/<name>")
    run_id, kind, name = parts
    records = service.records
    digest = hashlib.sha256(f"{tenant}\0{idempotency_key}".encode()).hexdigest() if idempotency_key else uuid.uuid4().hex
    session_id = f"s-{digest[:16]}"
    copy_run = service.model_id(session_id, 0)
    made = records.checkpoints(tenant, copy_run) if records.run_of(tenant, copy_run) is not None else None
    if made:  # K1: a retry of a copy made (its records are committed: the first answer waited for them)
        return f"tinker://{copy_run}/{made[0]['kind']}/{made[0]['name']}"
    source_run = service.runs.copy_to(tenant, run_id, kind, name, copy_run, body.ttl_seconds)  # K2: the folder first
    records.add_session(session_id, tenant, project_id=body.destination_project_id, ended=COPY_SESSION_REASON)
    records.add_model(copy_run, tenant, session_id, source_run["rank"], source_run["seed"],
                      tuple(json.loads(source_run["targets"])), None, seq=0)
    records.end_model(copy_run)
    return f"tinker://{copy_run}/{kind}/{name}"
