"""Tinker models in sight (api/tinker/model_views.py, model_routes.py): GET /v1/tinker/models and
/v1/tinker/models/{id} with the REST API's own auth (the admin token, two tenants' keys) beside the
Tinker routes on loopback, over an in-process trainer with TWO slots (tiny world, fp32 CPU), the
official SDK training; and the /metrics series and /v1/fleet part built from the same rows.

* Two of alice's models hold the slots; bob's creation waits: the list shows alice's resident in
  their slots and bob's queued, first in the queue, with the reason its future answers.
* Who sees what: the admin all three (and a tenant's with `owner`), each tenant its own; another
  tenant's model id is 404; paging by cursor walks every model once in creation order; the
  filters (state, q) and bad values (an unknown state, a foreign cursor) answer as the runs' list.
* What a model did, against what the test sent and the SDK answered: its steps, the tokens of its
  forward_backward calls (counted from the datums sent), its last loss (the SDK's last loss:sum)
  and its curve (the SDK's loss:sum of each step's call, step by step).
* Once alice's first model has taken its turn (4 steps), bob's model takes its slot: the list shows
  it resident and alice's model evicted with its state in host memory; bob's model waited one
  slot grant (nobody was ahead of it).
* /metrics: the models by state; with metrics_adapter_series "all" every model's series, with "top"
  and top_k 1 only the one updated last; /v1/fleet counts the models and the slots they hold.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.test_tinker_sdk import BASE, MAX_SEQ, sft_data, training_client
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-views-key-1", "bob": "tml-bob-views-key-22"}
TOKEN = "views-admin-token-9c1"
TURN = 4  # tests/tinker_in_process.py TinkerHost's turn_steps: a resident leaves its slot for a waiter after 4 steps


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from fastapi import APIRouter, Depends

    from api.errors import install_error_handlers
    from api.front.read_cache import ReadCache
    from api.rest_auth import RestAuth
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from api.tinker.model_routes import add_model_routes
    from service.config.settings import ServiceSettings
    from tests.tinker_in_process import in_process_service, tinker_app

    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), tmp_path_factory.mktemp("ckpt"), num_slots=2, max_rank=8,
                             base_model=BASE, window_s=0.0, micro_batch_tokens=256, max_seq_len=MAX_SEQ)
    app = tinker_app(svc)  # the Tinker routes, and the REST routes of the models as api/app.py mounts them
    auth = RestAuth(TOKEN, TenantKeys(KEYS))
    who = Depends(auth.caller)
    v1 = APIRouter(prefix="/v1", dependencies=[who])
    add_model_routes(v1, svc, who, ReadCache(0.0))
    app.include_router(v1)
    install_error_handlers(app, ServiceSettings(state_dir=tmp_path_factory.mktemp("state")))
    with ApiServer(app) as server:
        yield svc, server.url


def rest(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def listed(url: str, key: str, **params) -> dict:
    with rest(url, key) as http:
        r = http.get("/v1/tinker/models", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def by_id(url: str, key: str = TOKEN, **params) -> dict[str, dict]:
    return {m["model_id"]: m for m in listed(url, key, **params)["models"]}


def test_models_listed_with_their_state_owner_and_what_they_did(world, tiny_world):
    from tinker import types

    from api.tinker.model_routes import fleet_view, tinker_scrape
    from api.tinker.metrics import add_model_series
    from prometheus_client import CollectorRegistry, generate_latest

    svc, url = world
    alice = open_client(url, KEYS["alice"])
    a1, a2 = training_client(alice, seed=1), training_client(alice, seed=2)
    pool = ThreadPoolExecutor(1)
    creating = pool.submit(training_client, open_client(url, KEYS["bob"]), 3)  # both slots held: it waits
    try:
        wait_until(lambda: len(by_id(url)) == 3 and any(m["queue_position"] for m in by_id(url).values()),
                   "bob's model listed, waiting for a slot", timeout_s=120, interval_s=0.1)
        rows = by_id(url)
        (b1,) = set(rows) - {a1.model_id, a2.model_id}
        assert {(m["owner"], m["residency"], m["slot"]) for k, m in rows.items() if k != b1} == {("alice", "resident", 0),
                                                                                                 ("alice", "resident", 1)}
        assert (rows[b1]["owner"], rows[b1]["residency"], rows[b1]["slot"], rows[b1]["queue_position"]) == ("bob", "queued", None, 1)
        assert "waiting for a trainer slot" in rows[b1]["waiting_reason"]

        # who sees what
        assert set(by_id(url, KEYS["alice"])) == {a1.model_id, a2.model_id} and set(by_id(url, KEYS["bob"])) == {b1}
        assert set(by_id(url, owner="bob")) == {b1} and set(by_id(url, KEYS["bob"], owner="alice")) == set()
        with rest(url, KEYS["bob"]) as http:
            assert http.get(f"/v1/tinker/models/{a1.model_id}").status_code == 404
            assert http.get(f"/v1/tinker/models/{b1}").json()["model_id"] == b1
        with rest(url, "tml-nobody-key-000000") as http:
            assert http.get("/v1/tinker/models").status_code == 401
        # pages, filters, refusals
        walked, cursor = [], None
        while True:
            page = listed(url, TOKEN, limit=1, **({"cursor": cursor} if cursor else {}))
            assert page["total"] == 3 and len(page["models"]) == 1
            walked.append(page["models"][0]["model_id"])
            if (cursor := page["next_cursor"]) is None:
                break
        assert walked == [a1.model_id, a2.model_id, b1]
        assert set(by_id(url, state="queued")) == {b1} and set(by_id(url, q=a2.model_id[-8:].upper())) == {a2.model_id}
        with rest(url, TOKEN) as http:
            for params, field in (({"state": "sleeping"}, "state"), ({"cursor": "r12"}, "cursor"), ({"cursor": "m1", "offset": 2}, "cursor")):
                r = http.get("/v1/tinker/models", params=params)
                assert r.status_code == 400 and r.json()["field"] == field, r.text

        # a1 trains its turn; what the list says it did is what was sent and answered
        data = sft_data(a1.get_tokenizer(), tiny_world, 0, 3)
        tokens_per_call = sum(len(d.model_input.to_ints()) for d in data)
        losses = []
        for _ in range(TURN):
            fb = a1.forward_backward(data, "cross_entropy")
            opt = a1.optim_step(types.AdamParams(learning_rate=1e-3))
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        b = creating.result(timeout=120)  # a1's turn is over: bob's model takes its slot
    finally:
        if not creating.done():  # the test failed before a1's turn ended: a slot for bob's creation, so it ends
            svc.unload(a1.model_id)
        pool.shutdown()
    assert b.model_id == b1
    rows = wait_until(lambda: (r := by_id(url))[a1.model_id]["residency"] == "evicted" and r, "a1 evicted", interval_s=0.1)
    m = rows[a1.model_id]
    assert (m["step"], m["forward_backward_calls"], m["tokens_trained"]) == (TURN, TURN, TURN * tokens_per_call)
    assert m["last_loss"] == losses[-1] and m["loss_curve"] == [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]
    assert (m["where"], m["slot"], m["queue_position"], m["admissions"]) == ("host", None, None, 1)
    assert (rows[b1]["residency"], rows[b1]["slot"], rows[b1]["waited_grants"]) == ("resident", 0, 1)
    assert rows[a2.model_id]["step"] == 0 and rows[a2.model_id]["loss_curve"] == [] and rows[a2.model_id]["last_loss"] is None

    # /metrics and /v1/fleet, from the same rows
    def scrape(series: str, top_k: int) -> str:
        s = tinker_scrape(svc, series, top_k)
        reg = CollectorRegistry(auto_describe=False)
        add_model_series(reg, s.residency, s.models)
        return generate_latest(reg).decode()

    every = scrape("all", 20)
    for state, n in (("resident", 2), ("queued", 0), ("evicted", 1)):
        assert f'lorafleet_tinker_models_residency{{residency="{state}"}} {n}.0' in every, every
    assert f'lorafleet_tinker_model_step{{model="{a1.model_id}",tenant="alice"}} {TURN}.0' in every
    assert f'lorafleet_tinker_model_tokens_trained{{model="{a1.model_id}",tenant="alice"}} {TURN * tokens_per_call}.0' in every
    assert f'lorafleet_tinker_model_state{{model="{b1}",state="resident",tenant="bob"}} 1.0' in every
    assert f'lorafleet_tinker_model_slot{{model="{b1}",tenant="bob"}} 0.0' in every
    assert "lorafleet_tinker_model_series 3.0" in every
    top = scrape("top", 1)
    assert "lorafleet_tinker_model_series 1.0" in top and top.count("lorafleet_tinker_model_step{") == 1
    assert "lorafleet_tinker_model_series 0.0" in scrape("none", 20)
    fleet = fleet_view(svc)
    assert (fleet.models, fleet.residency, fleet.waiting_for_slot) == (3, {"resident": 2, "queued": 0, "evicted": 1}, 0)
    assert [(s.slot, s.model_id, s.owner) for s in fleet.slots] == [(0, b1, "bob"), (1, a2.model_id, "alice")]
    for model_id in (a1.model_id, a2.model_id, b1):
        svc.unload(model_id)
    assert listed(url, TOKEN)["total"] == 0
