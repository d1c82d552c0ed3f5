"""Tinker API keys -> tenants: the keys live in api/tenant_keys.py (one home for both the
Tinker routes and the REST API); re-exported here for the Tinker modules."""

from api.tenant_keys import KEY_PREFIX, TENANT_RE, TenantKeys, presented_key

__all__ = ["KEY_PREFIX", "TENANT_RE", "TenantKeys", "presented_key"]
