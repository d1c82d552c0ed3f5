"""K concurrent Tinker RL tenants through one `lorafleet serve`, on CPU with the tiny world (issue 41 item 6).

One `lorafleet serve` (a subprocess, as an operator starts it: Ray, one trainer rank with S slots, E
SGLang CPU engines, the coordinator and its API front) with the Tinker API on. One client process runs
the tenants: each is a Tinker model of its own running the cookbook's RL loop with the official SDK
(benchmarks/tinker_rl_tenants.py: save_weights_and_get_sampling_client, a group of samples per prompt,
importance_sampling forward_backward, optim_step), all on one event loop. Tenants are added in phases
(K = 1, 16, 64, ... live at once; those of a phase go on in the next). A phase smaller than the one
before pauses the tenants past its K: each finishes the step it is in and unloads its model (so
--phases 64,1024,64 measures K = 64 on both sides of K = 1,024, and the large window's
ratio to each: the machine's drift between windows a quarter of an hour apart shows). After a phase's
warm-up (every new tenant finished a first step; after a pause, every active tenant finished a step
begun after it), for --window-s seconds:

  tenant-steps per minute   RL steps finished by all tenants (client side)
  sampled tokens per second tokens the engines generated for them (and per tenant-step: each sample runs to
                            --max-tokens past EOS, so a step's work is the same in every window; with
                            --stop-at-eos it drifts as the tenants train, and the rate with it)
  engine shares             each engine's share of the Tinker sample requests (/metrics
                            lorafleet_tinker_sample_requests_total{engine})
  adapter loads per step    sampler adapters loaded into the engines (all engines) per tenant-step
  room waits                sample requests that waited for adapter room, and those that waited
                            while an engine had room (must be 0) (/metrics, api/tinker/sampling/engines.py)
  p50 / p99 of each call    create, save_sampler, sample, forward_backward, optim_step, step (client side:
                            from sending to the future's result, waits for a slot included)
  coordinator memory        the coordinator's resident memory; per tenant: its growth over the phases
                            (and the trainer rank's, which holds the evicted models' slot states)
  client CPU                the client process's CPU time over the window (cores): what the client took
                            from the 2 cores the service also runs on; client_gc: its garbage collector's
                            seconds and passes by generation, and the objects it tracks (benchmarks/gc_time.py)
  cores by process          every process of the machine over the window, by role (benchmarks/proc_stats.py):
                            the coordinator (api.cli.main), its API front, the trainer, the engines, the client
  run-queue waits           each role's threads' time ready to run with no core free (thread-seconds a second,
                            /proc/<pid>/task/*/schedstat), and for the serial path's processes (coordinator,
                            trainer) and the client their three busiest threads' cores and waits: where contention fell
  loop                      the training loop's rounds, restores and evictions per tenant-step, the time of each
                            part of a round (place, gather and its gather_window, offer, train, settle, single), the models' snapshots per step and the loop's time taking each, and
                            the Tinker records' group commits (per step, statements each, mean time), the polls the
                            coordinator answered try again and the futures it announced to the API front (per step:
                            a queued call's repeat polls are held by the front, api/front/parked_polls.py) (/metrics)
  core speed                probe_ms: the median CPU time of a fixed unit of work timed through the window,
                            torch_probe_ms and mem_probe_ms: of a small torch unit and of random memory reads,
                            and the host's steal share
                            (benchmarks/speed_probe.py); the bracket's ratios are also given per unit of core
                            speed (speed_adjusted: rates times probe_ms)
  CPU a tenant-step         cpu_ms_per_step: every process's CPU (cores_by_process) over the window's steps

With --client-nice 10 the tenants' process yields the cores to the service's (on a real fleet the tenants
run on machines of their own); both ways are reported in docs/BENCHMARKS.md.

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_tinker_fleet --phases 1,16,64 --window-s 60      # a quick look
  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_tinker_fleet --phases 1,16,64,256,1024,4096 --out fleet2.json
  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_tinker_fleet --engines 1 --out fleet1.json
  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_tinker_fleet --phases 64,1024,64 --window-s 60 --warm-deadline-s 1500 --out bracket.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from benchmarks.proc_stats import autogroup_enabled, cores_by_role, cpu_by_pid, cpu_s, rss_mib, waits_by_pid, waits_by_role
from benchmarks.speed_probe import SpeedProbe
from benchmarks.gc_time import GcTime
from benchmarks.stack_profile import StackProfiles
from benchmarks.tinker_rl_tenants import Fleet, RlWorkload
from tests.integration.service_world import TOKEN, Service, serve_job

BASE = "model"  # the served base model's name: its folder's name (the tiny world's .cache/tiny/model)
SAMPLER_SERIES = {"requests": "lorafleet_tinker_sample_requests_total", "loads": "lorafleet_tinker_sampler_adapter_loads_total",
                  "unloads": "lorafleet_tinker_sampler_adapter_unloads_total",
                  "room_waits": "lorafleet_tinker_sample_room_waits_total",
                  "waits_with_room": "lorafleet_tinker_sample_waits_with_room_total"}


def sampler_counts(text: str) -> dict[str, dict[str, float]]:
    """Each SAMPLER_SERIES series of a /metrics page by engine label ("" when it has none)."""
    out: dict[str, dict[str, float]] = {k: {} for k in SAMPLER_SERIES}
    for key, name in SAMPLER_SERIES.items():
        for m in re.finditer(r"^" + re.escape(name) + r'(?:\{engine="([^"]*)"\})? (\S+)$', text, re.MULTILINE):
            out[key][m.group(1) or ""] = float(m.group(2))
    return out


SERIAL_PATH = ("api.cli.main", "ray::TrainWorker")  # the roles whose threads make a round: the loop, the trainer rank
THREAD_ROLES = SERIAL_PATH + ("benchmarks.bench_tinker_fleet",)  # and the tenants' client: its threads' share
LOOP_PARTS = ("place", "gather", "gather_window", "offer", "train", "settle", "single")  # lorafleet_coordinator_seconds{part}
LOOP_SERIES = {"rounds": "lorafleet_reconciles", **{f"{p}_s": f'lorafleet_coordinator_seconds{{part="{p}"}}' for p in LOOP_PARTS},
               "evictions": 'lorafleet_scheduler_events{event="evictions"}', "restores": 'lorafleet_scheduler_events{event="restores"}',
               "train_rounds": 'lorafleet_scheduler_events{event="rounds"}',
               "commits": "lorafleet_tinker_record_commits", "writes": "lorafleet_tinker_record_writes",
               "commit_s": "lorafleet_tinker_record_commit_seconds", "snapshots": "lorafleet_tinker_snapshots_taken",
               "snapshot_loop_s": "lorafleet_tinker_snapshot_loop_seconds",
               "try_again": "lorafleet_tinker_retrieve_try_again", "announced": "lorafleet_tinker_futures_announced"}


def loop_counts(text: str) -> dict[str, float]:
    """The training loop's and the records' counters of a /metrics page (LOOP_SERIES; 0 when absent)."""
    out = {}
    for key, series in LOOP_SERIES.items():
        m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.MULTILINE)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def loop_row(after: dict[str, float], before: dict[str, float], steps: int) -> dict[str, float | None]:
    """Per window: the loop's rounds and swaps per tenant-step, placement time per round, and the records'
    group commits (per step, statements each, mean time: the durable write every call's answer waits for)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    per_step = (lambda v: round(v / steps, 2)) if steps else (lambda v: None)
    return {"rounds_per_step": per_step(d["rounds"]), "train_rounds_per_step": per_step(d["train_rounds"]),
            "restores_per_step": per_step(d["restores"]),
            "evictions_per_step": per_step(d["evictions"]),
            "ms_per_round": {p: round(1000 * d[f"{p}_s"] / d["rounds"], 2) for p in LOOP_PARTS} if d["rounds"] else None,
            "snapshots_per_step": per_step(d["snapshots"]),
            "snapshot_loop_ms": round(1000 * d["snapshot_loop_s"] / d["snapshots"], 2) if d["snapshots"] else None,
            "coordinator_try_agains_per_step": per_step(d["try_again"]), "announced_per_step": per_step(d["announced"]),
            "commits_per_step": per_step(d["commits"]),
            "writes_per_commit": round(d["writes"] / d["commits"], 1) if d["commits"] else None,
            "commit_ms_mean": round(1000 * d["commit_s"] / d["commits"], 2) if d["commits"] else None}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def tinker_job(tmp: Path, tiny: Path, slots: int, engines: int, keys: dict[str, str], loaded_per_engine: int,
               window_ms: float | None = None) -> Path:
    """The tiny job without adapters: `slots` trainer slots, `engines` SGLang CPU engines, each with room
    for `loaded_per_engine` Tinker sampler adapters beside the runs' (api/tinker/fleet.py sampler_capacity);
    `window_ms`: the service's `tinker_window_ms` (None: its default)."""
    service = {"tinker_max_seq_len": 128, **({} if window_ms is None else {"tinker_window_ms": window_ms})}
    path = serve_job(tmp, tiny, slots={"num_slots": slots, "max_rank": 8, "turn_steps": 4, "evict_idle_s": 30.0},
                     engines={"max_loaded_loras": loaded_per_engine + 2 * slots}, keys=keys, service=service)
    job = yaml.safe_load(path.read_text())
    job["placement"]["engines"]["count"] = engines
    path.write_text(yaml.safe_dump(job))
    return path


async def measure(fleet: Fleet, svc: Service, http: httpx.AsyncClient, seconds: float, phase_start: float,
                  gc_time: GcTime, profile: Path | None = None, label: str = "") -> dict:
    """One window: the fleet's steps and tokens, the sampler's counts, the calls' latencies; with
    `profile`, the stacks of the tenants' process, the coordinator, the trainer rank(s) and the SGLang
    schedulers over the window (benchmarks/stack_profile.py), written to `profile`/`label`-<process>.txt."""
    probe = SpeedProbe().start()
    if profile is not None:
        trainers = [p["pid"] for p in (await http.get("/v1/fleet")).json()["processes"] if p["role"] == "trainer"]
        schedulers = sorted(pid for pid, (name, _) in cpu_by_pid().items() if name == "sglang::scheduler")
        StackProfiles(profile, label, {"client": os.getpid(), "coordinator": svc.proc.pid,
                                       **{f"trainer{i}": pid for i, pid in enumerate(trainers)},
                                       **{f"engine{i}": pid for i, pid in enumerate(schedulers)}}, seconds)
    m0, cpu0, procs0, waits0, t0 = (await http.get("/metrics")).text, cpu_s(os.getpid()), cpu_by_pid(), waits_by_pid(), time.monotonic()
    gc0 = gc_time.read()
    await asyncio.sleep(seconds)
    gc1 = gc_time.read()
    m1, cpu1, procs1, waits1, t1 = (await http.get("/metrics")).text, cpu_s(os.getpid()), cpu_by_pid(), waits_by_pid(), time.monotonic()
    speed = probe.stop()
    c0, c1 = sampler_counts(m0), sampler_counts(m1)
    calls = fleet.log.window(t0, t1, creates_since=phase_start)
    minutes = (t1 - t0) / 60
    cores = cores_by_role(procs0, procs1, t1 - t0)
    per_engine = _delta(c1["requests"], c0["requests"])
    total = sum(per_engine.values())
    loads = sum(_delta(c1["loads"], c0["loads"]).values())
    return {"seconds": round(t1 - t0, 1), "tenant_steps": calls["steps"],
            "tenant_steps_per_min": round(calls["steps"] / minutes, 1),
            "sampled_tokens_per_s": round(calls["sampled_tokens"] / (t1 - t0), 1),
            "sampled_tokens_per_step": round(calls["sampled_tokens"] / calls["steps"], 1) if calls["steps"] else None,
            "sample_requests": total, "engine_shares": {e: round(n / total, 3) for e, n in sorted(per_engine.items())} if total else {},
            "adapter_loads_per_step": round(loads / calls["steps"], 2) if calls["steps"] else None,
            "adapter_unloads": sum(_delta(c1["unloads"], c0["unloads"]).values()),
            "room_waits": sum(_delta(c1["room_waits"], c0["room_waits"]).values()),
            "waits_with_room": sum(_delta(c1["waits_with_room"], c0["waits_with_room"]).values()),
            "client_cores": round((cpu1 - cpu0) / (t1 - t0), 2), "client_gc": GcTime.between(gc0, gc1), **speed,
            "cores_by_process": cores,
            "cpu_ms_per_step": round(1e3 * sum(cores.values()) * (t1 - t0) / calls["steps"], 1) if calls["steps"] else None,
            "run_queue_waits": waits_by_role(waits0, waits1, t1 - t0, roles=THREAD_ROLES),
            "coordinator_rss_mib": round(rss_mib(svc.proc.pid), 1),
            "trainer_rss_mib": round(sum(rss_mib(p["pid"]) for p in (await http.get("/v1/fleet")).json()["processes"]
                                         if p["role"] == "trainer"), 1),
            "loop": loop_row(loop_counts(m1), loop_counts(m0), calls["steps"]),
            "latency_ms": {k: {q: round(v, 1) for q, v in calls[k].items()} for k in calls if k.endswith("_ms")}}


async def run_phases(svc: Service, keys: list[str], work: RlWorkload, phases: list[int], window_s: float,
                     warm_deadline_s: float, dump: Callable[[list[dict]], None] | None = None,
                     profile: Path | None = None, client_gc_freeze: bool = False) -> list[dict]:
    fleet = Fleet(svc.url, keys, BASE, work)
    gc_time = GcTime()  # the tenants' process's garbage collections (client_gc), while the phases run
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=svc.url, timeout=120, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        rss0 = rss_mib(svc.proc.pid)
        try:
            for k in phases:
                t0 = time.monotonic()
                row = await (shrink_to(fleet, k, warm_deadline_s) if k < len(fleet.active()) else grow_to(fleet, k, warm_deadline_s))
                warm = "stopped" not in row
                row["models"] = len(fleet.active())  # the paused ones unloaded theirs
                if client_gc_freeze:  # --client-gc-freeze: outside the window
                    gc.collect()
                    gc.freeze()
                row.update(await measure(fleet, svc, http, window_s, t0, gc_time, profile, f"{len(rows)}-k{k}"))
                row["coordinator_rss_mib_at_start"] = round(rss0, 1)
                row["errors"] = list(fleet.log.errors)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if dump is not None:  # an interrupted run keeps its phases
                    dump(rows)
                if not warm or fleet.log.errors:
                    break
        finally:
            gc_time.close()
            await fleet.stop()
    base = rows[0] if rows else None
    for r in rows[1:]:
        if r["models"] > base["models"]:
            r["coordinator_kib_per_tenant"] = round(1024 * (r["coordinator_rss_mib"] - base["coordinator_rss_mib"])
                                                    / (r["models"] - base["models"]), 1)
    bracket(rows)
    return rows


async def grow_to(fleet: Fleet, k: int, deadline_s: float) -> dict:
    """Start tenants until ``k`` are active; the warm-up: until each new one finished a step."""
    t0, new = time.monotonic(), fleet.grow(len(fleet.tenants) + k - len(fleet.active()))
    warm = await fleet.until_stepped(new, deadline_s)
    row = {"tenants": k, "warm_s": round(time.monotonic() - t0, 1), "all_stepped": warm,
           "not_yet_stepped": sum(1 for t in new if t.steps == 0)}
    if not warm:
        row["stopped"] = f"{row['not_yet_stepped']} of {len(new)} new tenants had no step after {deadline_s:.0f} s"
    return row


async def shrink_to(fleet: Fleet, k: int, deadline_s: float) -> dict:
    """Pause the active tenants past the first ``k`` (Fleet.shrink: each finishes its step and unloads
    its model); then the settling: until each of the ``k`` finished a step begun after that."""
    t0, paused = time.monotonic(), len(fleet.active()) - k
    late = await fleet.shrink(k, deadline_s)
    row = {"tenants": k, "paused": paused, "drain_s": round(time.monotonic() - t0, 1), "not_drained": len(late)}
    if late:
        row["stopped"] = f"{len(late)} of {paused} paused tenants were still in a step after {deadline_s:.0f} s"
        return row
    t1, active = time.monotonic(), fleet.active()
    settled = await fleet.until_stepped(active, deadline_s, more_than={t.index: t.steps + 1 for t in active})
    row["warm_s"] = round(time.monotonic() - t1, 1)
    if not settled:
        row["stopped"] = f"the {k} active tenants had not all finished two steps {deadline_s:.0f} s after the drain"
    return row


def bracket(rows: list[dict]) -> None:
    """A window of K tenants measured between two windows of fewer (phases such as 64,1024,64) gets its
    rate's ratio to each of them and to their mean: the machine's drift between the windows shows as the
    two small windows' difference, instead of passing for the large K's cost."""
    for before, big, after in zip(rows, rows[1:], rows[2:]):
        if before["tenants"] == after["tenants"] < big["tenants"] and before["tenant_steps_per_min"] and after["tenant_steps_per_min"]:
            rate, lo, hi = big["tenant_steps_per_min"], before["tenant_steps_per_min"], after["tenant_steps_per_min"]
            big["ratio_to_smaller"] = {"k": before["tenants"], "before": round(rate / lo, 3), "after": round(rate / hi, 3),
                                       "mean": round(rate / ((lo + hi) / 2), 3)}
            probes = [r.get("probe_ms") for r in (before, big, after)]
            if all(probes):  # the same ratios per unit of core speed (benchmarks/speed_probe.py)
                lo_s, rate_s, hi_s = (r * p for r, p in zip((lo, rate, hi), probes))
                big["ratio_to_smaller"]["speed_adjusted"] = {"before": round(rate_s / lo_s, 3), "after": round(rate_s / hi_s, 3),
                                                             "mean": round(rate_s / ((lo_s + hi_s) / 2), 3)}
            print(json.dumps({"bracket": big["ratio_to_smaller"], "rates": [lo, rate, hi], "probe_ms": probes}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--loaded-per-engine", type=int, default=8, help="Tinker sampler adapters each engine keeps loaded")
    ap.add_argument("--phases", default="1,16,64,256,1024,4096", help="tenants active at once; a K smaller than the one before pauses the rest")
    ap.add_argument("--window-s", type=float, default=120.0)
    ap.add_argument("--warm-deadline-s", type=float, default=3600.0, help="a phase stops the benchmark when its new tenants have not all stepped by then")
    ap.add_argument("--keys", type=int, default=4, help="tenant keys (one ServiceClient, one session each)")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="samples stop at EOS (before 2026-12-07's eighteenth session, every run did): their length then drifts "
                         "as the tenants train, and a window's rate with it; by default each runs to --max-tokens (stop=[])")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="run the tenants (this process, once the service is up) at this niceness: 10 lets the "
                         "service's processes go first on the shared cores, as if the clients had machines of their own")
    ap.add_argument("--service-session", choices=("own", "shared"), default="own",
                    help="own: the service leads a session of its own, as under systemd (Linux's autogroup scheduler, "
                         "where on, then shares the cores between it and the tenants' process first); shared: the "
                         "service stays in this process's session (every bracket before 2026-12-07's G2)")
    ap.add_argument("--client-gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="before each window, collect the tenants' process once and leave what it holds out of later "
                         "collections (gc.freeze): one interpreter holding a thousand tenants' SDK clients paid 1.8 s more a "
                         "minute in the collector's passes than with 64 (client_gc), which a tenant's own process would not; "
                         "--no-client-gc-freeze: every run before 2026-12-07's nineteenth session")
    ap.add_argument("--tinker-window-ms", type=float, default=None,
                    help="the service's tinker_window_ms (how long a round waits for more models' calls); default: the service's")
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="record each window's Python stacks (py-spy, not pausing the processes) of the tenants' process, "
                         "the coordinator, the trainer and the SGLang schedulers into this folder; read with python -m benchmarks.stack_profile FILE. "
                         "py-spy takes 0.2-0.6 of a core itself (more at K = 1,024: the trainer's memory is large): "
                         "a profiled run's rates are not comparable with others'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.getLogger("tinker").setLevel(logging.ERROR)  # the SDK warns at every try_again of a long poll
    from examples.tiny.build import ensure_tiny_world
    from service.fleet.engine_pids import reap_engines

    tiny = ensure_tiny_world()
    keys = {f"t{i}": f"tml-fleet-bench-{i:02d}-key" for i in range(args.keys)}
    work = RlWorkload.from_tiny_world(tiny, prompts_per_step=args.prompts_per_step, group=args.group, max_tokens=args.max_tokens,
                                      to_max_tokens=not args.stop_at_eos)
    with tempfile.TemporaryDirectory(prefix="bench-tinker-fleet-") as d:
        tmp = Path(d)
        svc = Service(tinker_job(tmp, tiny, args.slots, args.engines, keys, args.loaded_per_engine, args.tinker_window_ms), tmp / "state", tmp / "serve.log")
        try:
            t0 = time.monotonic()
            svc.start(new_session=args.service_session == "own")
            print(f"service up in {time.monotonic() - t0:.0f} s", flush=True)
            if args.client_nice:
                os.nice(args.client_nice)  # after the service's processes started: they keep niceness 0
            phases = [int(x) for x in args.phases.split(",") if x]
            head = {"slots": args.slots, "engines": args.engines, "loaded_per_engine": args.loaded_per_engine, "client_nice": args.client_nice, "tinker_window_ms": args.tinker_window_ms,
                    "client_gc_freeze": args.client_gc_freeze,
                    "service_session": args.service_session, "autogroup": autogroup_enabled(),
                    "workload": {"prompts_per_step": work.prompts_per_step, "group": work.group, "max_tokens": work.max_tokens,
                                 "to_max_tokens": work.to_max_tokens}}

            def dump(rows: list[dict]) -> None:
                if args.out:
                    Path(args.out).write_text(json.dumps({**head, "phases": rows}, indent=2))

            dump(asyncio.run(run_phases(svc, list(keys.values()), work, phases, args.window_s, args.warm_deadline_s, dump,
                                        args.profile_dir, client_gc_freeze=args.client_gc_freeze)))
        finally:
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.kill()
            reap_engines(svc.state_dir)


if __name__ == "__main__":
    main()
