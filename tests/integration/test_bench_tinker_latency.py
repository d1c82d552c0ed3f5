"""benchmarks/bench_tinker_latency.py runs end to end (the fleet as `lorafleet serve` starts it, in its
own process: Ray, one trainer rank, one SGLang CPU engine, the loop on a thread) and writes both rows.
It is the measure behind docs/BENCHMARKS.md's "Tinker call latency" row and had broken unnoticed
when the models became durable; no timing is asserted here (timings live in the benchmark's table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.service_world import REPO

pytestmark = pytest.mark.integration


def test_the_latency_benchmark_measures_an_idle_and_a_busy_loop(tmp_path):
    out = tmp_path / "latency.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # not TMPDIR: Ray's socket paths must stay short
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_tinker_latency", "--calls", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(rows) == ["busy loop (an SFT run training)", "idle loop"]
    for row in rows.values():
        assert row["calls"] == 2 and 0 < row["median_ms"] <= row["max_ms"]
    assert rows["busy loop (an SFT run training)"]["sft_step_s"] > 0
