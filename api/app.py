"""The FastAPI control plane: `create_app(controller_handle, settings)`.

Routes are thin: authenticate, validate (pydantic), call the controller, map
its typed errors to a status. The mapping lives here only:

    BadValue 400 · bad/missing token 401 · NotFound 404 · Conflict / NoFreeSlot 409
    · body too large 413 · schema 422 · controller unavailable 503

Every error body is `api.models.ErrorOut`: what was wrong and what is allowed.
A refused request changes nothing (the controller checks before it writes and
the registry writes in one transaction).

Auth: when settings.api_token is set, every /v1 route and /metrics need
`Authorization: Bearer <token>` (constant-time compare). /health, /ready and
the OpenAPI docs stay open (they reveal no tenant data). A token is mandatory
when the bind host is not loopback (ServiceSettings refuses otherwise, and
create_app checks again).
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from api.body_limit import BodySizeLimit
from api.controller_client import ControllerClient, ControllerUnavailable
from api.metrics import render_prometheus
from api.ui import mount_ui
from api.models import (
    ERROR_RESPONSES,
    AbortOut,
    AdapterCreate,
    AdapterList,
    AdapterOut,
    ErrorOut,
    HealthOut,
    MetricsOut,
    ReadyOut,
    StepOut,
)
from service.config import ServiceSettings, is_loopback_host
from service.fleet_stats import FleetStats
from service.errors import BadValue, Conflict, LorafleetError, NoFreeSlot, NotFound
from service.registry import AdapterState

log = logging.getLogger(__name__)

STATUS_OF_ERROR: dict[type[LorafleetError], int] = {BadValue: 400, NotFound: 404, NoFreeSlot: 409, Conflict: 409}


class Unauthorized(Exception):
    pass


def create_app(controller_handle: Any, settings: ServiceSettings, fleet_stats: FleetStats | None = None) -> FastAPI:
    token = settings.api_token.get_secret_value() if settings.api_token is not None else ""
    if not token and not is_loopback_host(settings.host):
        raise ValueError(f"refusing to serve on {settings.host!r} without an API token (set LORAFLEET_API_TOKEN)")
    controller = ControllerClient(controller_handle, settings.controller_timeout_s)

    app = FastAPI(
        title="lorafleet",
        summary="Train many LoRA adapters at once against one frozen base model.",
        version=_version(),
        responses=ERROR_RESPONSES,
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    def require_token(request: Request) -> None:
        if not token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized("missing bearer token: send the header 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("invalid bearer token")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

    @v1.post("/adapters", status_code=201, response_model=AdapterOut, summary="Register an adapter run (PENDING)")
    async def register(body: AdapterCreate) -> AdapterOut:
        return AdapterOut.from_ref(await controller.call("register", body.name, body.config))

    @v1.get("/adapters", response_model=AdapterList, summary="List adapters (newest run per name)")
    async def list_adapters(state: AdapterState | None = Query(None, description="Only adapters in this state.")) -> AdapterList:
        refs = await controller.call("list", state)
        return AdapterList(adapters=[AdapterOut.from_ref(r) for r in refs])

    @v1.get("/adapters/{name}", response_model=AdapterOut, summary="One adapter")
    async def get_adapter(name: str) -> AdapterOut:
        return AdapterOut.from_ref(await controller.call("get", name))

    @v1.get("/adapters/{name}/metrics", response_model=MetricsOut, summary="Per-step metrics series")
    async def adapter_metrics(name: str) -> MetricsOut:
        run = await controller.call("metrics", name)
        return MetricsOut(name=run.name, registration_id=run.registration_id, steps=[StepOut.from_record(s) for s in run.steps])

    @v1.delete("/adapters/{name}", status_code=202, response_model=AdapterOut, summary="Retire gracefully (RETIRING, then COMPLETED with export)")
    async def retire(name: str) -> AdapterOut:
        return AdapterOut.from_ref(await controller.call("retire", name))

    @v1.post("/adapters/{name}/abort", response_model=AbortOut, summary="Abort in-flight generation without retiring")
    async def abort(name: str) -> AbortOut:
        return AbortOut(name=name, aborted=await controller.call("abort", name))

    app.include_router(v1)
    mount_ui(app, require_token, fleet_stats)  # the dashboard (/ui) and GET /v1/fleet/stats, behind the same token

    @app.get("/health", response_model=HealthOut, summary="Process alive")
    async def health() -> HealthOut:
        return HealthOut(**await controller.call("health"))

    @app.get("/ready", response_model=ReadyOut, responses={503: {"model": ReadyOut}}, summary="Trainer and engines up")
    async def ready() -> Any:
        body = ReadyOut(**await controller.call("ready"))
        return body if body.ready else JSONResponse(body.model_dump(), status_code=503)

    @app.get("/metrics", dependencies=[Depends(require_token)], response_class=Response, summary="Prometheus metrics")
    async def metrics() -> Response:
        body, content_type = render_prometheus(await controller.call("snapshot"))
        return Response(body, media_type=content_type)

    _install_error_handlers(app)
    return app


def _error(status: int, code: str, detail: str, field: str | None = None, **extra: Any) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    body = ErrorOut(error=code, detail=detail, field=field, **extra)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LorafleetError)
    async def _typed(_: Request, e: LorafleetError) -> JSONResponse:
        # Most specific class first (NoFreeSlot before Conflict).
        status = next((STATUS_OF_ERROR[c] for c in type(e).__mro__ if c in STATUS_OF_ERROR), 400)
        return _error(status, e.code, e.message, e.field)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, e: Unauthorized) -> JSONResponse:
        return _error(401, "unauthorized", str(e))

    @app.exception_handler(ControllerUnavailable)
    async def _unavailable(_: Request, e: ControllerUnavailable) -> JSONResponse:
        return _error(503, "unavailable", str(e))

    @app.exception_handler(RequestValidationError)
    async def _schema(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = []
        lines = []
        for err in e.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            where = ".".join(loc) or "body"
            lines.append(f"{where}: {err.get('msg')}")
            errors.append({"field": where, "message": err.get("msg"), "type": err.get("type")})
        first = errors[0]["field"] if errors else None
        return _error(422, "schema", "; ".join(lines), first, errors=errors)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorafleet")
    except PackageNotFoundError:
        return "0+unknown"
