"""The Tinker records' group commits are counted for /metrics (service/registry/tinker_records.py, api/tinker/
metrics.py): every statement queued is counted once in a commit, commits never outnumber statements, and
their time adds up; the three series are on the rendered page. Real SQLite."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from api.tinker.metrics import add_tinker_gauges
from service.registry.tinker_records import TinkerRecords

pytestmark = pytest.mark.unit


def test_group_commits_count_every_statement_once_and_their_time(tmp_path):
    records = TinkerRecords(tmp_path / "records.sqlite")
    try:
        before = (records.commits, records.committed_writes, records.commit_seconds)
        for i in range(50):
            records.write("UPDATE tinker_counters SET value = value WHERE name = ?", ("seq",))
        records.flush()  # one more statement (SELECT 1), waited for
        commits, writes, seconds = records.commits - before[0], records.committed_writes - before[1], records.commit_seconds - before[2]
        assert writes == 51
        assert 1 <= commits <= writes
        assert seconds > 0.0
    finally:
        records.close()


def test_the_commit_series_are_on_the_metrics_page():
    registry = CollectorRegistry()
    add_tinker_gauges(registry, {"record_commits": 7, "record_writes": 40, "record_commit_seconds": 0.25})
    text = generate_latest(registry).decode()
    for line in ("lorafleet_tinker_record_commits 7.0", "lorafleet_tinker_record_writes 40.0",
                 "lorafleet_tinker_record_commit_seconds 0.25"):
        assert line in text, line
