"""The official tinker SDK's ServiceClients that the Tinker tests open, closed after each test.

A ServiceClient keeps a heartbeat thread and an HTTP pool alive until it is closed. Left open,
they outlived their tests, printed "Session heartbeat failed" once the server was gone, and are
among the threads that can run Ray's garbage while Ray shuts down (CI once exited there:
tests/local_ray.py). A module that opens clients through `open_client` imports
`close_sdk_clients` too, so pytest runs it (autouse) around each of its tests.
"""

from __future__ import annotations

import pytest

_open: list = []


def open_client(url: str, api_key: str):
    """A tinker.ServiceClient for `api_key` at `url`, closed when the current test ends."""
    import tinker

    client = tinker.ServiceClient(base_url=url, api_key=api_key)
    _open.append(client)
    return client


@pytest.fixture(autouse=True)
def close_sdk_clients():
    yield
    while _open:
        client = _open.pop()
        try:  # finish the session and stop its heartbeat; a test may have stopped the server already
            client.close("success").result(timeout=30)
        except Exception:  # noqa: BLE001 - the server is gone (the test stopped it): nothing left to finish
            pass


def unload_model(url: str, api_key: str, model_id: str, timeout_s: float = 120.0) -> None:
    """unload_model over raw HTTP (what the SDK sends; SDK 0.38 has no call for it), waiting on its future."""
    import httpx

    from tests.waiting import wait_until

    with httpx.Client(base_url=url + "/api/v1", timeout=60, headers={"X-API-Key": api_key}) as http:
        rid = http.post("unload_model", json={"model_id": model_id}).json()["request_id"]

        def answered() -> dict | None:
            body = http.post("retrieve_future", json={"request_id": rid}).json()
            return None if body.get("type") == "try_again" else body

        body = wait_until(answered, f"unload_model of {model_id} answered", timeout_s=timeout_s, interval_s=0.2)
    assert body == {"type": "unload_model", "model_id": model_id}, body
