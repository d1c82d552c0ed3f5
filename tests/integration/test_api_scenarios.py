"""Scenario tables against the real app served by uvicorn on loopback, over a real
controller and SQLite registry (no runtime attached: adapters stay PENDING, which
is what tenant-facing checks need). Each row = one HTTP call, the expected
status, and a substring of the error detail (or expected fields of the body)."""

from __future__ import annotations

import json

import pytest

from tests.integration.api_world import MAX_BODY, TOKEN, client, make_world, served_world

pytestmark = pytest.mark.integration

OK = None


def rows_register_conflicts(w):
    cfg = w.rl_config()
    return [
        ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 201, {"name": "a", "state": "PENDING", "slot": 0}),
        ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 409, "adapter name 'a' is in use by a live run (state PENDING)"),
        ("POST", "/v1/adapters", {"name": "b", "config": cfg}, 201, {"state": "PENDING", "slot": 1}),
        ("POST", "/v1/adapters", {"name": "c", "config": cfg}, 201, {"state": "PENDING", "slot": None, "queue_position": 1, "residency": "queued"}),
        ("POST", "/v1/adapters", {"name": "d", "config": cfg}, 409, "too many live adapters: 3 registered runs are live and max_live_runs is 3"),
        ("GET", "/v1/adapters/c", None, 200, {"slot": None, "queue_position": 1}),
        ("GET", "/v1/adapters/a", None, 200, {"slot": 0, "queue_position": None, "residency": "resident"}),
        ("GET", "/v1/adapters", None, 200, {"names": ["a", "b", "c"]}),
        ("GET", "/v1/adapters?state=PENDING", None, 200, {"names": ["a", "b", "c"]}),
        ("GET", "/v1/adapters?state=ACTIVE", None, 200, {"names": []}),
        ("GET", "/v1/adapters?state=BUSY", None, 422, "query.state: Input should be 'PENDING'"),
        ("GET", "/v1/adapters/a", None, 200, {"state": "PENDING", "step": 0, "total_steps": 3, "export_path": None}),
        ("GET", "/v1/adapters/a/metrics", None, 200, {"steps": []}),
    ]


def rows_bad_values(w):
    return [
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rank=32)}, 400, "rank 32 is above the service's max rank 16; allowed: 1..16"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(str(w.root / "nope.jsonl"))}, 400, "does not exist"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config("../outside/secret.jsonl")}, 400, "'..' is not allowed in paths"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(str(w.root / ".." / "outside" / "secret.jsonl"))}, 400, "'..' is not allowed"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(str(w.outside / "secret.jsonl"))}, 400, "is outside the allowed roots; allowed: "),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config("escape.jsonl")}, 400, "leads outside the allowed roots through a symlink"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(reward={"name": "os:system"})}, 400, "not under an allowed reward import root"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rollout={"name": "os:system"})}, 400,
         "config.rollout.name: custom rollout module 'os' is not under an allowed rollout import root; allowed: none configured "
         "(set LORAFLEET_ROLLOUT_IMPORT_ROOTS)"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rollout={"name": "multi_turn"})}, 400,
         "config.rollout.name: unknown built-in rollout 'multi_turn'; built-ins: ['single_turn']"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rollout={"name": "single_turn", "max_tokens": 1})}, 422,
         "config.rollout.max_tokens: Input should be greater than or equal to 2"),
        ("POST", "/v1/adapters", {"name": "a", "config": {"objective": "sft", "data": {"path": str(w.root / "rl.jsonl")},
                                                          "rollout": {"name": "single_turn"}}}, 422, "rollout applies only to objective 'rl'"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rank="big")}, 422, "config.rank: Input should be a valid integer"),
        ("POST", "/v1/adapters", {"name": "a"}, 422, "config: Field required"),
        ("POST", "/v1/adapters", {"name": "a::1", "config": w.rl_config()}, 422, "name: String should match pattern"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(rnak=4)}, 422, "config.rnak: Extra inputs are not permitted"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config(num_step=2, num_epoch=1)}, 422, "at most one of num_step and num_epoch"),
        ("POST", "/v1/adapters", "not json", 422, "JSON decode error"),
        ("GET", "/v1/adapters", None, 200, {"names": []}),  # every refusal above changed nothing
    ]


