"""The control plane at a thousand runs (issue 26), over the real app on loopback (uvicorn), a real
controller and SQLite registry, two tenant keys with quotas and the admin token. No runtime: the
runs stay where registration put them (4 slots held, the rest queued), which is what the list and
/metrics read.

  * GET /v1/adapters pages (limit; offset or cursor) concatenate to the whole list, once each, in
    order; filters (state, owner, q) and a tenant's own view; bad paging gets 400/422 with what is
    allowed;
  * quotas: a tenant past its live or queued runs gets 429 with the quota and its usage, and the
    registry is unchanged; the other tenant is not limited by it;
  * /metrics carries per-adapter series for at most metrics_top_k adapters, and its size and a
    page's are bounded (their latency under read bursts: benchmarks/bench_scale_cpu.py).
"""

from __future__ import annotations

import httpx
import pytest

from api.tenant_keys import TenantKeys
from service.config.job import SlotCapacity
from tests.integration.api_world import TOKEN, make_world, serve

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-0123456789", "bob": "tml-bob-0123456789"}
RUNS = 1024
TOP_K = 10
QUOTAS = {"tenants": {"carol": {"max_live_runs": 3, "max_queued_runs": 2}}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from service.control.controller import Controller

    tmp = tmp_path_factory.mktemp("pages")
    keys = {**KEYS, "carol": "tml-carol-0123456789"}
    w = make_world(tmp, quotas=QUOTAS, metrics_top_k=TOP_K)
    controller = Controller(w.settings, SlotCapacity(num_slots=4, max_rank=16))
    tenant_keys = TenantKeys(keys)
    cfg = w.rl_config(num_step=2)
    for i in range(RUNS):  # straight through the controller (the same checks as POST), to build the world fast
        controller.register(f"run{i:04d}", cfg, tenant=("alice", "bob")[i % 2] if i % 4 else None)
    try:
        with serve(controller, w.settings, tenant_keys=tenant_keys) as server:
            yield w, controller, server, keys
    finally:
        controller.close()


def http(server, key: str = TOKEN) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60.0,
                        limits=httpx.Limits(max_connections=200))


def _all_pages(c: httpx.Client, **params) -> tuple[list[str], set[int]]:
    names, totals, cursor = [], set(), None
    while True:
        r = c.get("/v1/adapters", params={**params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        names += [a["name"] for a in body["adapters"]]
        totals.add(body["total"])
        cursor = body["next_cursor"]
        if cursor is None:
            return names, totals


def test_pages_cover_the_list_once_in_order(world):
    _, controller, server, keys = world
    every = [r.name for r in controller.registry.list()]
    with http(server) as c:
        names, totals = _all_pages(c, limit=100)
        assert names == every and totals == {RUNS}
        body = c.get("/v1/adapters").json()
        assert len(body["adapters"]) == 100 and body["total"] == RUNS  # the default page
        assert {a["config"]["data"]["path"] for a in body["adapters"]} == {"rl.jsonl"}  # no server path (public_paths.py)
        r = c.get("/v1/adapters", params={"limit": 5, "offset": 1000}).json()
        assert [a["name"] for a in r["adapters"]] == every[1000:1005]
        assert _all_pages(c, limit=250, q="RUN10")[0] == [n for n in every if "run10" in n]
        assert _all_pages(c, limit=250, owner="alice")[0] == [r.name for r in controller.registry.list(tenant="alice")]
        assert _all_pages(c, limit=250, owner="")[0] == every[::4]  # the admin's own runs
        queued = _all_pages(c, limit=1000, state="PENDING")[0]
        assert queued == every  # none trained: all PENDING (4 in slots, the rest queued)
    with http(server, keys["bob"]) as c:
        names, _ = _all_pages(c, limit=77)
        assert names == [r.name for r in controller.registry.list(tenant="bob")] and len(names) == 512
        r = c.get("/v1/adapters", params={"owner": "alice"})
        assert r.status_code == 400 and "owner filters the admin's list only" in r.json()["detail"]


@pytest.mark.parametrize("params, status, detail", [
    ({"limit": 0}, 422, "greater than or equal to 1"),
    ({"limit": 1001}, 422, "less than or equal to 1000"),
    ({"cursor": "r5", "offset": 3}, 400, "give a cursor or an offset, not both"),
    ({"cursor": "page-2"}, 400, "cursor 'page-2' is not one this service gave out"),
    ({"state": "SLEEPING"}, 422, "PENDING"),
])
def test_bad_paging_is_refused_with_what_is_allowed(world, params, status, detail):
    _, _, server, _ = world
    with http(server) as c:
        r = c.get("/v1/adapters", params=params)
        assert r.status_code == status and detail in r.text, r.text


def test_a_registration_past_a_quota_gets_429_with_the_quota_and_the_usage(world):
    w, controller, server, keys = world
    cfg = w.rl_config(num_step=2)
    before = controller.registry.live_states()
    with http(server, keys["carol"]) as c:
        # every slot is held: each of carol's runs waits; 2 may wait (max_queued_runs)
        for i in range(2):
            assert c.post("/v1/adapters", json={"name": f"carol{i}", "config": cfg}).status_code == 201
        r = c.post("/v1/adapters", json={"name": "carol2", "config": cfg})
        assert r.status_code == 429 and r.json()["error"] == "quota_exceeded", r.text
        assert ("tenant 'carol' has 2 live run(s), 2 of them waiting for a slot; its max_queued_runs is 2 "
                "(quotas.tenants.carol)") in r.json()["detail"]
        assert c.get("/v1/adapters").json()["total"] == 2  # nothing recorded
    with http(server, keys["alice"]) as c:  # the default quota bounds nothing per key
        assert c.post("/v1/adapters", json={"name": "alice-more", "config": cfg}).status_code == 201
    assert len(controller.registry.live_states()) == len(before) + 3


def test_metrics_carry_series_for_the_top_k_adapters_only(world):
    _, _, server, _ = world
    with http(server) as c:
        text = c.get("/metrics").text
    series = {line.split('adapter="')[1].split('"')[0] for line in text.splitlines() if line.startswith("lorafleet_adapter_step{")}
    assert len(series) == TOP_K
    assert 'lorafleet_adapters{state="PENDING"}' in text and 'lorafleet_adapters_residency{residency="queued"}' in text
    assert f"lorafleet_adapter_series {float(TOP_K)}" in text


def test_read_sizes_are_bounded_by_the_page_and_the_cardinality_setting(world):
    """With 1,024 runs registered: a page of 100 and /metrics stay small, whatever is registered
    (their latency under bursts of 100 concurrent reads is measured by benchmarks/bench_scale_cpu.py:
    timings go to benchmarks)."""
    _, _, server, _ = world
    with http(server) as c:
        page = c.get("/v1/adapters", params={"limit": 100})
        metrics = c.get("/metrics")
        whole = sum(len(c.get("/v1/adapters", params={"limit": 1000, "offset": o}).content) for o in (0, 1000))
    assert page.status_code == metrics.status_code == 200
    assert len(page.content) < whole / 8 and len(metrics.content) < 20_000, (len(page.content), whole, len(metrics.content))
