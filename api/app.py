"""The FastAPI control plane: `create_app(controller, settings)` over the in-process Controller.

Routes are thin: authenticate, validate (pydantic), call the controller; its
typed errors map to a status in api/errors.py (the one place), and every error
body is `api.models.ErrorOut`: what was wrong and what is allowed. No JSON body
shows the server's absolute paths (api/public_paths.py).
A refused request changes nothing (the controller checks before it writes and
the registry writes in one transaction).

Auth: when settings.api_token is set, every /v1 route and /metrics need
`Authorization: Bearer <token>` (constant-time compare). /health, /ready and
the OpenAPI docs stay open (they reveal no tenant data; /ready without the token
says ready or not per component, no details such as engine URLs). A token is mandatory
when the bind host is not loopback (ServiceSettings refuses otherwise, and
create_app checks again).
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from api.body_limit import BodySizeLimit
from api.controller_client import ControllerClient
from api.errors import Unauthorized, install_error_handlers
from api.metrics import render_prometheus
from api.ui import mount_ui
from api.models import (
    ERROR_RESPONSES,
    AbortOut,
    AdapterCreate,
    AdapterList,
    AdapterOut,
    FleetOut,
    HealthOut,
    MetricsOut,
    ProcessOut,
    ReadyOut,
    StepOut,
)
from service.config import ServiceSettings, api_token_problem
from service.controller import Controller
from service.fleet_stats import FleetStats
from service.registry import AdapterState

if TYPE_CHECKING:  # the Tinker modules (and torch) load only when the Tinker API is served
    from api.tinker.service import TinkerService

log = logging.getLogger(__name__)


def create_app(controller_obj: Controller, settings: ServiceSettings, fleet_stats: FleetStats | None = None) -> FastAPI:
    token = settings.api_token.get_secret_value().strip() if settings.api_token is not None else ""
    problem = api_token_problem(settings.host, token or None)
    if problem:
        raise ValueError(f"refusing to serve on {settings.host!r} without an API token that can protect it: {problem}")
    controller = ControllerClient(controller_obj, settings.controller_timeout_s)

    app = FastAPI(
        title="lorafleet",
        summary="Train many LoRA adapters at once against one frozen base model.",
        version=_version(),
        responses=ERROR_RESPONSES,
    )
    tinker = _tinker_service(controller_obj, settings)
    app.state.on_stop = [tinker.stop] if tinker is not None else []  # api/server.py awaits these on stop
    tinker_paths = {"/api/v1/forward_backward": settings.tinker_max_body_bytes,
                    "/api/v1/forward": settings.tinker_max_body_bytes} if tinker is not None else {}
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, path_limits=tinker_paths)

    def require_token(request: Request) -> None:
        if not token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized("missing bearer token: send the header 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("invalid bearer token")

    def has_token(request: Request) -> bool:
        try:
            require_token(request)
        except Unauthorized:
            return False
        return True

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

    @v1.post("/adapters", status_code=201, response_model=AdapterOut, summary="Register an adapter run (PENDING)")
    async def register(body: AdapterCreate) -> AdapterOut:
        return AdapterOut.from_ref(await controller.register(body.name, body.config))

    @v1.get("/adapters", response_model=AdapterList, summary="List adapters (newest run per name)")
    async def list_adapters(state: AdapterState | None = Query(None, description="Only adapters in this state.")) -> AdapterList:
        refs = await controller.list(state)
        return AdapterList(adapters=[AdapterOut.from_ref(r) for r in refs])

    @v1.get("/adapters/{name}", response_model=AdapterOut, summary="One adapter")
    async def get_adapter(name: str) -> AdapterOut:
        return AdapterOut.from_ref(await controller.get(name))

    @v1.get("/adapters/{name}/metrics", response_model=MetricsOut, summary="Per-step metrics series")
    async def adapter_metrics(name: str) -> MetricsOut:
        run = await controller.metrics(name)
        return MetricsOut(name=run.name, registration_id=run.registration_id, steps=[StepOut.from_record(s) for s in run.steps])

    @v1.delete("/adapters/{name}", status_code=202, response_model=AdapterOut, summary="Retire gracefully (RETIRING, then COMPLETED with export)")
    async def retire(name: str) -> AdapterOut:
        return AdapterOut.from_ref(await controller.retire(name))

    @v1.post("/adapters/{name}/abort", response_model=AbortOut, summary="Abort in-flight generation without retiring")
    async def abort(name: str) -> AbortOut:
        return AbortOut(name=name, aborted=await controller.abort(name))

    @v1.get("/fleet", response_model=FleetOut, summary="The service's processes and their ids (operators)")
    async def fleet() -> FleetOut:
        procs = await controller.processes()
        return FleetOut(processes=[ProcessOut(name=p.name, role=p.role, pid=p.pid, detail=p.detail) for p in procs])

    app.include_router(v1)
    mount_ui(app, require_token, fleet_stats)  # the dashboard (/ui) and GET /v1/fleet/stats, behind the same token

    @app.get("/health", response_model=HealthOut, summary="Process alive")
    async def health() -> HealthOut:
        return HealthOut(**await controller.health())

    @app.get("/ready", response_model=ReadyOut, responses={503: {"model": ReadyOut}}, summary="Trainer and engines up")
    async def ready(request: Request) -> Any:
        body = ReadyOut(**await controller.ready())
        if not has_token(request):
            body = body.public()
        return body if body.ready else JSONResponse(body.model_dump(), status_code=503)

    @app.get("/metrics", dependencies=[Depends(require_token)], response_class=Response, summary="Prometheus metrics")
    async def metrics() -> Response:
        body, content_type = render_prometheus(await controller.snapshot(),
                                               tinker.metrics() if tinker is not None else None)
        return Response(body, media_type=content_type)

    if tinker is not None:  # the Tinker wire protocol under /api/v1, its own key auth (docs/tinker.md)
        from api.tinker.routes import tinker_router

        app.include_router(tinker_router(tinker))

    install_error_handlers(app, settings)
    return app


def _tinker_service(controller: Controller, settings: ServiceSettings) -> "TinkerService | None":
    """The Tinker API's state over the running fleet, when ``settings.tinker_keys_file`` is set."""
    if settings.tinker_keys_file is None:
        return None
    from api.tinker.fleet_backend import fleet_tinker_service

    return fleet_tinker_service(controller, settings)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorafleet")
    except PackageNotFoundError:
        return "0+unknown"
