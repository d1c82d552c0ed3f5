"""Per-tenant quotas: what one tenant key may hold and how its turns weigh (the `quotas` section of the
service settings: a job file's `service.quotas`, the settings file, or LORAFLEET_QUOTAS as JSON).

  max_live_runs    live runs (resident, queued, evicted) of the key; a registration past it gets 429
  max_queued_runs  of those, runs waiting for a slot; a registration that would wait past it gets 429
  token_share      while tenants wait for a slot, a tenant that trained more than this share of the
                   tokens of the last TOKEN_WINDOW_S seconds is placed after the waiters of tenants
                   within theirs (first come, first served within each group; service/scheduling/scheduler.py)
  priority         the weight of its turns: a resident of the tenant gives its slot up after
                   priority x slots.turn_steps optimizer steps (service/scheduling/residency.py P3)

`default` applies to every tenant key; `tenants` names keys (the tenant names of the keys file) whose
quota differs, field by field (a field an entry leaves out is the default's). The admin (the API token,
a job file's adapters) has no quota. The defaults bound nothing per key, so 1,024 tenants of 2 keys
register up to the service-wide bound (slots.max_live_runs). A refused registration changes nothing:
the check runs in the registry's insert transaction (service/registry/views.py RunQuota).
"""

from __future__ import annotations

from pydantic import Field

from trainer.strict_model import StrictModel

TOKEN_WINDOW_S = 60.0  # the window token shares are measured over (seconds; service/scheduling/token_ledger.py)


class TenantQuota(StrictModel):
    """One tenant key's quota; unset fields are unbounded (priority: 1)."""

    max_live_runs: int | None = Field(None, ge=1, description="Most live adapter runs (resident, queued or evicted) of this tenant key; a registration beyond gets 429 with the quota and the tenant's usage.")
    max_queued_runs: int | None = Field(None, ge=0, description="Most of its live runs waiting for a trainer slot (queued or evicted); a registration that would wait beyond gets 429.")
    token_share: float | None = Field(None, gt=0, le=1, description="While tenants wait for a slot, a tenant that trained more than this share of the fleet's tokens over the last 60 s is placed after the waiters of tenants within theirs.")
    priority: int = Field(1, ge=1, le=64, description="Weight of the tenant's turns: its residents give their slot up after priority x slots.turn_steps optimizer steps while others wait.")


class Quotas(StrictModel):
    """The `quotas` settings section."""

    default: TenantQuota = Field(default_factory=TenantQuota, description="The quota of every tenant key.")
    tenants: dict[str, TenantQuota] = Field(default_factory=dict, description="Quotas of named tenant keys (the keys file's tenant names); fields they leave out are the default's.")

    def of(self, tenant: str | None) -> TenantQuota | None:
        """The quota in force for `tenant` (None: the admin, who has none)."""
        if tenant is None:
            return None
        entry = self.tenants.get(tenant)
        if entry is None:
            return self.default
        return self.default.model_copy(update=entry.model_dump(exclude_unset=True))

    def source(self, tenant: str) -> str:
        """The setting a tenant's quota comes from, for its messages."""
        return f"quotas.tenants.{tenant}" if tenant in self.tenants else "quotas.default"

    def priority(self, tenant: str | None) -> int:
        quota = self.of(tenant)
        return quota.priority if quota is not None else 1

    def token_share(self, tenant: str | None) -> float | None:
        quota = self.of(tenant)
        return quota.token_share if quota is not None else None
