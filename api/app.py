"""The FastAPI control plane: `create_app(controller, settings)` over the in-process Controller.

Routes are thin: authenticate, validate (pydantic), call the controller; its
typed errors map to a status in api/errors.py (the one place), and every error
body is `api.models.ErrorOut`: what was wrong and what is allowed. No JSON body
shows the server's absolute paths (api/public_paths.py).
A refused request changes nothing (the controller checks before it writes and
the registry writes in one transaction).

Auth (api/rest_auth.py): the API token (settings.api_token) is the admin; with a keys file
(settings.tinker_keys_file) each tenant key is that tenant, on these routes as on the Tinker
ones. Every /v1 route and /metrics need a credential unless neither is configured. A tenant
sees and manages only its own runs (the controller filters; another tenant's name or run id is
404 like one that does not exist); /v1/fleet and /metrics are the admin's (403 for a tenant).
/health, /ready and the OpenAPI docs stay open (they reveal no tenant data; /ready without the
admin token says ready or not per component, no details such as engine URLs). A token is
mandatory when the bind host is not loopback (ServiceSettings refuses otherwise, and
create_app checks again).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.body_limit import BodySizeLimit
from api.controller_client import ControllerClient
from api.errors import install_error_handlers
from api.metrics import render_prometheus
from api.public_paths import PUBLIC_HEADER, PublicPaths
from api.front.read_cache import ReadCache
from api.tinker.model_routes import add_model_routes, fleet_view, tinker_scrape
from api.rest_auth import Caller, RestAuth
from api.tenant_keys import TenantKeys
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
    RunList,
    StepOut,
)
from service.config.settings import ServiceSettings, api_token_problem
from service.control.controller import Controller
from service.loop.fleet_stats import FleetStats
from service.registry.registry import AdapterState
from service.registry.views import DEFAULT_PAGE, MAX_PAGE, ListQuery

if TYPE_CHECKING:  # the Tinker modules (and torch) load only when the Tinker API is served
    from api.tinker.service import TinkerService

log = logging.getLogger(__name__)


def create_app(controller_obj: Controller, settings: ServiceSettings, fleet_stats: FleetStats | None = None,
               tenant_keys: TenantKeys | None = None) -> FastAPI:
    """The app over `controller_obj`. `tenant_keys`: the tenants of the REST API; default: the keys
    file `settings.tinker_keys_file` names (which also turns the Tinker API on); given without that
    setting (an API without the fleet), the REST API has tenants and no Tinker routes."""
    token = settings.api_token.get_secret_value().strip() if settings.api_token is not None else ""
    problem = api_token_problem(settings.host, token or None)
    if problem:
        raise ValueError(f"refusing to serve on {settings.host!r} without an API token that can protect it: {problem}")
    controller = ControllerClient(controller_obj, settings.controller_timeout_s)
    reads = ReadCache(settings.read_cache_s, stale_s=settings.read_stale_s)  # list pages, /metrics, fleet stats: one build per burst (api/front/read_cache.py)
    paths = PublicPaths.from_settings(settings)  # a cached JSON answer is made public once, when built

    app = FastAPI(
        title="lorafleet",
        summary="Train many LoRA adapters at once against one frozen base model.",
        version=_version(),
        responses=ERROR_RESPONSES,
    )
    tinker = _tinker_service(controller_obj, settings)
    app.state.on_stop = [tinker.stop] if tinker is not None else []  # api/server.py awaits these on stop
    app.state.tinker_futures = tinker.futures if tinker is not None else None  # api/server.py: the front's feed (F5)
    app.state.on_start = [tinker.start] if tinker is not None else []  # ... and these once it listens (a restart revived)
    tinker_paths = {"/api/v1/forward_backward": settings.tinker_max_body_bytes,
                    "/api/v1/forward": settings.tinker_max_body_bytes} if tinker is not None else {}
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, path_limits=tinker_paths)

    keys = tenant_keys
    if keys is None and settings.tinker_keys_file is not None:
        keys = TenantKeys.from_file(settings.tinker_keys_file)
    auth = RestAuth(token, keys)
    if keys is not None and not token:
        log.warning("tenant keys without an API token: every REST request needs a tenant key, and no one sees all runs")
    who = Depends(auth.caller)

    v1 = APIRouter(prefix="/v1", dependencies=[who])

    @v1.post("/adapters", status_code=201, response_model=AdapterOut, summary="Register an adapter run (PENDING)")
    async def register(body: AdapterCreate, caller: Caller = who) -> AdapterOut:
        try:
            return AdapterOut.from_ref(await controller.register(body.name, body.config, caller.tenant))
        finally:
            reads.clear()  # the caller reads its own write at once

    @v1.get("/adapters", response_model=AdapterList,
            summary="List adapters, a page at a time (newest run per name, oldest first; a tenant: its own)")
    async def list_adapters(state: AdapterState | None = Query(None, description="Only adapters in this state."),
                            owner: str | None = Query(None, description="The admin only: only runs of this tenant (an empty value: the admin's own runs)."),
                            q: str | None = Query(None, max_length=64, description="Only adapters whose name contains this (case-insensitive)."),
                            limit: int = Query(DEFAULT_PAGE, ge=1, le=MAX_PAGE, description="Adapters per page."),
                            offset: int = Query(0, ge=0, description="Skip this many matching adapters (or continue with cursor)."),
                            cursor: str | None = Query(None, description="The next_cursor of the previous page."),
                            caller: Caller = who) -> AdapterList:
        query = ListQuery(state=state, owner=owner, name_contains=q, limit=limit, offset=offset, cursor=cursor)

        async def build() -> bytes:
            page = await controller.list_page(query, caller.tenant)
            return paths.json_bytes(AdapterList(adapters=[AdapterOut.from_ref(r) for r in page.refs], total=page.total,
                                                next_cursor=page.next_cursor).model_dump_json().encode())

        return _json(await reads.get(("adapters", caller.tenant, query), build))

    @v1.get("/adapters/{name}", response_model=AdapterOut, summary="One adapter (its newest run)")
    async def get_adapter(name: str, caller: Caller = who) -> AdapterOut:
        return AdapterOut.from_ref(await controller.get(name, caller.tenant))

    @v1.get("/adapters/{name}/runs", response_model=RunList, summary="Every run of an adapter name, oldest first")
    async def adapter_runs(name: str, caller: Caller = who) -> RunList:
        return RunList(name=name, runs=[AdapterOut.from_ref(r) for r in await controller.runs(name, caller.tenant)])

    @v1.get("/adapters/{name}/metrics", response_model=MetricsOut, summary="Per-step metrics series (newest run)")
    async def adapter_metrics(name: str, caller: Caller = who) -> MetricsOut:
        run = await controller.metrics(name, caller.tenant)
        return MetricsOut(name=run.name, registration_id=run.registration_id, steps=[StepOut.from_record(s) for s in run.steps])

    @v1.delete("/adapters/{name}", status_code=202, response_model=AdapterOut, summary="Retire gracefully (RETIRING, then COMPLETED with export)")
    async def retire(name: str, caller: Caller = who) -> AdapterOut:
        try:
            return AdapterOut.from_ref(await controller.retire(name, caller.tenant))
        finally:
            reads.clear()

    @v1.post("/adapters/{name}/abort", response_model=AbortOut, summary="Abort in-flight generation without retiring")
    async def abort(name: str, caller: Caller = who) -> AbortOut:
        return AbortOut(name=name, aborted=await controller.abort(name, caller.tenant))

    @v1.get("/runs/{registration_id}", response_model=AdapterOut, summary="One run by its registration id (any state)")
    async def get_run(registration_id: str, caller: Caller = who) -> AdapterOut:
        return AdapterOut.from_ref(await controller.get_run(registration_id, caller.tenant))

    @v1.get("/runs/{registration_id}/metrics", response_model=MetricsOut, summary="Per-step metrics series of one run")
    async def run_metrics(registration_id: str, caller: Caller = who) -> MetricsOut:
        run = await controller.run_metrics(registration_id, caller.tenant)
        return MetricsOut(name=run.name, registration_id=run.registration_id, steps=[StepOut.from_record(s) for s in run.steps])

    @v1.get("/fleet", response_model=FleetOut, dependencies=[Depends(auth.admin_only)],
            summary="The service's processes and their ids, and the Tinker models' slots (operators; the admin token)")
    async def fleet() -> FleetOut:
        procs = await controller.processes()
        return FleetOut(processes=[ProcessOut(name=p.name, role=p.role, pid=p.pid, detail=p.detail, node_id=p.node_id,
                                              node_ip=p.node_ip) for p in procs],
                        tinker=fleet_view(tinker) if tinker is not None else None)

    add_model_routes(v1, tinker, who, reads)  # GET /v1/tinker/models[/{id}] (api/tinker/model_routes.py)

    app.include_router(v1)
    mount_ui(app, auth.caller, fleet_stats, reads)  # the dashboard (/ui) and GET /v1/fleet/stats (no names): any caller

    @app.get("/health", response_model=HealthOut, summary="Process alive")
    async def health() -> HealthOut:
        return HealthOut(**await controller.health())

    @app.get("/ready", response_model=ReadyOut, responses={503: {"model": ReadyOut}}, summary="Trainer and engines up")
    async def ready(request: Request) -> Any:
        body = ReadyOut(**await controller.ready())
        if not auth.is_admin(request):
            body = body.public()
        return body if body.ready else JSONResponse(body.model_dump(), status_code=503)

    @app.get("/metrics", dependencies=[Depends(auth.admin_only)], response_class=Response,
             summary="Prometheus metrics (operators; the admin token)")
    async def metrics() -> Response:
        async def build() -> bytes:
            scrape = tinker_scrape(tinker, settings.metrics_adapter_series, settings.metrics_top_k) if tinker is not None else None
            body, _ = render_prometheus(await controller.snapshot(), scrape)
            return body

        return Response(await reads.get(("metrics",), build), media_type=CONTENT_TYPE_LATEST)

    if tinker is not None:  # the Tinker wire protocol under /api/v1, its own key auth (docs/tinker.md)
        from api.tinker.routes import tinker_router

        app.include_router(tinker_router(tinker))

    install_error_handlers(app, settings)
    return app


def _json(body: bytes) -> Response:
    """An answer built (validated, its paths made public) once as JSON bytes (ReadCache), sent as it is."""
    return Response(body, media_type="application/json", headers={PUBLIC_HEADER.decode(): "1"})


def _tinker_service(controller: Controller, settings: ServiceSettings) -> "TinkerService | None":
    """The Tinker API's state over the running fleet, when ``settings.tinker_keys_file`` is set."""
    if settings.tinker_keys_file is None:
        return None
    from api.tinker.fleet import fleet_tinker_service

    return fleet_tinker_service(controller, settings)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lorafleet")
    except PackageNotFoundError:
        return "0+unknown"