def rows_lifecycle(w):
    cfg = w.rl_config()
    return [
        ("GET", "/v1/adapters/zz", None, 404, "no adapter named 'zz'"),
        ("GET", "/v1/adapters/zz/metrics", None, 404, "no adapter named 'zz'"),
        ("DELETE", "/v1/adapters/zz", None, 404, "no adapter named 'zz'"),
        ("POST", "/v1/adapters/zz/abort", None, 404, "no adapter named 'zz'"),
        ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 201, {"state": "PENDING"}),
        ("POST", "/v1/adapters/a/abort", None, 200, {"name": "a", "aborted": 0}),
        ("DELETE", "/v1/adapters/a", None, 202, {"state": "RETIRING", "slot": 0}),
        ("DELETE", "/v1/adapters/a", None, 409, "adapter 'a' is already retiring (state RETIRING)"),
        ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 409, "adapter 'a' is still retiring (state RETIRING); retry the registration once it is COMPLETED"),
        ("GET", "/v1/adapters/a", None, 200, {"state": "RETIRING"}),
    ]


def rows_auth(w):
    cfg = w.rl_config()
    return [
        ("GET", "/v1/adapters", None, 401, "missing bearer token: send the header 'Authorization: Bearer <token>'", None),
        ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 401, "missing bearer token", None),
        ("GET", "/v1/adapters", None, 401, "invalid bearer token", "wrong"),
        ("GET", "/v1/adapters", None, 401, "invalid bearer token", TOKEN + "x"),
        ("GET", "/metrics", None, 401, "missing bearer token", None),
        ("DELETE", "/v1/adapters/a", None, 401, "missing bearer token", None),
        ("GET", "/health", None, 200, {"status": "ok"}, None),
        ("GET", "/ready", None, 503, {"ready": False}, None),
        ("GET", "/openapi.json", None, 200, {}, None),
        ("GET", "/v1/adapters", None, 200, {"names": []}, TOKEN),
    ]


def rows_not_finite_and_framework_errors(w):
    """Issue 14 F3, F7: Infinity/NaN (Python's json reads them) are schema errors, never a 500;
    unknown routes, wrong methods and unreadable bodies answer ErrorOut like every other error."""
    cfg = json.dumps(w.rl_config())[:-1]  # the config object, still open: fields are appended below

    def body(extra: str) -> str:
        return '{"name": "a", "config": ' + cfg + ", " + extra + "}}"

    return [
        ("POST", "/v1/adapters", body('"alpha": Infinity'), 422, "config.alpha: Input should be a finite number"),
        ("POST", "/v1/adapters", body('"weight_decay": Infinity'), 422, "config.weight_decay: Input should be a finite number"),
        ("POST", "/v1/adapters", body('"learning_rate": NaN'), 422, "config.learning_rate: Input should be a finite number"),
        ("POST", "/v1/adapters", body('"sampling": {"temperature": -Infinity}'), 422, "config.sampling.temperature"),
        ("POST", "/v1/adapters", body('"reward": {"name": "target_share", "kwargs": {"w": [1, NaN]}}'), 422, "kwargs.w.1 is Infinity or NaN"),
        ("GET", "/nope", None, 404, "no route GET /nope"),
        ("GET", "/v1/adapters/a/nope", None, 404, "no route GET /v1/adapters/a/nope"),
        ("PUT", "/v1/adapters", None, 405, "method PUT is not allowed on /v1/adapters; allowed: GET, POST"),
        ("PATCH", "/v1/adapters/a", None, 405, "allowed: DELETE, GET"),
        ("POST", "/v1/adapters", "{\"name\": ", 422, "body: JSON decode error"),
        ("GET", "/v1/adapters", None, 200, {"names": []}),  # every refusal above changed nothing
    ]


def rows_bounded_data_checks(w):
    """Issue 14 F4: registration reads a bounded prefix of a data file. A 2 GiB sparse file (one
    line of NULs) was a 503 after 30 s and 4 GB in the controller; now a 400 naming the limits."""
    with open(w.root / "huge.jsonl", "wb") as f:
        f.truncate(2 << 30)
    good = '{"prompt": "say digits", "label": "0123456789"}\n'
    (w.root / "long_line_first.jsonl").write_text('{"prompt": "' + "x" * (2 << 20) + '", "label": "1"}\n' + good * 3)
    with open(w.root / "big_tail.jsonl", "wb") as f:  # good rows, then a sparse tail past the checked prefix
        f.write(good.encode() * 1000)
        f.truncate(1 << 30)
    return [
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config("huge.jsonl")}, 400,
         "no usable row in the first 67108864 bytes of huge.jsonl: 1 line(s) longer than the 1048576 bytes a row may have (max_row_bytes"),
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config("huge.jsonl", data={"path": "huge.jsonl", "max_row_bytes": 1 << 30})}, 400,
         "config.data.max_row_bytes 1073741824 is above the service's limit of 1048576"),
        # an over-long line is skipped and counted (3 rows left), not a refusal
        ("POST", "/v1/adapters", {"name": "a", "config": w.rl_config("long_line_first.jsonl", num_epoch=1, prompts_per_step=1)}, 201,
         {"total_steps": 3}),
        # 1000 rows in the checked 64 MiB of 1 GiB: the rest is counted from the size (1000 * 16 rows / 4 per step)
        ("POST", "/v1/adapters", {"name": "b", "config": w.rl_config("big_tail.jsonl")}, 201, {"total_steps": 4000}),
        ("GET", "/v1/adapters", None, 200, {"names": ["a", "b"]}),
    ]


