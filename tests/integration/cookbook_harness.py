"""How tests/integration/test_cookbook_recipes.py runs a cookbook recipe and reads what it did.

A recipe runs as a user's shell runs it: ``python -m <its module> key=value ...`` in a process of
its own whose environment holds the key (TINKER_API_KEY, and TINKER_BASE_URL for the recipes
without a ``base_url`` option), the tiny world's hub cache (the base model under its served
name) and the test's datasets cache (tests/integration/cookbook_datasets.py), offline; nothing
else of the test process. What it did is read back from its own log folder (metrics.jsonl,
checkpoints.jsonl) and from the service's /metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.integration.cookbook_table import Verified, command_of
from tests.integration.service_world import REPO, prometheus_text

RECIPE_TIMEOUT_S = 600


@dataclass
class Run:
    """A finished recipe process: its output, arguments and wall time."""

    args: list[str]
    out: str
    seconds: float
    rc: int

    def row(self, recipe: str, loss: str, steps: int, metric: str) -> Verified:
        return Verified(recipe, command_of(self.args), loss, steps, metric, self.seconds)


def client_env(hf: dict[str, str], key: str, base_url: str) -> dict[str, str]:
    """A user's shell: this process's environment without HF_/TINKER_ settings, plus the hub caches ``hf``,
    the key and the service URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(hf, TINKER_API_KEY=key, TINKER_BASE_URL=base_url, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    return env


def run_recipe(env: dict[str, str], cwd: Path, args: list[str], *, expect_rc: int | None = 0) -> Run:
    """``python <args>`` in ``cwd`` under ``env``; fails with the output's tail unless it exits ``expect_rc``
    (None: any exit status, the caller reads ``Run.rc``)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RECIPE_TIMEOUT_S, check=False)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert expect_rc is None or proc.returncode == expect_rc, f"{args[:2]} exited {proc.returncode}:\n{out[-6000:]}"
    return Run(args, out, seconds, proc.returncode)


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(log_path: Path, key: str) -> list[float]:
    """``key``'s value at each logged step that has it, in order."""
    return [m[key] for m in metrics(log_path) if key in m]


def checkpoint_records(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def falls(values: list[float], by: float, n: int = 3) -> bool:
    """The mean of the last ``n`` values lies more than ``by`` below the mean of the first ``n``."""
    return mean(values[-n:]) < mean(values[:n]) - by


def tinker_counters(service) -> dict[str, float]:
    """The service's Tinker counters on /metrics: stable_reinforce's statistics and the sample requests
    (summed over the engines)."""
    out: dict[str, float] = {}
    with service.client() as c:
        for line in prometheus_text(c).splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("lorafleet_tinker_stable_reinforce_") and name.endswith("_total"):
                out[name[len("lorafleet_tinker_stable_reinforce_"):-len("_total")]] = float(value)
            elif name.startswith("lorafleet_tinker_sample_requests_total{"):
                out["sample_requests"] = out.get("sample_requests", 0.0) + float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def stable_reinforce_metric(d: dict) -> str:
    """The table's cell for a recipe whose reward the tiny world cannot earn: the objective's statistics."""
    ratio = d["ratio_sum"] / d["sampled_tokens"] if d.get("sampled_tokens") else float("nan")
    return (f"stable_reinforce: {d.get('calls', 0):.0f} calls, {d.get('sequences', 0):.0f} sequences recorded and "
            f"trained on, {d.get('masked_sequences', 0):.0f} masked, trainer/sampler ratio {ratio:.6f}")
