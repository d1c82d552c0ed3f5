"""The API's front process (api/front/read_front.py, issue 26: reads never stall training), as `lorafleet
serve` runs it: a real `python -m api.front.read_front` process on a socket bound here, in front of the
real app (uvicorn on loopback) over a real controller and SQLite registry with tenant keys.

  * every request passes as it is (a scenario table compared with the app asked directly: status,
    body, content type), writes and refusals included;
  * a burst of 100 concurrent polled reads costs the app one request (counted at the app);
  * answers are never shared between credentials, and a refused one is never stored (F1);
  * a write through the front is read at once (F2), a Tinker wire call keeps the cached reads;
  * the front exits when its parent is killed (F4), and says 503 with a reason when the app does
    not answer; a port in use is refused naming the setting;
  * hundreds of calls held open by the app (Tinker sample calls) all reach it, and a request beside
    them is answered: no pool cap queues them; calls beside many held ones reuse their connection to
    the app (api/front/upstream.py; its own framing and reuse rules: tests/integration/test_front_upstream.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.app import create_app
from api.front.read_front import bind_public, start_front
from api.server import ApiServer
from api.tenant_keys import TenantKeys
from service.config.job import SlotCapacity
from tests.integration.api_world import TOKEN, make_world
from tests.integration.holding_app import HoldingApp
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-front-0123456", "bob": "tml-bob-front-01234567"}


class CountingApp:
    """The app, counting the requests that reach it per (method, path)."""

    def __init__(self, app) -> None:
        self.app, self.seen = app, Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen[(scope["method"], scope["path"])] += 1
        await self.app(scope, receive, send)


@contextlib.contextmanager
def front_over(upstream: str, ttl_s: float = 60.0, stale_s: float = 0.0) -> Iterator[str]:
    sock = bind_public("127.0.0.1", 0)
    try:
        proc = start_front(sock, upstream, ttl_s, stale_s)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
    try:
        wait_until(lambda: _answers(url), "the front answers", 60, interval_s=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code in (200, 503)
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from service.control.controller import Controller

    w = make_world(tmp_path_factory.mktemp("front"))
    controller = Controller(w.settings, SlotCapacity(num_slots=2, max_rank=16))
    cfg = w.rl_config(num_step=2)
    for i in range(30):
        controller.register(f"run{i:02d}", cfg, tenant=("alice", "bob", None)[i % 3])
    app = CountingApp(create_app(controller, w.settings.model_copy(update={"read_cache_s": 0.0, "read_stale_s": 0.0}),
                                 tenant_keys=TenantKeys(KEYS)))
    inner = ApiServer(app, "127.0.0.1", 0).start()
    try:
        with front_over(inner.url) as url:
            yield w, app, inner.url, url
    finally:
        inner.stop()
        controller.close()


def _client(url: str, key: str | None = TOKEN) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60.0,
                        limits=httpx.Limits(max_connections=200))


# (method, path, key, json body or raw bytes): compared through the front and straight to the app
SCENARIOS = [
    ("GET", "/ui", None, None),  # the dashboard page
    ("GET", "/v1/adapters/run01", TOKEN, None),
    ("GET", "/v1/adapters/run00", KEYS["alice"], None),  # alice's own
    ("GET", "/v1/adapters/run01", KEYS["alice"], None),  # bob's: 404 for alice
    ("GET", "/v1/adapters/nope", TOKEN, None),
    ("GET", "/v1/adapters?limit=0", TOKEN, None),  # 422 with what is allowed
    ("GET", "/v1/runs/no-such-run", TOKEN, None),
    ("GET", "/metrics", KEYS["bob"], None),  # 403: the operator's
    ("GET", "/v1/adapters", "wrong-token", None),  # 401
    ("POST", "/v1/adapters", TOKEN, {"name": "bad::name", "config": {}}),  # 422
    ("POST", "/v1/adapters", TOKEN, b"{not json"),
    ("POST", "/v1/adapters", TOKEN, b"x" * 20000),  # over max_body_bytes: 413
    ("DELETE", "/v1/adapters/nope", TOKEN, None),
    ("PUT", "/v1/adapters", TOKEN, None),  # 405
    ("GET", "/openapi.json", None, None),
]


@pytest.mark.parametrize("method,path,key,body", SCENARIOS, ids=[f"{m} {p} {i}" for i, (m, p, _, _) in enumerate(SCENARIOS)])
def test_every_request_passes_as_it_is(world, method, path, key, body):
    _, _, direct, front = world
    kw = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
    if isinstance(body, bytes):
        kw["headers"] = {"content-type": "application/json"}
    with _client(direct, key) as d, _client(front, key) as f:
        want, got = d.request(method, path, **kw), f.request(method, path, **kw)
    assert (got.status_code, got.headers.get("content-type")) == (want.status_code, want.headers.get("content-type"))
    assert got.content == want.content


def test_a_write_through_the_front_is_read_at_once(world):
    w, _, _, front = world
    with _client(front) as c:
        before = c.get("/v1/adapters", params={"limit": 500}).json()  # stored: ttl 60 s
        r = c.post("/v1/adapters", json={"name": "written-now", "config": w.rl_config(num_step=2)})
        assert r.status_code == 201, r.text
        after = c.get("/v1/adapters", params={"limit": 500}).json()
        assert "written-now" not in [a["name"] for a in before["adapters"]]
        assert "written-now" in [a["name"] for a in after["adapters"]] and after["total"] == before["total"] + 1
        assert c.delete("/v1/adapters/written-now").status_code == 202
        assert c.get("/v1/adapters", params={"limit": 500}).json()["total"] == after["total"]  # retiring, still listed


def test_a_tinker_call_keeps_the_cached_reads(world):
    """F2's exception: a write of the Tinker wire (/api/v1/...: here a heartbeat the app refuses, no
    Tinker API being on) leaves the cached reads in place, where a REST write clears them."""
    _, app, _, front = world
    with _client(front) as c:
        c.get("/v1/adapters", params={"limit": 3})  # stored (ttl 60 s)
        seen = app.seen[("GET", "/v1/adapters")]
        assert c.post("/api/v1/session_heartbeat", json={"session_id": "s-1"}).status_code >= 400
        c.get("/v1/adapters", params={"limit": 3})
        assert app.seen[("GET", "/v1/adapters")] == seen  # from the front's cache
        c.delete("/v1/adapters/no-such-run")  # a REST write (refused, 404): still clears
        c.get("/v1/adapters", params={"limit": 3})
        assert app.seen[("GET", "/v1/adapters")] == seen + 1


def test_a_burst_of_100_reads_costs_the_app_one_request_each(world):
    _, app, direct, front = world
    paths = ["/v1/adapters?limit=17", "/metrics"]
    with _client(direct) as d:
        want = {p: d.get(p).content for p in paths}
    wanted_page = want[paths[0]]
    seen = app.seen.copy()
    with _client(front) as f, ThreadPoolExecutor(100) as pool:
        got = list(pool.map(lambda i: (paths[i % 2], f.get(paths[i % 2])), range(100)))
    assert all(r.status_code == 200 for _, r in got)
    assert all(r.content == wanted_page for p, r in got if p == paths[0])
    assert all(b"lorafleet_slots_free" in r.content for p, r in got if p == "/metrics")
    assert app.seen[("GET", "/v1/adapters")] - seen[("GET", "/v1/adapters")] == 1
    assert app.seen[("GET", "/metrics")] - seen[("GET", "/metrics")] == 1


def test_answers_are_never_shared_across_credentials_and_refusals_are_not_stored(world):
    _, app, direct, front = world
    for _ in range(2):  # the second time from the front's cache
        for key in (TOKEN, KEYS["alice"], KEYS["bob"]):
            with _client(direct, key) as d, _client(front, key) as f:
                want, got = d.get("/v1/adapters?limit=100"), f.get("/v1/adapters?limit=100")
            assert got.status_code == 200 and got.content == want.content, key
    with _client(front, KEYS["alice"]) as f:
        names = {a["name"] for a in f.get("/v1/adapters?limit=100").json()["adapters"]}
        assert names == {f"run{i:02d}" for i in range(0, 30, 3)}  # alice registered every third run
    seen = app.seen[("GET", "/v1/adapters")]
    with _client(front, "tml-not-a-key-000000") as f:
        assert [f.get("/v1/adapters?limit=100").status_code for _ in range(3)] == [401] * 3
    assert app.seen[("GET", "/v1/adapters")] - seen == 3  # every refusal asked the app: none stored


def test_a_port_in_use_is_refused_naming_the_setting():
    held = bind_public("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:\d+ .*LORAFLEET_PORT"):
            bind_public("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()


HELD = 300  # more calls held open at once than the front's pool took before (256)


@contextlib.contextmanager
def calls_held(app: HoldingApp, url: str, n: int) -> Iterator[tuple[httpx.Client, list]]:
    """`n` calls to /hold through the front at `url`, all arrived at `app` and still held; at the end
    released, and each answered."""
    pool = ThreadPoolExecutor(n)
    try:
        with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n + 10)) as client:
            held = [pool.submit(client.get, "/hold") for _ in range(n)]
            wait_until(lambda: app.held == n, f"all {n} held calls reach the app", timeout_s=60, interval_s=0.1)
            yield client, held
            app.release.set()
            assert all(f.result(timeout=60).text == "/hold" for f in held)
    finally:
        app.release.set()
        pool.shutdown(wait=True)


def test_hundreds_of_calls_held_open_do_not_stall_the_front():
    """Each call the app holds open keeps one connection from the front to it. With HELD of them at once
    every one reaches the app, and a request beside them is passed and answered while they are held.
    A capped pool (httpx's, before api/front/upstream.py) queued the calls past its cap, and another
    request behind them, so the cookbook's rl_basic (128 sample calls held open, the SDK's retries and
    polls) pinned the front's loop and every client's heartbeat timed out. The front's connections to
    the app have no cap."""
    app = HoldingApp()
    upstream = ApiServer(app, "127.0.0.1", 0).start()
    try:
        with front_over(upstream.url) as url, calls_held(app, url, HELD) as (client, held):
            beside = client.get("/ping", timeout=30)
            assert beside.status_code == 200 and beside.text == "/ping" and not any(f.done() for f in held)
    finally:
        upstream.stop()


def test_calls_beside_many_held_ones_reuse_their_connection():
    """80 calls held open: the 20 calls beside them, one after another, go over one connection to the
    app, not a new one each (upstream.py U1). httpx's pool, which the front used before, closed a
    connection going idle when it held more than its idle cap counting the busy ones too, so with a
    thousand Tinker polls held each answered call cost a new connection. Plant: close the connection
    after each answer (UpstreamResponse.aclose) -> 20 connections."""
    from api.front.read_front import FrontApp

    app = HoldingApp()
    upstream = ApiServer(app, "127.0.0.1", 0).start()
    front = ApiServer(FrontApp(upstream.url, ttl_s=60.0, stale_s=0.0), "127.0.0.1", 0).start()
    try:
        with calls_held(app, front.url, 80) as (client, _):
            for i in range(20):
                assert client.get(f"/ping/{i}", timeout=30).text == f"/ping/{i}"
            assert len(app.ping_connections) <= 2, app.ping_connections  # one, or two if one aged out (2 s)
    finally:
        front.stop()
        upstream.stop()


def test_an_app_that_does_not_answer_gets_503_with_a_reason():
    sock = bind_public("127.0.0.1", 0)
    closed_port = sock.getsockname()[1]
    sock.close()
    with front_over(f"http://127.0.0.1:{closed_port}") as url:
        for path in ("/v1/adapters", "/health"):
            r = httpx.get(f"{url}{path}", timeout=30)
            assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
            assert "did not answer" in r.json()["detail"]


def test_the_front_exits_when_its_parent_is_killed(tmp_path):
    """The coordinator killed with SIGKILL (no clean-up runs): its front goes too, and the port is free."""
    script = textwrap.dedent("""
        import signal
        from api.front.read_front import bind_public, start_front
        sock = bind_public("127.0.0.1", 0)
        proc = start_front(sock, "http://127.0.0.1:9", 1.0, 0.0)
        print(proc.pid, sock.getsockname()[1], flush=True)
        sock.close()
        signal.pause()  # a coordinator that lives until the test kills it
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        front_pid, port = map(int, parent.stdout.readline().split())
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}"), "the front answers", 60, interval_s=0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        wait_until(lambda: not _alive(front_pid), "the front exits after its parent was killed", 30, interval_s=0.2)
        assert not _answers(f"http://127.0.0.1:{port}")
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_front_with_the_feed_but_no_poll_hold_is_refused_before_it_starts():
    """The parked polls' hold is the coordinator's own (its POLL_HOLD_S, passed with the feed), never a
    default of the front's: start_front and the front's command line refuse the feed without it."""
    sock = bind_public("127.0.0.1", 0)
    read_fd, write_fd = os.pipe()
    try:
        with pytest.raises(ValueError, match="park_hold_s"):
            start_front(sock, "http://127.0.0.1:9", 1.0, 0.0, feed_fd=read_fd)
        out = subprocess.run([sys.executable, "-m", "api.front.read_front", "--fd", str(sock.fileno()), "--upstream",
                              "http://127.0.0.1:9", "--parent", str(os.getpid()), "--feed-fd", str(read_fd)],
                             pass_fds=[sock.fileno(), read_fd], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
        assert out.returncode == 2 and "--feed-fd needs --park-hold-s" in out.stderr, out.stderr
    finally:
        sock.close()
        os.close(read_fd)
        os.close(write_fd)
