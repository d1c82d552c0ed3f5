"""The REST face of the Tinker models (issue 41 item 5), on the /v1 router beside the runs' routes:

    GET /v1/tinker/models              a page of the live models (state, owner, q; limit, offset or cursor)
    GET /v1/tinker/models/{model_id}   one model
and the pieces of GET /v1/fleet and GET /metrics that show them (`fleet_view`, `tinker_scrape`).

Who sees what, as for the runs (api/rest_auth.py): the admin every model (the `owner` filter picks a
tenant's), a tenant key its own models only (another tenant's model id is 404, as one that does not
exist). Without the Tinker API (no keys file) the list is empty and says so (`tinker_api: false`).
A page is built once per burst and cache period (the app's ReadCache, api/front/read_cache.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from api.models import TinkerFleetOut, TinkerModelList, TinkerModelOut, TinkerSlotOut
from api.public_paths import PUBLIC_HEADER
from api.tinker.model_views import ModelQuery, ModelRow, model_rows, page, residency_counts, series_rows
from service.errors import NotFound
from service.registry.views import DEFAULT_PAGE, MAX_PAGE

if TYPE_CHECKING:
    from api.front.read_cache import ReadCache
    from api.tinker.service import TinkerService


def add_model_routes(v1: APIRouter, tinker: TinkerService | None, caller: Callable[..., Awaitable[Any]], reads: ReadCache) -> None:
    """The two routes on `v1` (whose dependency authenticates); `caller`: the app's Depends(auth.caller)."""

    @v1.get("/tinker/models", response_model=TinkerModelList,
            summary="List Tinker models, a page at a time (oldest first; a tenant: its own)")
    async def list_models(state: str | None = Query(None, description="Only models in this state: resident, queued, evicted."),
                          owner: str | None = Query(None, description="The admin only: only models of this tenant."),
                          q: str | None = Query(None, max_length=64, description="Only models whose id contains this (case-insensitive)."),
                          limit: int = Query(DEFAULT_PAGE, ge=1, le=MAX_PAGE, description="Models per page."),
                          offset: int = Query(0, ge=0, description="Skip this many matching models (or continue with cursor)."),
                          cursor: str | None = Query(None, description="The next_cursor of the previous page."),
                          who: Any = caller) -> Response:
        query = ModelQuery(state=state, owner=owner, id_contains=q, limit=limit, offset=offset, cursor=cursor)

        async def build() -> bytes:
            if tinker is None:
                return TinkerModelList(tinker_api=False, models=[], total=0).model_dump_json().encode()
            rows, total, next_cursor = page(model_rows(tinker), query, who.tenant)
            return TinkerModelList(tinker_api=True, models=[TinkerModelOut.from_row(r) for r in rows], total=total,
                                   next_cursor=next_cursor).model_dump_json().encode()

        # ids, numbers and the waiting reason: no server path in it, public as built (api/public_paths.py)
        return Response(await reads.get(("tinker_models", who.tenant, query), build), media_type="application/json",
                        headers={PUBLIC_HEADER.decode(): "1"})

    @v1.get("/tinker/models/{model_id}", response_model=TinkerModelOut, summary="One Tinker model (a tenant: its own)")
    async def one_model(model_id: str, who: Any = caller) -> TinkerModelOut:
        record = tinker.models.get(model_id) if tinker is not None else None
        if record is None or (who.tenant is not None and record.tenant != who.tenant):
            raise NotFound(f"no Tinker model {model_id!r}")
        row = next((r for r in model_rows(tinker) if r.model_id == model_id), None)
        if row is None:  # unloaded meanwhile
            raise NotFound(f"no Tinker model {model_id!r}")
        return TinkerModelOut.from_row(row)


def fleet_view(tinker: TinkerService) -> TinkerFleetOut:
    """/v1/fleet's Tinker part: the models by state and the slots they hold."""
    rows = model_rows(tinker)
    return TinkerFleetOut(models=len(rows), residency=residency_counts(rows),
                          waiting_for_slot=sum(1 for r in rows if r.queue_position is not None), sessions=len(tinker.sessions),
                          slots=[TinkerSlotOut(slot=r.slot, model_id=r.model_id, owner=r.owner)
                                 for r in sorted(rows, key=lambda r: r.slot if r.slot is not None else -1) if r.slot is not None])


@dataclass
class TinkerScrape:
    """What GET /metrics shows of the Tinker API (api/tinker/metrics.py renders it): the service's counters
    and gauges, the models by state, and the models that get series of their own."""

    stats: dict[str, float]
    residency: dict[str, int] = field(default_factory=dict)
    models: list[ModelRow] = field(default_factory=list)


def tinker_scrape(tinker: TinkerService, series: str, top_k: int) -> TinkerScrape:
    rows = model_rows(tinker)
    return TinkerScrape(tinker.metrics(), residency_counts(rows), series_rows(rows, series, top_k))