SCENARIOS = {
    "register, duplicate, no free slot": rows_register_conflicts,
    "bad values and schema: 400 / 422, nothing changes": rows_bad_values,
    "unknown name, delete twice, abort, re-register while retiring": rows_lifecycle,
    "auth missing and wrong": rows_auth,
    "non-finite numbers, unknown route, wrong method: ErrorOut 4xx": rows_not_finite_and_framework_errors,
    "huge data files: bounded check, 400 with the limit": rows_bounded_data_checks,
}


@pytest.fixture
def served(tmp_path):
    with served_world(tmp_path) as pair:
        yield pair


def check_row(http, i, row, default_token=TOKEN):
    method, path, body, status, expect, *token = row
    token = token[0] if token else default_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    kwargs = {"json": body} if isinstance(body, dict) else ({"content": body, "headers": {**headers, "content-type": "application/json"}} if body else {})
    kwargs.setdefault("headers", headers)
    r = http.request(method, path, **kwargs)
    where = f"row {i}: {method} {path} -> {r.status_code} {r.text[:400]}"
    assert r.status_code == status, where
    payload = r.json()
    if isinstance(expect, str):
        assert expect in payload["detail"], where
        assert payload["error"] and r.status_code >= 400
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
    else:
        for key, want in (expect or {}).items():
            got = [a["name"] for a in payload["adapters"]] if key == "names" else payload[key]
            assert got == want, f"{where}: {key}"


@pytest.mark.parametrize("title", list(SCENARIOS))
def test_api_scenario(served, title):
    world, server = served
    with client(server.url, token=None) as http:
        for i, row in enumerate(SCENARIOS[title](world)):
            check_row(http, i, row)


