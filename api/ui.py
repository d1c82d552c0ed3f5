"""The web dashboard: `mount_ui(app, require_token, fleet_stats)`.

Serves, on the REST API's own app:

    GET /ui                  the page (api/static/index.html)
    GET /ui/static/...       its script, style sheet and the vendored charting library (uPlot)
    GET /v1/fleet/stats      fleet-wide statistics (service.loop.fleet_stats.FleetStats.snapshot)

The page and its static files are open: they hold no tenant data, and a browser
cannot send a bearer header when it navigates. Every piece of data the page shows
comes from /v1 routes behind the same token check as the rest of the REST API
(`require_token`, the app's own dependency): the page asks for the token once,
keeps it in the tab's sessionStorage, also takes it from `#token=...` in the URL
(for scripted use; the fragment never reaches the server), and sends
`Authorization: Bearer <token>` with every request.

No network at run time: the charting library is a file of the package
(api/static/vendor, with its licence).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from api.models import FleetStatsOut
from api.public_paths import PUBLIC_HEADER
from api.front.read_cache import ReadCache
from service.loop.fleet_stats import FleetStats

STATIC_DIR = Path(__file__).resolve().parent / "static"
UI_PATH = "/ui"


def mount_ui(app: FastAPI, require_token: Callable[..., Any], fleet_stats: FleetStats | None = None,
             reads: ReadCache | None = None) -> None:
    """Add the dashboard page and the fleet statistics route to `app`. `fleet_stats` is the
    recorder the training loop feeds; None (an API without a loop) serves empty statistics.
    `reads`: the app's read cache (every dashboard polling at once gets one answer)."""
    stats = fleet_stats if fleet_stats is not None else FleetStats()
    cache = reads if reads is not None else ReadCache(0.0)
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

    @router.get("/fleet/stats", response_model=FleetStatsOut, summary="Fleet-wide training statistics (dashboard)")
    async def fleet_stats_route() -> Response:
        async def build() -> bytes:
            return FleetStatsOut(**stats.snapshot()).model_dump_json().encode()

        # numbers only, no path in it: public as built (api/public_paths.py)
        return Response(await cache.get(("fleet_stats",), build), media_type="application/json",
                        headers={PUBLIC_HEADER.decode(): "1"})

    app.include_router(router)

    @app.get(UI_PATH, include_in_schema=False)
    async def ui_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount(f"{UI_PATH}/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
