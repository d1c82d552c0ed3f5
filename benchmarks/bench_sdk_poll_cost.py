"""What one `retrieve_future` poll costs the Tinker SDK's own process (issue 41): the client's CPU a poll.

A Tinker call that waits (for a trainer slot, at K = 1,024 tenants through 8 slots for minutes) is polled
by the SDK on its own, one `retrieve_future` after another, each held by the service up to `POLL_HOLD_S`
and answered try again. The tenants' process of `bench_tinker_fleet` runs on the service's two cores, so
what each poll costs that process is paid out of the service's share of the machine. This measures it
apart from the service: the official SDK's client (tinker 0.38 `AsyncTinker`, `futures.retrieve` exactly
as `_APIFuture._fetch_via_rest` sends it, 45 s timeout, the iteration and request-type headers) polls a
STAND-IN server (a loopback asyncio server in a child process that answers every poll, after `hold_s`,
with the service's try-again body: queue_state paused_capacity and a reason), so that the only Python on
the clock is the client's. `concurrency` pollers each poll again at once (as the SDK does after a try
again); the client's CPU (`time.process_time`: every thread of the process, pyqwest's Rust workers too)
over `seconds`, per poll.

Rows: the SDK's default transport (pyqwest, which lorafleet's /client/config keeps on) and httpx's,
answered at once (the per-request cost), and 1,000 pollers held 5 s each (a thousand connections open).

Why the service cannot hold polls longer than `POLL_HOLD_S` (35 s) to save polls: the SDK sends
`timeout=45`; pyqwest >= 0.10 turns it into a 90 s budget (read + write), pyqwest 0.4.1-0.9 (which the
SDK's `pyqwest>=0.4.1` allows) into 45 s (max of the two), httpx's own transport into 45 s between bytes.

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_sdk_poll_cost --seconds 20 --out sdk_poll_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from benchmarks.report import emit
from tests.s3_server import free_ports  # the project's free loopback ports (no torch import, unlike trainer's)

TRY_AGAIN = {"type": "try_again", "request_id": "bench-poll", "queue_state": "paused_capacity",
             "queue_state_reason": "waiting for a trainer slot: 512 calls ahead"}


def serve(port: int, hold_s: float) -> None:
    """The stand-in: every POST (any path) answered with TRY_AGAIN after `hold_s`, keep-alive."""
    body = json.dumps(TRY_AGAIN).encode()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(size)
                await asyncio.sleep(hold_s)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(main())


async def poll_for(port: int, *, pyqwest: bool, concurrency: int, seconds: float) -> dict:
    """`concurrency` SDK pollers for `seconds` (after a warm-up poll each): polls made, the client's CPU."""
    from tinker._client import AsyncTinker
    from tinker.types import ClientConfigResponse, FutureRetrieveRequest

    client = AsyncTinker(base_url=f"http://127.0.0.1:{port}", api_key="tml-bench",
                         _client_config=ClientConfigResponse(use_pyqwest_transport=pyqwest))
    request = FutureRetrieveRequest(request_id="bench-poll", allow_metadata_only=False)
    headers = {"X-Tinker-Request-Iteration": "3", "X-Tinker-Request-Type": "SaveWeightsForSampler"}

    async def one() -> None:
        response = await client.futures.with_raw_response.retrieve(request=request, timeout=45, max_retries=0,
                                                                  extra_headers=headers)
        assert (await response.json())["type"] == "try_again"

    polls = 0
    end = 0.0

    async def poller() -> None:
        nonlocal polls
        while time.monotonic() < end:
            await one()
            polls += 1

    await asyncio.gather(*(one() for _ in range(concurrency)))  # connections open, code paths warm
    end = time.monotonic() + seconds
    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(poller() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await client.close()
    return {"transport": "pyqwest" if pyqwest else "httpx", "concurrency": concurrency, "polls": polls,
            "seconds": round(wall, 1), "client_cpu_s": round(cpu, 3),
            "client_cpu_ms_per_poll": round(1e3 * cpu / polls, 3) if polls else None,
            "client_cores": round(cpu / wall, 3)}


def row(*, pyqwest: bool, concurrency: int, hold_s: float, seconds: float) -> dict:
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_sdk_poll_cost", "--serve", str(port), str(hold_s)],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the stand-in server did not start (exit code {server.poll()})")
        return {"hold_s": hold_s, **asyncio.run(poll_for(port, pyqwest=pyqwest, concurrency=concurrency, seconds=seconds))}
    finally:
        server.kill()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="measured time of each row")
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve", nargs=2, metavar=("PORT", "HOLD_S"), help=argparse.SUPPRESS)  # the stand-in's child
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), float(args.serve[1]))
        return
    import logging

    logging.getLogger("tinker").setLevel(logging.ERROR)
    rows = [row(pyqwest=True, concurrency=50, hold_s=0.0, seconds=args.seconds),
            row(pyqwest=False, concurrency=50, hold_s=0.0, seconds=args.seconds),
            row(pyqwest=True, concurrency=1000, hold_s=5.0, seconds=max(args.seconds, 30.0))]
    emit({"rows": rows}, args.out)


if __name__ == "__main__":
    main()
