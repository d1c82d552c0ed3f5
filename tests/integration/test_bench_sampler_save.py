"""benchmarks/bench_sampler_save.py runs end to end (the real trainer of the tiny world in its own
process) and writes both kinds of save, with the writer beside them, and leaves no folder behind. No
timing is asserted (timings live in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.service_world import REPO

pytestmark = pytest.mark.integration


def test_the_sampler_save_benchmark_times_both_kinds_beside_a_writer(tmp_path):
    out = tmp_path / "saves.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_sampler_save", "--saves", "3", "--beside-mib", "1",
                           "--store-dir", str(tmp_path), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["beside_mib"] == 1 and got["beside_files"] >= 1
    for kind in ("durable", "ephemeral"):
        assert got[kind]["n"] == 3 and len(got["all_ms"][kind]) == 3 and 0 < got[kind]["p50_ms"] <= got[kind]["p90_ms"]
    assert not list(tmp_path.glob("tmp*"))  # its store's folder is gone
