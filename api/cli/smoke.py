"""`lorafleet smoke --api-url URL`: an end-to-end check of a running service.

Checks, in order, each with its own deadline (every request also has one):
  1. health   GET /health answers
  2. ready    GET /ready says ready (else: which component is down)
  3. register POST a test adapter -> 201 PENDING
  4. train    it reaches `steps` optimizer steps (progress bar; fails on FAILED,
              on no new step for `stall_s`, or after `train_timeout_s`)
  5. metrics  the per-step series has >= `steps` rows, strictly increasing steps,
              samples > 0 per step, finite values, and loss or reward that moves
  6. retire   DELETE -> 202 RETIRING
  7. complete it ends COMPLETED with an export path (fails on FAILED or timeout)
Any failure stops the run, retires the test adapter if it was registered (so
it does not keep a slot), prints the report and exits 1.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from api.cli.client import ApiError, ApiUnreachable, LorafleetClient


class SmokeFailure(Exception):
    pass


@dataclass
class SmokeOptions:
    api_url: str
    token: str | None
    steps: int = 3
    name: str | None = None
    config: dict[str, Any] | None = None  # full adapter config; default: a small RL run on `data`
    data: str | None = None  # server-side path of an RL prompt file (keys prompt, label)
    request_timeout_s: float = 10.0
    ready_timeout_s: float = 60.0
    train_timeout_s: float = 600.0
    stall_s: float = 180.0
    complete_timeout_s: float = 300.0
    poll_s: float = 1.0


@dataclass
class Check:
    name: str
    ok: bool
    seconds: float
    detail: str


@dataclass
class SmokeReport:
    adapter: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def table(self) -> Table:
        t = Table("CHECK", "RESULT", "SECONDS", "DETAIL", title=f"lorafleet smoke ({self.adapter})")
        for c in self.checks:
            t.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]FAILED[/red]", f"{c.seconds:.1f}", c.detail)
        return t


def default_config(data: str, steps: int) -> dict[str, Any]:
    # Trains a little past `steps` so the run is still ACTIVE when smoke retires it.
    return {
        "objective": "rl",
        "rank": 4,
        "alpha": 8,
        "learning_rate": 5e-3,
        "data": {"path": data},
        "reward": {"name": "target_share"},
        "prompts_per_step": 2,
        "sampling": {"n_samples_per_prompt": 4, "max_new_tokens": 16},
        "num_step": steps + 1000,
        "checkpoint_interval": 0,
    }


def default_data_path() -> str:
    """The embedded tiny world's digits prompts, as built on this machine."""
    from examples.tiny.build import tiny_dir

    return str(tiny_dir() / "data" / "digits.jsonl")


