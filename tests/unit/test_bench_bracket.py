"""The Tinker fleet benchmark's reading of its windows: the bracket's ratios (raw and per unit of core
speed) and the core-speed probe (benchmarks/bench_tinker_fleet.py bracket, benchmarks/speed_probe.py)."""

from __future__ import annotations

import statistics

from benchmarks.bench_tinker_fleet import bracket
from benchmarks.speed_probe import SpeedProbe


def test_bracket_ratios_raw_and_per_unit_of_core_speed():
    # K = 1,024 at 300 a minute between K = 64 at 400 (cores at 10 ms a unit) and 500 (8 ms: faster cores)
    rows = [{"tenants": 64, "tenant_steps_per_min": 400.0, "probe_ms": 10.0},
            {"tenants": 1024, "tenant_steps_per_min": 300.0, "probe_ms": 12.0},
            {"tenants": 64, "tenant_steps_per_min": 500.0, "probe_ms": 8.0}]
    bracket(rows)
    r = rows[1]["ratio_to_smaller"]
    assert (r["k"], r["before"], r["after"], r["mean"]) == (64, 0.75, 0.6, round(300 / 450, 3))
    # per unit of speed: 300 * 12 = 3600 against 400 * 10 = 4000 and 500 * 8 = 4000
    assert r["speed_adjusted"] == {"before": 0.9, "after": 0.9, "mean": 0.9}
    assert "ratio_to_smaller" not in rows[0] and "ratio_to_smaller" not in rows[2]


def test_bracket_without_a_probe_reading_gives_the_raw_ratios_only():
    rows = [{"tenants": 64, "tenant_steps_per_min": 400.0, "probe_ms": None},
            {"tenants": 1024, "tenant_steps_per_min": 300.0, "probe_ms": 12.0},
            {"tenants": 64, "tenant_steps_per_min": 400.0, "probe_ms": 10.0}]
    bracket(rows)
    assert rows[1]["ratio_to_smaller"] == {"k": 64, "before": 0.75, "after": 0.75, "mean": 0.75}


def test_phases_that_do_not_bracket_get_no_ratio():
    rows = [{"tenants": 16, "tenant_steps_per_min": 400.0}, {"tenants": 64, "tenant_steps_per_min": 300.0},
            {"tenants": 256, "tenant_steps_per_min": 200.0}]
    bracket(rows)
    assert all("ratio_to_smaller" not in r for r in rows)


def test_the_speed_probe_times_its_unit_and_stops():
    probe = SpeedProbe(period_s=0.05).start()
    with probe.sampled:
        assert probe.sampled.wait_for(lambda: len(probe.samples) >= 3, timeout=60), \
            f"the probe timed {len(probe.samples)} units in 60 s (child exit code {probe.proc.poll()})"
    assert probe.proc.poll() is None, "the probe child ended"
    reading = probe.stop()
    assert probe.proc.poll() is not None  # the child is gone
    assert reading["probe_n"] >= 3 and reading["probe_ms"] > 0
    assert reading["steal_frac"] is None or 0 <= reading["steal_frac"] <= 1
    assert reading["probe_ms"] == round(statistics.median(probe.samples), 2)
    assert reading["torch_probe_ms"] == round(statistics.median(probe.torch_samples), 2) > 0
    assert reading["mem_probe_ms"] == round(statistics.median(probe.mem_samples), 2) > 0
    assert len(probe.torch_samples) == len(probe.mem_samples) == len(probe.samples)


def test_the_torch_unit_is_the_same_work_every_time():
    """The torch unit trains nothing (gradients cleared, no step), so each call computes the same loss."""
    from benchmarks.speed_probe import torch_model, torch_unit

    parts = torch_model(seed=3)
    first = torch_unit(parts)
    assert first > 0 and torch_unit(parts) == first == torch_unit(torch_model(seed=3))


def test_the_memory_unit_reads_its_fixed_indices():
    """The memory unit's work is the same every time: its buffer holds 0..n-1, so the sum it reads is the
    sum of its fixed indices."""
    from benchmarks.speed_probe import MEM_READS, MEM_WORDS, mem_buffers, mem_unit

    buffers = mem_buffers(seed=3)
    buf, idx = buffers
    assert buf.nbytes == 8 * MEM_WORDS and len(idx) == MEM_READS and 0 <= idx.min() and idx.max() < MEM_WORDS
    assert mem_unit(buffers) == int(idx.sum()) == mem_unit(mem_buffers(seed=3))
