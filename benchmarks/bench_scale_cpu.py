"""A thousand tenants on one node, on CPU with the tiny world (issue 26; docs/benchmarks-history.md "A thousand
tenants on one node").

One `lorafleet serve` (a subprocess, as an operator starts it: Ray, one trainer rank, one SGLang CPU
engine, the coordinator) with S trainer slots and turns of `--turn-steps` steps. Tenants are SFT runs of two
tenant keys (2 rows a step, endless: num_step 10^6), registered in phases up to N = 8, 200 and
1,024 live at once (the 1,024 phase's registrations come from 200 concurrent clients). After each
phase's warm-up (every tenant prepared once: none queued for a first slot), for `--window-s`
seconds each:

  quiet   tenant-steps per minute (GET /v1/fleet/stats `steps`), the coordinator's time per round
          (place + reconcile, from /metrics lorafleet_coordinator_seconds over
          lorafleet_reconciles), the coordinator's resident memory (/proc/<pid>/status VmRSS);
  reads   the same while bursts of 100 concurrent GETs (half /v1/adapters?limit=100, half /metrics)
          come every --burst-every-s seconds (their p50/p99 and sizes; 0: back to back, a stress);
the two alternate `--pairs` times (the rates are summed over each kind's windows); then the
longest wait for a turn, read from the scheduler's own log (evicted -> restored: seconds,
and placements of others between). Registration latency: p50/p99 of the 1,024 phase's POSTs.

`--list-keys admin,alice,bob`: the list pages of a burst come from those credentials in turn (the
admin token and the two tenant keys; /metrics is the admin's). `--tinker N`: N of the last phase's
tenants are Tinker models (the official SDK, the cookbook's RL loop: benchmarks/tinker_rl_tenants.py,
in a process of their own so that they do not share the readers' interpreter and its GIL, under the
two tenant keys) in place of N REST runs; they count
among the tenants, their steps are reported apart (`tinker_steps_per_min`, client side), and the
warm-up waits until each has finished a step.

  .venv/bin/python -m benchmarks.bench_scale_cpu --out scale_cpu.json
  .venv/bin/python -m benchmarks.bench_scale_cpu --phases 8,64 --window-s 20   # a quick look
  .venv/bin/python -m benchmarks.bench_scale_cpu --phases 200,1024 --window-s 20 --pairs 3   # quiet and reads alternating
  .venv/bin/python -m benchmarks.bench_scale_cpu --phases "" --complete 1024   # 1,024 two-step runs from 8 clients, to the end
  .venv/bin/python -m benchmarks.bench_scale_cpu --slots 4 --phases 200,1024 --tinker 256 --list-keys admin,alice,bob   # reads with Tinker tenants
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from benchmarks.proc_stats import rss_mib
from benchmarks.tinker_rl_tenants import FleetProcess
from tests.integration.service_world import TOKEN, Service, serve_job, sft

# Idle connections are dropped by the client before the server drops them (uvicorn: after 5 s): the
# main client idles while the phase registers, and reusing a connection the server is closing fails.
IDLE_FIRST = httpx.Limits(keepalive_expiry=2.0)
KEYS = {"alice": "tml-alice-bench-key-1", "bob": "tml-bob-bench-key-22"}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))] if xs else float("nan")


def _gauges(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    out = {}
    for key in ('lorafleet_coordinator_seconds{part="place"}', 'lorafleet_coordinator_seconds{part="reconcile"}',
                "lorafleet_reconciles", 'lorafleet_adapters_residency{residency="queued"}',
                'lorafleet_scheduler_events{event="evictions"}'):
        m = re.search(r"^" + re.escape(key) + r" (\S+)$", text, re.MULTILINE)
        out[key] = float(m.group(1)) if m else float("nan")
    return out


def _register(service: Service, tiny: Path, names: list[str], threads: int, num_step: int = 10**6) -> list[float]:
    """POST each name with `threads` concurrent clients; the latencies (every answer must be 201)."""
    latencies: list[float] = []
    lock = threading.Lock()
    local = threading.local()

    def one(i_name: tuple[int, str]) -> None:
        i, name = i_name
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=service.url, timeout=120,
                                      headers={"Authorization": f"Bearer {KEYS[('alice', 'bob')[i % 2]]}"})
        cfg = sft(tiny, num_step=num_step, prompts_per_step=2)
        t0 = time.perf_counter()
        r = local.http.post("/v1/adapters", json={"name": name, "config": cfg})
        dt = time.perf_counter() - t0
        assert r.status_code == 201, r.text
        with lock:
            latencies.append(dt)

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, enumerate(names)))
    return latencies


def _window(service: Service, seconds: float, readers: int = 0, burst_every_s: float = 0.0, list_keys: tuple[str, ...] = (TOKEN,),
            tinker: FleetProcess | None = None) -> dict:
    """Steps per minute and coordinator time per round over `seconds`, with `readers` concurrent read
    clients: each sends its GET at every burst (all together, every `burst_every_s`), or back to back
    when that is 0 (a stress beyond bursts). List readers take the credentials of `list_keys` in turn;
    an answer other than 200 is counted (`read_errors`). `tinker`: its tenants' steps in the window."""
    stop = threading.Event()
    reads: dict[str, list[float]] = {"page": [], "metrics": []}
    # bursts apart (burst_every_s > 0): the window's first, the front's cache cold after the quiet window, and the rest
    first_burst: dict[str, list[float]] = {"page": [], "metrics": []}
    later_bursts: dict[str, list[float]] = {"page": [], "metrics": []}
    sizes: dict[str, int] = {}
    failed: list[int] = []
    lock = threading.Lock()
    # Every reader makes its client before the first burst: an httpx.Client takes about 15 ms of this
    # process's interpreter (its SSL context), and 100 of them made while the first burst was in flight
    # added up to 1.5 s to that burst's measured reads (the readers' own cost, not the service's).
    t_first = [0.0]  # the first burst's time, set (by the barrier's action) once every client is made
    clients_made = threading.Barrier(readers + 1, action=lambda: t_first.__setitem__(0, time.monotonic() + 0.5)) if readers else None

    def reader(i: int) -> None:
        key = list_keys[(i // 2) % len(list_keys)] if i % 2 == 0 else TOKEN
        with httpx.Client(base_url=service.url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
            clients_made.wait()
            burst = 0
            while not stop.is_set():
                if burst_every_s > 0:  # the next burst's start, shared by every reader
                    at = t_first[0] + burst * burst_every_s
                    burst += 1
                    if stop.wait(max(0.0, at - time.monotonic())):
                        return
                kind = ("page", "metrics")[i % 2]
                t0 = time.perf_counter()
                r = http.get("/v1/adapters?limit=100" if kind == "page" else "/metrics")
                dt = time.perf_counter() - t0
                with lock:
                    reads[kind].append(dt)
                    if burst_every_s > 0:
                        (first_burst if burst == 1 else later_bursts)[kind].append(dt)
                    sizes[kind] = len(r.content)
                    if r.status_code != 200:
                        failed.append(r.status_code)

    with httpx.Client(base_url=service.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        s0, g0, t0 = http.get("/v1/fleet/stats").json()["steps"], _gauges(http), time.monotonic()
        workers = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(readers)]
        for w in workers:
            w.start()
        if clients_made is not None:
            clients_made.wait()
        time.sleep(seconds)
        stop.set()
        for w in workers:
            w.join(120)
        s1, g1, t1 = http.get("/v1/fleet/stats").json()["steps"], _gauges(http), time.monotonic()
    place = 'lorafleet_coordinator_seconds{part="place"}'
    raw = {"steps": s1 - s0, "seconds": t1 - t0, "rounds": g1["lorafleet_reconciles"] - g0["lorafleet_reconciles"],
           "coordinator_s": sum(g1[k] - g0[k] for k in (place, 'lorafleet_coordinator_seconds{part="reconcile"}')),
           "place_s": g1[place] - g0[place],
           "evictions": g1['lorafleet_scheduler_events{event="evictions"}'] - g0['lorafleet_scheduler_events{event="evictions"}'],
           "latencies": reads, "first_burst": first_burst, "later_bursts": later_bursts, "sizes": sizes, "read_errors": len(failed)}
    if tinker is not None:
        raw["tinker_steps"] = tinker.steps_in(t0, t1)
    return raw


def _summary(windows: list[dict]) -> dict:
    """Windows of one kind (quiet, or with readers) taken together: steps per minute over their whole
    time, the coordinator's time per round over all their rounds, read percentiles over all reads."""
    total = {k: sum(w.get(k, 0) for w in windows) for k in ("steps", "seconds", "rounds", "coordinator_s", "place_s", "evictions",
                                                            "read_errors", "tinker_steps")}
    rounds = total["rounds"]
    out = {"tenant_steps_per_min": total["steps"] / total["seconds"] * 60, "rounds": rounds, "windows": len(windows),
           "coordinator_ms_per_round": 1e3 * total["coordinator_s"] / rounds if rounds else float("nan"),
           "place_ms_per_round": 1e3 * total["place_s"] / rounds if rounds else float("nan"),
           "evictions": total["evictions"], "read_errors": total["read_errors"]}
    if any("tinker_steps" in w for w in windows):
        out["tinker_steps_per_min"] = total["tinker_steps"] / total["seconds"] * 60
    for kind in ("page", "metrics"):
        xs = [x for w in windows for x in w["latencies"].get(kind, [])]
        if xs:
            out[f"{kind}_p50_ms"], out[f"{kind}_p99_ms"] = 1e3 * _pct(xs, 0.5), 1e3 * _pct(xs, 0.99)
            out[f"{kind}_bytes"], out[f"{kind}_reads"] = max(w["sizes"][kind] for w in windows if kind in w["sizes"]), len(xs)
            cold = [x for w in windows for x in w.get("first_burst", {}).get(kind, [])]
            warm = [x for w in windows for x in w.get("later_bursts", {}).get(kind, [])]
            if cold:  # the first burst of each window (the cache cold after the quiet window) apart from the rest
                out[f"{kind}_first_burst_p50_ms"], out[f"{kind}_first_burst_max_ms"] = 1e3 * _pct(cold, 0.5), 1e3 * max(cold)
                if warm:
                    out[f"{kind}_later_bursts_p99_ms"] = 1e3 * _pct(warm, 0.99)
    return out


def _to_completion(service: Service, tiny: Path, n: int, steps: int, threads: int, deadline_s: float = 7200) -> dict:
    """Register `n` runs of `steps` steps at once from `threads` clients, then read every run's
    record (pages of 1,000, admin) until none is live: how long, how many COMPLETED, FAILED or
    missing ("lost"), the 5xx answers seen by anyone, and the longest wait for a first step."""
    names = [f"c{i:04d}" for i in range(n)]
    wanted = set(names)
    t0 = time.monotonic()
    lat = _register(service, tiny, names, threads, num_step=steps)
    register_s = time.monotonic() - t0
    server_errors = 0
    with httpx.Client(base_url=service.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        while True:
            runs, cursor = {}, None
            while True:
                r = http.get("/v1/adapters", params={"limit": 1000, "q": "c", **({"cursor": cursor} if cursor else {})})
                if r.status_code >= 500:
                    server_errors += 1
                    break
                body = r.json()
                runs.update({a["name"]: a for a in body["adapters"] if a["name"] in wanted})
                cursor = body["next_cursor"]
                if cursor is None:
                    break
            live = [a for a in runs.values() if a["state"] in ("PENDING", "ACTIVE", "RETIRING", "CLEANUP")]
            if len(runs) == n and not live:
                break
            assert time.monotonic() - t0 < deadline_s, f"{len(live)} of {n} still live after {deadline_s} s"
            time.sleep(2.0)
    total_s = time.monotonic() - t0
    states = [a["state"] for a in runs.values()]
    return {"runs": n, "steps_each": steps, "clients": threads, "register_s": register_s,
            "register_p50_ms": 1e3 * _pct(lat, 0.5), "register_p99_ms": 1e3 * _pct(lat, 0.99), "total_s": total_s,
            "completed": states.count("COMPLETED"), "failed": states.count("FAILED"),
            "lost": n - states.count("COMPLETED") - states.count("FAILED"),
            "with_export": sum(1 for a in runs.values() if a.get("export_path")),
            "steps_recorded": sum(a["step"] for a in runs.values()), "server_errors": server_errors,
            "longest_register_to_end_s": max((a["finished_at"] - a["created_at"] for a in runs.values() if a["finished_at"]), default=None)}


def _longest_wait(log_path: Path, since: float) -> dict:
    """Evicted -> restored of each tenant after `since` (time.time()), from the scheduler's log: seconds, and
    the placements of others between."""
    out_at: dict[str, tuple[float, int]] = {}
    placements, worst_s, worst_n = 0, 0.0, 0
    for line in log_path.read_text(errors="replace").splitlines():
        m = re.match(r"^(\S+ \S+) \w+ service\.scheduler: (evicted|restored) (\S+) (?:from|into) slot", line)
        if not m:
            if " leaves the queue for slot" in line:
                placements += 1
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at < since:
            continue
        if m.group(2) == "evicted":
            out_at[m.group(3)] = (at, placements)
        else:
            placements += 1
            if m.group(3) in out_at:
                t, n = out_at.pop(m.group(3))
                worst_s, worst_n = max(worst_s, at - t), max(worst_n, placements - n - 1)
    return {"longest_wait_s": worst_s, "longest_wait_placements": worst_n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--turn-steps", type=int, default=4, help="slots.turn_steps (the default of a job file)")
    ap.add_argument("--phases", default="8,200,1024", help="tenants live at once, ascending")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--pairs", type=int, default=1, help="quiet and read windows, alternating, this many of each")
    ap.add_argument("--readers", type=int, default=100, help="readers of a burst (half list pages, half /metrics)")
    ap.add_argument("--burst-every-s", type=float, default=2.0, help="a burst every this many seconds (the dashboard's poll); 0: back to back")
    ap.add_argument("--clients", type=int, default=200, help="concurrent registering clients of the largest phase")
    ap.add_argument("--complete", type=int, default=0, help="then register this many runs of --complete-steps steps at once and wait until all end")
    ap.add_argument("--complete-steps", type=int, default=2)
    ap.add_argument("--complete-clients", type=int, default=8)
    ap.add_argument("--list-keys", default="admin", help="credentials of the bursts' list pages, in turn: admin, alice, bob")
    ap.add_argument("--tinker", type=int, default=0, help="Tinker RL tenants among the last phase's tenants (module doc)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from examples.tiny.build import ensure_tiny_world
    from service.fleet.engine_pids import reap_engines

    tiny = ensure_tiny_world()
    phases = [int(x) for x in args.phases.split(",") if x]
    list_keys = tuple(TOKEN if k == "admin" else KEYS[k] for k in args.list_keys.split(","))
    tinker: FleetProcess | None = None
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
        tmp = Path(d)
        job_path = serve_job(tmp, tiny, slots={"num_slots": args.slots, "max_rank": 8, "turn_steps": args.turn_steps,
                                                      "evict_idle_s": 30.0})
        job = yaml.safe_load(job_path.read_text())
        keys = tmp / "keys.yaml"
        keys.write_text(yaml.safe_dump(KEYS))
        job["service"].update({"tinker_keys_file": str(keys)})
        job_path.write_text(yaml.safe_dump(job))
        svc = Service(job_path, tmp / "state", tmp / "serve.log")
        try:
            t_start = time.monotonic()
            svc.start()
            print(f"service up in {time.monotonic() - t_start:.0f} s", flush=True)
            with httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}, limits=IDLE_FIRST) as http:
                rss0 = rss_mib(svc.proc.pid)
                live = 0
                for n in phases:
                    models = args.tinker if n == phases[-1] else 0
                    names = [f"t{i:04d}" for i in range(live, n - models)]
                    t0 = time.monotonic()
                    lat = _register(svc, tiny, names, args.clients if n == phases[-1] else 8)
                    reg_s = time.monotonic() - t0
                    live = n
                    deadline = time.monotonic() + 3600
                    if models:
                        tinker = FleetProcess(svc.url, [KEYS["alice"], KEYS["bob"]], "model", models)
                    while _gauges(http)['lorafleet_adapters_residency{residency="queued"}'] > 0:
                        assert time.monotonic() < deadline, "tenants never all got a first slot"
                        time.sleep(2.0)
                    if models:
                        assert tinker.until_stepped(max(1.0, deadline - time.monotonic())), f"Tinker tenants never all stepped: {tinker.errors[:5]}"
                    warm = time.monotonic() - t0
                    since = time.time()
                    # quiet and read windows alternate (--pairs): the fleet's rate drifts as turns rotate,
                    # and one quiet window before one read window measured that drift as much as the reads
                    windows = [(_window(svc, args.window_s, tinker=tinker),
                                _window(svc, args.window_s, readers=args.readers, burst_every_s=args.burst_every_s,
                                        list_keys=list_keys, tinker=tinker))
                               for _ in range(args.pairs)]
                    quiet, reads = _summary([q for q, _ in windows]), _summary([r for _, r in windows])
                    reads["pair_ratios"] = [r["steps"] / r["seconds"] / (q["steps"] / q["seconds"]) if q["steps"] else None
                                            for q, r in windows]  # None: no step ended in the quiet window
                    row = {"tenants": n, "tinker_tenants": models, "list_keys": args.list_keys, "slots": args.slots,
                           "register_s": reg_s, "warm_s": warm,
                           "register_p50_ms": 1e3 * _pct(lat, 0.5), "register_p99_ms": 1e3 * _pct(lat, 0.99),
                           "register_clients": args.clients if n == phases[-1] else 8,
                           "rss_mib": rss_mib(svc.proc.pid), "rss_mib_at_start": rss0,
                           "quiet": quiet, "reads": reads, **_longest_wait(svc.log_path, since)}
                    row["reads_vs_quiet"] = reads["tenant_steps_per_min"] / quiet["tenant_steps_per_min"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            base = rows[0] if rows else None
            for r in rows[1:]:
                r["mib_per_tenant"] = (r["rss_mib"] - base["rss_mib"]) / (r["tenants"] - base["tenants"])
            if tinker is not None:
                tinker.stop()
                tinker = None
            if args.complete:
                if rows:  # the endless tenants of the phases end first: the runs to completion have the slots alone
                    with httpx.Client(base_url=svc.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                        for name in (f"t{i:04d}" for i in range(live)):
                            http.delete(f"/v1/adapters/{name}")
                done = _to_completion(svc, tiny, args.complete, args.complete_steps, args.complete_clients)
                done["longest_wait_for_a_turn"] = _longest_wait(svc.log_path, 0.0)
                print(json.dumps(done), flush=True)
                rows.append({"to_completion": done})
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=2))
        finally:
            if tinker is not None:
                tinker.stop()
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.kill()
            reap_engines(svc.state_dir)


if __name__ == "__main__":
    main()