def test_oversized_body_is_413_and_changes_nothing(served):
    world, server = served
    big = {"name": "a", "config": world.rl_config(reward={"name": "target_share", "kwargs": {"pad": "x" * MAX_BODY}})}
    with client(server.url) as http:
        r = http.post("/v1/adapters", json=big)
        assert r.status_code == 413, r.text
        assert f"larger than the {MAX_BODY} bytes allowed" in r.json()["detail"]

        def chunks():  # no Content-Length: the counted bytes still hit the limit
            for _ in range(4):
                yield b"x" * (MAX_BODY // 2)

        r = http.post("/v1/adapters", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert http.get("/v1/adapters").json() == {"adapters": [], "total": 0, "next_cursor": None}


def test_prometheus_metrics_and_docs(served):
    world, server = served
    with client(server.url) as http:
        assert http.post("/v1/adapters", json={"name": "a", "config": world.rl_config()}).status_code == 201
        text = http.get("/metrics").text
        assert 'lorafleet_adapter_step{adapter="a"} 0.0' in text
        assert 'lorafleet_adapter_state{adapter="a",state="PENDING"} 1.0' in text
        assert 'lorafleet_adapters{state="PENDING"} 1.0' in text
        assert "lorafleet_slots_free 1.0" in text and "lorafleet_slots_total 2.0" in text
        assert http.get("/docs").status_code == 200
        schema = http.get("/openapi.json").json()["components"]["schemas"]["AdapterConfig"]["properties"]
        assert "LoRA rank r" in schema["rank"]["description"]


def test_refuses_to_start_off_loopback_without_token(tmp_path):
    from api.app import create_app
    from api.server import ApiServer

    world = make_world(tmp_path)
    open_settings = world.settings.model_copy(update={"api_token": None, "host": "0.0.0.0"})  # bypasses the settings check on purpose
    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0' without an API token"):
        create_app(None, open_settings)
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without an API token"):
        ApiServer(object(), "0.0.0.0", 0, token_configured=False)


def test_concurrent_requests_no_5xx_and_atomic_slots(served):
    """200 concurrent GETs, then 20 racing registrations of one name and 20 of
    distinct names over 2 slots: no 5xx, exactly one winner per name, exactly 2
    slots handed out."""
    import asyncio
    import time

    import httpx

    world, server = served
    cfg = world.rl_config()

    async def run():
        headers = {"Authorization": f"Bearer {TOKEN}"}
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30.0, limits=limits) as http:

            async def timed_get():
                t0 = time.perf_counter()
                r = await http.get("/v1/adapters")
                return r.status_code, time.perf_counter() - t0

            gets = await asyncio.gather(*(timed_get() for _ in range(200)))
            same = await asyncio.gather(*(http.post("/v1/adapters", json={"name": "same", "config": cfg}) for _ in range(20)))
            distinct = await asyncio.gather(*(http.post("/v1/adapters", json={"name": f"n{i}", "config": cfg}) for i in range(20)))
            final = (await http.get("/v1/adapters")).json()["adapters"]
            return gets, same, distinct, final

    gets, same, distinct, final = asyncio.run(run())
    assert [s for s, _ in gets] == [200] * 200
    latencies = sorted(t for _, t in gets)
    print(f"\n200 concurrent GET /v1/adapters: p50 {latencies[99] * 1e3:.1f} ms, p99 {latencies[197] * 1e3:.1f} ms")
    assert sorted(r.status_code for r in same) == [201] + [409] * 19
    # "same" holds one of the 3 live places (max_live_runs): 2 slots, then 1 queued
    assert sorted(r.status_code for r in distinct) == [201] * 2 + [409] * 18
    assert {r.json()["error"] for r in distinct if r.status_code == 409} == {"no_free_slot"}
    assert sorted((a["slot"] is None, a["slot"], a["queue_position"]) for a in final) == [(False, 0, None), (False, 1, None), (True, None, 1)]


def test_wrong_content_type_is_415_and_errors_carry_allow(served):
    """Issue 14 F7: a JSON route given another Content-Type answers 415 (it was 422), a wrong
    method 405 with an Allow header naming every method of the path, both as ErrorOut."""
    world, server = served
    body = json.dumps({"name": "a", "config": world.rl_config()})
    with client(server.url) as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = http.post("/v1/adapters", content=body, headers={"content-type": content_type})
            assert r.status_code == 415, r.text
            assert r.json()["error"] == "unsupported_media_type" and "application/json" in r.json()["detail"]
        r = http.post("/v1/adapters", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 201, r.text
        r = http.request("PUT", "/v1/adapters/a")
        assert (r.status_code, r.headers["allow"], r.json()["error"]) == (405, "DELETE, GET", "method_not_allowed")
        assert [a["name"] for a in http.get("/v1/adapters").json()["adapters"]] == ["a"]


def test_no_server_paths_in_errors_records_or_open_ready(served, tmp_path):
    """Issue 14 F8: error details, records and the open /ready never show the server's absolute
    paths: data files relative to the data root, run files relative to the state dir; /ready
    without the token says ready or not, nothing internal."""
    world, server = served
    secrets = [str(tmp_path), str(tmp_path.resolve())]

    def clean(r):
        for s in secrets:
            assert s not in r.text, f"server path {s} shown: {r.text[:400]}"
        return r

    (world.root / "sub").mkdir()
    (world.root / "sub" / "rl.jsonl").write_text((world.root / "rl.jsonl").read_text())
    with client(server.url) as http:
        r = clean(http.post("/v1/adapters", json={"name": "a", "config": world.rl_config("nope.jsonl")}))
        assert r.status_code == 400 and "'nope.jsonl' does not exist" in r.json()["detail"], r.text
        r = clean(http.post("/v1/adapters", json={"name": "a", "config": world.rl_config(str(world.outside / "secret.jsonl"))}))
        assert r.status_code == 400 and "allowed: <data root>" in r.json()["detail"], r.text
        r = clean(http.post("/v1/adapters", json={"name": "a", "config": world.rl_config("escape.jsonl")}))
        assert r.status_code == 400 and "through a symlink" in r.json()["detail"], r.text
        r = clean(http.post("/v1/adapters", json={"name": "a", "config": world.rl_config(str(world.root / "sub" / "rl.jsonl"))}))
        assert r.status_code == 201 and r.json()["config"]["data"]["path"] == "sub/rl.jsonl", r.text
        assert clean(http.get("/v1/adapters/a")).json()["config"]["data"]["path"] == "sub/rl.jsonl"
        clean(http.get("/v1/adapters"))
        full = http.get("/ready").json()
        assert full["components"]["runtime"]["detail"], full  # with the token: the details
    with client(server.url, token=None) as anonymous:
        r = anonymous.get("/ready")
        assert r.status_code == 503 and r.json()["components"] == {"runtime": {"ok": False, "detail": None}}, r.text
