"""A small typed HTTP client of the REST API (httpx), used by the CLI and `smoke`.

Every call has a timeout; a non-2xx answer raises `ApiError` carrying the
status and the server's error body, so callers can show what was wrong and
what is allowed. Connection problems raise `ApiUnreachable`.
"""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        self.status = status
        self.body = body
        self.method = method
        self.path = path
        detail = body.get("detail") if isinstance(body, dict) else body
        code = body.get("error") if isinstance(body, dict) else ""
        super().__init__(f"{method} {path} -> {status} {code}: {detail}".replace("  ", " "))

    @property
    def code(self) -> str:
        return self.body.get("error", "") if isinstance(self.body, dict) else ""


class ApiUnreachable(Exception):
    pass


class LorafleetClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        # `token`: the admin token or a tenant key (docs/concepts.md "Tenants"); both go as a bearer token.
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        # Idle connections dropped after 2 s, before the service's server closes them (uvicorn: 5 s, as
        # httpx's own default): a call after a pause of about 5 s (`adapters watch --interval 5`) could
        # otherwise go out on a connection being closed (rollout/engines/client.py, the same race).
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=2.0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> LorafleetClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as e:
            raise ApiUnreachable(f"{method} {self.base_url}{path} timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ApiUnreachable(f"cannot reach {self.base_url}: {type(e).__name__}: {e}") from None
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code not in ok:
            raise ApiError(response.status_code, body, method, path)
        return body

    # --- the API, one method per route ------------------------------------------------------

    def register(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v1/adapters", ok=(201,), json={"name": name, "config": config})

    def list(self, state: str | None = None, **filters: Any) -> list[dict[str, Any]]:
        """Every adapter (the newest run of each name), page after page; `filters`: owner, q."""
        return self._every_page(self.list_page, "adapters", {**({"state": state} if state else {}), **filters})

    @staticmethod
    def _every_page(page_of: Any, key: str, filters: dict[str, Any]) -> list[dict[str, Any]]:
        """Every row of a paged list (`page_of(**params)` answers `key`, next_cursor), 1000 a page."""
        out: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": 1000, **filters}
        while True:
            page = page_of(**params)
            out += page[key]
            if page["next_cursor"] is None:
                return out
            params["cursor"] = page["next_cursor"]

    def list_page(self, **params: Any) -> dict[str, Any]:
        """One page of GET /v1/adapters (limit, offset or cursor; state, owner, q): adapters, total, next_cursor."""
        return self.request("GET", "/v1/adapters", params=params or None)

    def get(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/adapters/{name}")

    def metrics(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/adapters/{name}/metrics")

    def runs(self, name: str) -> list[dict[str, Any]]:
        """Every run of `name` the caller may see, oldest first (GET /v1/adapters/{name}/runs)."""
        return self.request("GET", f"/v1/adapters/{name}/runs")["runs"]

    def run(self, registration_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/runs/{registration_id}")

    def run_metrics(self, registration_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/runs/{registration_id}/metrics")

    def retire(self, name: str) -> dict[str, Any]:
        return self.request("DELETE", f"/v1/adapters/{name}", ok=(202,))

    def abort(self, name: str) -> int:
        return self.request("POST", f"/v1/adapters/{name}/abort")["aborted"]

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")

    def ready(self) -> dict[str, Any]:
        """The /ready body, whether ready (200) or not (503)."""
        return self.request("GET", "/ready", ok=(200, 503))

    def fleet(self) -> list[dict[str, Any]]:
        """The service's processes: name, role, pid (GET /v1/fleet)."""
        return self.request("GET", "/v1/fleet")["processes"]

    def fleet_view(self) -> dict[str, Any]:
        """GET /v1/fleet whole: the processes and the Tinker models' part (null without the Tinker API)."""
        return self.request("GET", "/v1/fleet")

    def tinker_models(self, **filters: Any) -> list[dict[str, Any]]:
        """Every live Tinker model the caller may see, page after page; `filters`: state, owner, q."""
        return self._every_page(self.tinker_models_page, "models", filters)

    def tinker_models_page(self, **params: Any) -> dict[str, Any]:
        """One page of GET /v1/tinker/models (limit, offset or cursor; state, owner, q): models, total, next_cursor, tinker_api."""
        return self.request("GET", "/v1/tinker/models", params=params or None)

    def tinker_model(self, model_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/tinker/models/{model_id}")