def run_smoke(opts: SmokeOptions, console: Console | None = None, sleep: Callable[[float], None] = time.sleep) -> SmokeReport:
    console = console or Console(stderr=True)
    name = opts.name or f"smoke-{uuid.uuid4().hex[:8]}"
    report = SmokeReport(adapter=name)
    registered = False
    with LorafleetClient(opts.api_url, opts.token, opts.request_timeout_s) as client:

        def check(label: str, fn: Callable[[], str]) -> None:
            t0 = time.monotonic()
            try:
                detail = fn()
            except (SmokeFailure, ApiError, ApiUnreachable) as e:
                report.checks.append(Check(label, False, time.monotonic() - t0, str(e)))
                raise SmokeFailure(str(e)) from None
            report.checks.append(Check(label, True, time.monotonic() - t0, detail))

        def health() -> str:
            return f"status {client.health()['status']}"

        def ready() -> str:
            deadline = time.monotonic() + opts.ready_timeout_s
            while True:
                body = client.ready()
                if body.get("ready"):
                    free = body.get("slots", {}).get("free")
                    if free == 0:
                        raise SmokeFailure("service is ready but has no free slot for the test adapter")
                    return f"{len(body['components'])} components ok, {free} free slot(s)"
                down = "; ".join(f"{k}: {v.get('detail') or 'down'}" for k, v in body.get("components", {}).items() if not v.get("ok"))
                if time.monotonic() > deadline:
                    raise SmokeFailure(f"service not ready after {opts.ready_timeout_s:g} s: {down}")
                sleep(opts.poll_s)

        def register() -> str:
            nonlocal registered
            config = opts.config or default_config(opts.data or default_data_path(), opts.steps)
            ref = client.register(name, config)
            registered = True
            return f"{ref['state']} in slot {ref['slot']}, registration {ref['registration_id'][:8]}"

        def train() -> str:
            return wait_for_steps(client, name, opts, console, sleep)

        def metrics() -> str:
            ref = client.get(name)  # first: the series fetched after it holds every step it counts
            return check_metrics(client.metrics(name), ref, opts.steps)

        def retire() -> str:
            return f"state {client.retire(name)['state']}"

        def complete() -> str:
            deadline = time.monotonic() + opts.complete_timeout_s
            while True:
                ref = client.get(name)
                if ref["state"] == "FAILED":
                    raise SmokeFailure(f"adapter FAILED while retiring: {ref.get('failure_reason')}")
                if ref["state"] == "COMPLETED":
                    if not ref.get("export_path"):
                        raise SmokeFailure("COMPLETED without an export path")
                    return f"COMPLETED at step {ref['step']}, export {ref['export_path']}"
                if time.monotonic() > deadline:
                    raise SmokeFailure(f"still {ref['state']} after {opts.complete_timeout_s:g} s")
                sleep(opts.poll_s)

        try:
            for label, fn in (("health", health), ("ready", ready), ("register", register), ("train", train),
                              ("metrics", metrics), ("retire", retire), ("complete", complete)):
                check(label, fn)
        except SmokeFailure:
            if registered and not any(c.name == "retire" and c.ok for c in report.checks):
                try:
                    client.retire(name)
                    report.checks.append(Check("cleanup", True, 0.0, f"retired the test adapter {name}"))
                except (ApiError, ApiUnreachable) as e:
                    report.checks.append(Check("cleanup", False, 0.0, f"could not retire {name}: {e}"))
    return report


def wait_for_steps(client: LorafleetClient, name: str, opts: SmokeOptions, console: Console, sleep: Callable[[float], None]) -> str:
    start = last_change = time.monotonic()
    last_step = -1
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task(f"training {name}", total=opts.steps, info="")
        while True:
            ref = client.get(name)
            if ref["state"] == "FAILED":
                raise SmokeFailure(f"adapter FAILED: {ref.get('failure_reason')}")
            if ref["state"] not in ("PENDING", "ACTIVE"):
                raise SmokeFailure(f"adapter left training early: state {ref['state']} at step {ref['step']}")
            now = time.monotonic()
            if ref["step"] != last_step:
                last_step, last_change = ref["step"], now
            progress.update(task, completed=min(ref["step"], opts.steps), info=f"{ref['state']} reward {ref.get('last_reward')}")
            if ref["step"] >= opts.steps:
                return f"{ref['step']} steps, {ref['samples_trained']} samples in {now - start:.1f} s"
            if now - last_change > opts.stall_s:
                raise SmokeFailure(f"no new step for {opts.stall_s:g} s (state {ref['state']}, step {ref['step']}): is the trainer running?")
            if now - start > opts.train_timeout_s:
                raise SmokeFailure(f"only {ref['step']} of {opts.steps} steps after {opts.train_timeout_s:g} s")
            sleep(opts.poll_s)


def check_metrics(series: dict[str, Any], ref: dict[str, Any], steps: int) -> str:
    rows = [r for r in series["steps"] if r["step"] <= ref["step"]]
    if len(rows) < steps:
        raise SmokeFailure(f"metrics series has {len(rows)} rows, expected >= {steps}")
    numbers = [r["step"] for r in rows]
    if numbers != sorted(set(numbers)):
        raise SmokeFailure(f"metrics steps are not strictly increasing: {numbers}")
    if any(r["samples"] <= 0 for r in rows):
        raise SmokeFailure("a step trained on 0 samples")
    if ref["samples_trained"] != sum(r["samples"] for r in rows):
        raise SmokeFailure(f"samples_trained {ref['samples_trained']} != sum of per-step samples {sum(r['samples'] for r in rows)}")
    moved = []
    for key in ("loss", "reward_mean"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if any(not math.isfinite(v) for v in values):
            raise SmokeFailure(f"non-finite {key} in the metrics series: {values}")
        if len(set(values)) > 1:
            moved.append(f"{key} {values[0]:.4g} -> {values[-1]:.4g}")
    if not moved:
        raise SmokeFailure("neither loss nor reward_mean changed across the steps: metrics do not move")
    return ", ".join(moved)
