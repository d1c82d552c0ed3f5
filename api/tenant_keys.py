"""Tenant API keys -> tenants: one identity for both faces of the service.

The keys file is YAML, one ``tenant: key`` per line (setting ``tinker_keys_file``,
environment ``LORAFLEET_TINKER_KEYS_FILE``). Keys must start with ``tml-`` (the SDK
refuses others) and be unique; tenant names follow the adapter-name rule. A key is sent
as ``X-API-Key`` (what the Tinker SDK does) or as a bearer token; the same key is the same
tenant on the Tinker routes (api/tinker/, `authenticate`) and on the REST API
(api/rest_auth.py: its adapter runs, issue 14 F5).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from fastapi import HTTPException, Request

KEY_PREFIX = "tml-"
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TenantKeys:
    """Immutable key -> tenant map (validated once)."""

    def __init__(self, tenant_to_key: dict[str, str]):
        by_key: dict[str, str] = {}
        for tenant, key in tenant_to_key.items():
            if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
                raise ValueError(f"tenant name {tenant!r} invalid: letters, digits, '.', '_', '-', at most 64, first a letter or digit")
            if not isinstance(key, str) or not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
                raise ValueError(f"tenant {tenant!r}: key must be a string starting with {KEY_PREFIX!r} and at least 8 more characters")
            if key in by_key:
                raise ValueError(f"tenants {by_key[key]!r} and {tenant!r} share one key; keys must be unique")
            by_key[key] = tenant
        self._by_key = by_key

    @classmethod
    def from_file(cls, path: str | Path) -> "TenantKeys":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of 'tenant: key' lines")
        return cls(data)

    def tenant_of(self, key: str | None) -> str | None:
        return self._by_key.get(key) if key else None

    def items(self) -> list[tuple[str, str]]:
        """(key, tenant) pairs, for a caller that compares keys in constant time."""
        return list(self._by_key.items())

    def authenticate(self, request: Request) -> str:
        """The tenant of the request's key; 401 when the key is missing or unknown."""
        tenant = self.tenant_of(presented_key(request))
        if tenant is None:
            raise HTTPException(401, "missing or unknown API key: send X-API-Key (or Authorization: Bearer) with a tml- key from the server's keys file")
        return tenant


def presented_key(request: Request) -> str | None:
    """The credential a request presents: its ``X-API-Key``, else its bearer token; None when neither."""
    key = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key or None
