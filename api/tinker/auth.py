"""Tinker API keys -> tenants.

The keys file is YAML, one ``tenant: key`` per line (setting ``tinker_keys_file``,
environment ``LORAFLEET_TINKER_KEYS_FILE``). Keys must start with ``tml-`` (the SDK
refuses others) and be unique; tenant names follow the adapter-name rule. The SDK
sends the key as ``X-API-Key``; a bearer token is accepted too.
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

    def authenticate(self, request: Request) -> str:
        """The tenant of the request's key; 401 when the key is missing or unknown."""
        key = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        tenant = self.tenant_of(key)
        if tenant is None:
            raise HTTPException(401, "missing or unknown API key: send X-API-Key (or Authorization: Bearer) with a tml- key from the server's keys file")
        return tenant
