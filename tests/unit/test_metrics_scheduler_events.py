"""/metrics `lorafleet_scheduler_events{event}` (api/metrics.py render_prometheus): each scheduler counter it
names, `rounds` (the loop's passes that made a trainer call) among them, read from the snapshot's
`scheduler_counters`, so `lorafleet_reconciles - rounds` is the passes that trained nothing."""

from __future__ import annotations

import re

from api.metrics import render_prometheus
from service.control.controller import MetricsSnapshot


def test_scheduler_events_include_the_trainer_rounds_beside_every_pass():
    counters = {"evictions": 3, "restores": 4, "prefetches": 5, "placements": 11, "rounds": 7, "mixed_steps": 6}
    body, _ = render_prometheus(MetricsSnapshot(adapters=[], num_slots=4, free_slots=1, runtime=None,
                                                scheduler_counters=counters, reconciles=11))
    text = body.decode()
    got = {m.group(1): float(m.group(2)) for m in re.finditer(r'^lorafleet_scheduler_events\{event="(\w+)"\} (\S+)$', text, re.M)}
    assert got == {"evictions": 3, "restores": 4, "prefetches": 5, "placements": 11, "rounds": 7}, got
    assert re.search(r"^lorafleet_reconciles 11(\.0)?$", text, re.M), text
