"""Every error the API answers is an `api.models.ErrorOut` with its one status: `install_error_handlers(app, settings)`.

The mapping lives here only:

    bad_value 400 (BadValue) · bad_request 400 (a body that cannot be read) · unauthorized 401
    · forbidden 403 (a tenant key on an operator route, api/rest_auth.py)
    · not_found 404 (NotFound, unknown route) · method_not_allowed 405 · conflict / no_free_slot 409
    · quota_exceeded 429 (QuotaExceeded: a tenant's quota, with its usage)
    · too_large 413 (api.body_limit) · unsupported_media_type 415 · schema 422 · internal 500
    · unavailable 503 (the controller did not answer)

Framework errors (unknown route, wrong method, a body that is not JSON, a wrong
Content-Type) get the same body as the service's own errors, so a client parses
one shape. Bad input is never a 500: numbers that are not finite are schema
errors (the config models refuse them), and a 500 means a bug (logged).

Every JSON body leaves through `api.public_paths.PublicPathsMiddleware`, so no
error detail, FAILED reason or record shows the server's absolute paths.
"""

from __future__ import annotations

import email.message
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.controller_client import ControllerUnavailable
from api.models import ErrorOut
from api.public_paths import PublicPaths, PublicPathsMiddleware
from service.errors import BadValue, Conflict, LorafleetError, NoFreeSlot, NotFound, QuotaExceeded, ServiceStopping

log = logging.getLogger(__name__)

STATUS_OF_ERROR: dict[type[LorafleetError], int] = {BadValue: 400, NotFound: 404, NoFreeSlot: 409, Conflict: 409,
                                                  QuotaExceeded: 429, ServiceStopping: 503}

# Statuses the framework raises itself (routing, body parsing), by ErrorOut code.
CODE_OF_STATUS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large", 415: "unsupported_media_type"}


class Unauthorized(Exception):
    """Missing or wrong bearer token (401)."""


class Forbidden(Exception):
    """A valid credential that may not use this route: a tenant key on an operator route (403)."""


def error_response(status: int, code: str, detail: str, field: str | None = None, headers: dict[str, str] | None = None,
                   **extra: Any) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    body = ErrorOut(error=code, detail=detail, field=field, **extra)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)


def is_json_media_type(content_type: str | None) -> bool:
    """application/json or application/*+json (what FastAPI parses as JSON); no header counts as JSON too."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's)."""
    # Asked per method (included routers nest their routes, so a route list would miss them).
    return sorted(m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in request.app.router.routes))


def install_error_handlers(app: FastAPI, settings: Any) -> None:
    """Register every exception handler and the path redaction on `app` (see the module doc)."""
    app.add_middleware(PublicPathsMiddleware, paths=PublicPaths.from_settings(settings))

    @app.exception_handler(LorafleetError)
    async def _typed(_: Request, e: LorafleetError) -> JSONResponse:
        # Most specific class first (NoFreeSlot before Conflict).
        status = next((STATUS_OF_ERROR[c] for c in type(e).__mro__ if c in STATUS_OF_ERROR), 400)
        return error_response(status, e.code, e.message, e.field)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, e: Unauthorized) -> JSONResponse:
        return error_response(401, "unauthorized", str(e))

    @app.exception_handler(Forbidden)
    async def _forbidden(_: Request, e: Forbidden) -> JSONResponse:
        return error_response(403, "forbidden", str(e))

    @app.exception_handler(ControllerUnavailable)
    async def _unavailable(_: Request, e: ControllerUnavailable) -> JSONResponse:
        return error_response(503, "unavailable", str(e))

    @app.exception_handler(RequestValidationError)
    async def _schema(request: Request, e: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if any(tuple(err.get("loc", ()))[:1] == ("body",) for err in e.errors()) and not is_json_media_type(content_type):
            return error_response(415, "unsupported_media_type",
                                  f"Content-Type {content_type!r} is not accepted here; send the body as JSON with "
                                  "'Content-Type: application/json'")
        errors = []
        lines = []
        for err in e.errors():
            # A body that is not JSON at all is located at its character offset: name the body instead.
            loc = [] if err.get("type") == "json_invalid" else [str(p) for p in err.get("loc", ()) if p != "body"]
            where = ".".join(loc) or "body"
            lines.append(f"{where}: {err.get('msg')}")
            errors.append({"field": where, "message": err.get("msg"), "type": err.get("type")})
        first = errors[0]["field"] if errors else None
        return error_response(422, "schema", "; ".join(lines), first, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Routing and body parsing: unknown route 404, wrong method 405 (with its Allow header),
        # a body FastAPI cannot decode 400.
        code = CODE_OF_STATUS.get(e.status_code, "bad_request" if e.status_code < 500 else "internal")
        detail = str(e.detail)
        headers = dict(e.headers or {})
        if request.url.path.startswith("/api/v1/") and e.detail != HTTPStatus(e.status_code).phrase:
            pass  # a Tinker route's own refusal (api/tinker/routes.py): its detail says what was wrong
        elif e.status_code == 404:
            detail = f"no route {request.method} {request.url.path}; the API lives under /v1 (see /docs)"
        elif e.status_code == 405:
            allowed = allowed_methods(request)
            headers = {"Allow": ", ".join(allowed)}
            detail = f"method {request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        elif e.status_code == 400:
            detail = f"the request body could not be read ({detail}); send UTF-8 JSON"
        return error_response(e.status_code, code, detail, headers=headers or None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s: unhandled %s", request.method, request.url.path, type(e).__name__)
        return error_response(500, "internal", f"internal error ({type(e).__name__}); the service log has the details")
