"""The API front's cost per passed request while many calls are held open (api/front/read_front.py and
its connections to the app, api/front/upstream.py).

A Tinker fleet holds one long poll per waiting tenant open through the front, so the front holds about
as many connections to the app as there are tenants; what a request costs must not grow with them.
This benchmark runs the real front process (`python -m api.front.read_front`) over an app (uvicorn on
loopback) that holds H calls open, then passes `--requests` short calls (20 at a time) beside them, and
reports the front's CPU time per short call (from /proc) and the calls' p50 / p99, for each H of `--held`.

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_front_pool --held 0,1000 --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

from api.front.read_front import bind_public
from api.server import ApiServer
from benchmarks.proc_stats import cpu_s
from tests.integration.holding_app import HoldingApp


async def hold(port: int, n: int) -> list[asyncio.StreamWriter]:
    """n calls to /hold, sent on raw connections and never read (the front keeps one upstream each)."""
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /hold HTTP/1.1\r\nHost: bench\r\n\r\n")
        writers.append(w)
    return writers


async def short_calls(url: str, n: int, concurrency: int = 20) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker(k: int) -> None:
            for _ in range(k):
                t0 = time.perf_counter()
                r = await c.get("/ping")
                assert r.status_code == 200
                latencies.append(time.perf_counter() - t0)
        await asyncio.gather(*[worker(n // concurrency) for _ in range(concurrency)])
    return latencies


def run(held: int, requests: int) -> dict:
    app = HoldingApp()
    upstream = ApiServer(app, "127.0.0.1", 0).start()
    sock = bind_public("127.0.0.1", 0)
    port = sock.getsockname()[1]
    front = subprocess.Popen([sys.executable, "-m", "api.front.read_front", "--fd", str(sock.fileno()), "--upstream", upstream.url,
                              "--ttl-s", "1", "--stale-s", "0", "--parent", str(os.getpid())],
                             pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)
    sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/ping", timeout=5)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

        async def scenario() -> dict:
            writers = await hold(port, held)
            t_end = time.monotonic() + 120
            while app.held < held and time.monotonic() < t_end:
                await asyncio.sleep(0.1)
            c0, t0 = cpu_s(front.pid), time.monotonic()
            lat = sorted(await short_calls(url, requests))
            c1, t1 = cpu_s(front.pid), time.monotonic()
            for w in writers:
                w.close()
            return {"held": app.held, "requests": len(lat), "front_cpu_ms_per_call": 1e3 * (c1 - c0) / len(lat),
                    "calls_per_s": len(lat) / (t1 - t0), "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)]}

        return asyncio.run(scenario())
    finally:
        app.release.set()
        front.terminate()
        front.wait(30)
        upstream.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", default="0,1000", help="calls held open while the short ones pass, one run each")
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    for held in [int(h) for h in args.held.split(",")]:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in run(held, args.requests).items()}), flush=True)


if __name__ == "__main__":
    main()
