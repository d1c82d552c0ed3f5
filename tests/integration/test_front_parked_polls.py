"""A queued Tinker call's repeat polls are held by the API front (F5 in api/front/read_front.py,
api/front/parked_polls.py P1-P4): a real `python -m api.front.read_front` process with the feed of
finished futures, in front of the real Tinker routes (uvicorn on loopback) over a TinkerService with
real SQLite records, started by `start_fronted` as `lorafleet serve` starts it. A future is left
pending (as a call queued for a slot is) and finished from the test on the app's own loop.

  * after the coordinator's first try again, the next polls are answered by the front: they do not
    reach the app, and say what the coordinator said (less the front's own header);
  * when the future finishes, a poll gets its result (the feed woke it or it was passed);
  * another tenant's poll of the id still reaches the app and is refused there (404);
  * a cancel through the front finishes a parked future: the next poll gets the cancel's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.front.read_front import bind_public
from api.server import start_fronted
from api.tinker.auth import TenantKeys
from api.tinker.futures import Outcome
from api.tinker.service import TinkerService
from tests.tinker_in_process import tinker_app
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-parked-0123456", "bob": "tml-bob-parked-01234567"}
HOLD_S = 1.0  # the coordinator's hold, and so the front's: short, so each try again comes quickly


class CountingApp:
    """The app, counting the requests that reach it per path (its state is the app's: start_fronted reads it)."""

    def __init__(self, app) -> None:
        self.app, self.state, self.seen = app, app.state, Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen[scope["path"]] += 1
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from service.registry.tinker_records import TinkerRecords
    from service.tenants.tinker_models import TinkerModels
    from trainer.storage.local_store import LocalStore

    tmp = tmp_path_factory.mktemp("parked")
    models = TinkerModels(None, TinkerRecords(tmp / "records.sqlite"), LocalStore(tmp / "store"), base_model="m",
                          tokenizer_id="m", max_rank=8)
    service = TinkerService(models, TenantKeys(KEYS), poll_s=HOLD_S, session_timeout_s=None)
    app = CountingApp(tinker_app(service))
    sock = bind_public("127.0.0.1", 0)
    fronted = start_fronted(app, sock, 0.0, 0.0, f"http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        wait_until(lambda: _answers(fronted.url), "the front answers", 60, interval_s=0.2)
        loop = fronted.inner._server.servers[0].get_loop()
        yield service, app, fronted.url, loop
    finally:
        fronted.stop()
        models.records.close()


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": "none"}, timeout=5).status_code == 401
    return False


def _on_loop(loop, fn):
    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), loop).result(30)


def _poll(url: str, rid: str, key: str = KEYS["alice"]) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": rid}, headers={"X-API-Key": key}, timeout=45)


def test_repeat_polls_are_held_by_the_front_until_the_future_finishes(world):
    service, app, url, loop = world
    rid = _on_loop(loop, lambda: service.futures.create("alice", "m-parked"))
    first = _poll(url, rid)
    assert first.status_code == 200 and first.json()["type"] == "try_again"
    assert "x-lorafleet-parkable" not in first.headers  # the front's own header stays between it and the app
    reached, tries = app.seen["/api/v1/retrieve_future"], service.futures.try_again
    for _ in range(3):
        again = _poll(url, rid)
        assert again.status_code == 200 and again.json() == first.json()  # the coordinator's answer, from the front
    assert app.seen["/api/v1/retrieve_future"] == reached  # none of the three reached the app
    assert service.futures.try_again == tries  # what /metrics counts (lorafleet_tinker_retrieve_try_again)

    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(_poll, url, rid)
        _on_loop(loop, lambda: service.futures.resolve(rid, Outcome(json={"loss": 0.25})))
        answer = late.result(60)
    assert answer.status_code == 200 and answer.json() == {"loss": 0.25}
    assert _poll(url, rid).json() == {"loss": 0.25}  # and at every later poll
    assert app.seen["/api/v1/retrieve_future"] <= reached + 2  # the result's polls are passed


def test_another_tenants_poll_of_a_parked_id_reaches_the_app_and_is_refused(world):
    service, app, url, loop = world
    rid = _on_loop(loop, lambda: service.futures.create("alice", "m-owned"))
    assert _poll(url, rid).json()["type"] == "try_again"
    reached = app.seen["/api/v1/retrieve_future"]
    refused = _poll(url, rid, KEYS["bob"])
    assert refused.status_code == 404 and "unknown request id" in refused.text
    assert app.seen["/api/v1/retrieve_future"] == reached + 1
    _on_loop(loop, lambda: service.futures.resolve(rid, Outcome(json={})))


def test_a_cancel_finishes_a_parked_future(world):
    service, app, url, loop = world
    rid = _on_loop(loop, lambda: service.futures.create("alice", "m-cancelled"))
    assert _poll(url, rid).json()["type"] == "try_again"
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(_poll, url, rid)
        cancel = httpx.post(f"{url}/api/v1/cancel_future", json={"request_id": rid}, headers={"X-API-Key": KEYS["alice"]}, timeout=30)
        assert cancel.status_code == 200 and cancel.json() == {"cancelled": True}
        answer = parked.result(60)
    assert answer.json()["category"] == "user" and "cancelled by the client" in answer.json()["error"]


def test_a_poll_without_a_length_streams_past_and_is_not_held(world):
    """F3/F5: only a body whose Content-Length is small is read whole by the front; a chunked one (no
    length) streams to the app as any request does, and is answered by it every time."""
    service, app, url, loop = world
    rid = _on_loop(loop, lambda: service.futures.create("alice", "m-chunked"))
    body = f'{{"request_id": "{rid}"}}'.encode()
    for _ in range(2):
        reached = app.seen["/api/v1/retrieve_future"]
        answer = httpx.post(f"{url}/api/v1/retrieve_future", content=iter([body]), timeout=45,
                             headers={"X-API-Key": KEYS["alice"], "Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.json()["type"] == "try_again"
        assert app.seen["/api/v1/retrieve_future"] == reached + 1
    _on_loop(loop, lambda: service.futures.resolve(rid, Outcome(json={})))
