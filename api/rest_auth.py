"""Who a REST request is: `RestAuth.caller(request)` -> `Caller` (issue 14, F5).

Two kinds of caller, one identity per tenant across both faces of the service:

  * the admin: the API token (`api_token`, LORAFLEET_API_TOKEN) as a bearer token. Sees and
    manages every run, and alone reads the operator routes (/v1/fleet, /metrics, /ready's
    details);
  * a tenant: a key of the keys file (`tinker_keys_file`, api/tenant_keys.py), sent as a bearer
    token or as X-API-Key, the same key the Tinker routes take. Sees and manages only the
    runs it registered (service/registry/registry.py I8); an operator route is 403.

Which credentials are needed:

    api_token  keys file   no credential      the API token   a tenant key   anything else
    unset      unset       admin (open)       -               -              ignored: admin
    set        unset       401                admin           -              401
    set        set         401                admin           that tenant    401
    unset      set         401                -               that tenant    401

Without a keys file the service behaves as before (one token = admin, or open on loopback).
With a keys file and no API token there is no admin on the REST API: an anonymous request
would otherwise see every tenant's runs. Tokens and keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from api.errors import Forbidden, Unauthorized
from api.tenant_keys import TenantKeys, presented_key


@dataclass(frozen=True)
class Caller:
    """The identity of one request: a tenant's name, or None for the admin."""

    tenant: str | None

    @property
    def admin(self) -> bool:
        return self.tenant is None


ADMIN = Caller(None)


class RestAuth:
    def __init__(self, token: str, keys: TenantKeys | None) -> None:
        if token and keys is not None and keys.tenant_of(token) is not None:
            raise ValueError(f"the API token is also the key of tenant {keys.tenant_of(token)!r} in the keys file; "
                             "the admin token and the tenant keys must differ")
        self._token = token
        self._keys = keys

    @property
    def open(self) -> bool:
        """No credential needed (no token, no keys file): every request is the admin."""
        return not self._token and self._keys is None

    async def caller(self, request: Request) -> Caller:
        """The request's caller (the routes' dependency); Unauthorized (401) when its credential is
        missing or unknown. A coroutine so that FastAPI runs it in the event loop: a plain function
        dependency goes to a worker thread, a thread handoff per request that a burst of 100 reads
        paid 100 times (issue 26: py-spy showed it as a sixth of the API thread's time)."""
        return self.identify(request)

    def identify(self, request: Request) -> Caller:
        """`caller` as a plain function (microseconds: header parsing and constant-time compares)."""
        if self.open:
            return ADMIN
        auth = request.headers.get("authorization", "")
        scheme, _, bearer = auth.partition(" ")
        bearer = bearer.strip() if scheme.lower() == "bearer" else ""
        if self._token and bearer and hmac.compare_digest(bearer.encode(), self._token.encode()):
            return ADMIN
        key = presented_key(request)
        if self._keys is not None and key:
            tenant = self._tenant_of(key)
            if tenant is not None:
                return Caller(tenant)
        what = "the API token" if self._keys is None else (
            "the API token or a tenant key of the keys file" if self._token else "a tenant key of the keys file")
        if not key:
            also = "" if self._keys is None else " (a tenant key may also come as X-API-Key)"
            raise Unauthorized(f"missing bearer token: send the header 'Authorization: Bearer <token>' with {what}{also}")
        raise Unauthorized(f"invalid bearer token: it is not {what}")

    def is_admin(self, request: Request) -> bool:
        try:
            return self.identify(request).admin
        except Unauthorized:
            return False

    async def admin_only(self, request: Request) -> None:
        """Dependency of the operator routes: 401 without a valid credential, 403 for a tenant (a
        coroutine: see `caller`)."""
        if not self.identify(request).admin:
            raise Forbidden("this route is for the service's operator (the API token); a tenant key reads its own "
                            "adapters under /v1/adapters and /v1/runs, and the fleet totals at /v1/fleet/stats")

    def _tenant_of(self, key: str) -> str | None:
        # Constant time over the keys (a dict lookup's timing would depend on the secret).
        found = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(key.encode(), known.encode()):
                found = tenant
        return found
