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
