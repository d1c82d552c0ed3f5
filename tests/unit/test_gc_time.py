"""The benchmarks' garbage-collector clock (benchmarks/gc_time.py GcTime): what Python's collector did
between two readings, by generation."""

from __future__ import annotations

import gc

import pytest

from benchmarks.gc_time import GcTime

pytestmark = pytest.mark.unit


def test_a_full_collection_between_two_readings_is_counted_and_timed_as_generation_2():
    clock = GcTime()
    try:
        before = clock.read()
        cycles = []
        for i in range(20000):  # objects the collector must walk: lists that hold themselves
            x = [i]
            x.append(x)
            cycles.append(x)
        del cycles, x
        gc.collect(2)
        gc.collect(0)
        got = GcTime.between(before, clock.read())
    finally:
        clock.close()
    assert got["collections"][2] >= 1 and got["seconds"][2] > 0, got
    assert got["collections"][0] >= 1, got
    assert got["tracked_objects"] > 0
    assert clock._callback not in gc.callbacks  # closed: it no longer counts


def test_nothing_between_two_readings_with_no_collection_counts_nothing():
    clock = GcTime()
    try:
        gc.disable()
        a = clock.read()
        b = clock.read()
    finally:
        gc.enable()
        clock.close()
    assert GcTime.between(a, b)["collections"] == [0, 0, 0] and GcTime.between(a, b)["seconds"] == [0.0, 0.0, 0.0]
