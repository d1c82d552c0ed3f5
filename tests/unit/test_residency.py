"""The keep-warm / turns policy (service/scheduling/residency.py), rule by rule."""

from __future__ import annotations

import pytest

from service.scheduling.residency import Resident, ResidencyKnobs, choose_evictions

pytestmark = pytest.mark.unit

KNOBS = ResidencyKnobs(idle_evict_s=10.0, turn_steps=3)


def res(rid, *, idle_s=0.0, ready=True, steps_in=0, last_active=0.0):
    return Resident(rid, idle_s, ready, steps_in, last_active)


@pytest.mark.parametrize("residents, wanting, free, want", [
    # P1: nobody waits, or the free slots cover the waiters: nothing is evicted, however idle
    ([res("a", idle_s=99, ready=False, steps_in=9)], 0, 0, []),
    ([res("a", idle_s=99, ready=False, steps_in=9)], 1, 1, []),
    # P2: an idle resident (no ready step, quiet for the threshold) goes; a ready one does not
    ([res("a", idle_s=11, ready=False), res("b", idle_s=11, ready=True)], 1, 0, ["a"]),
    ([res("a", idle_s=9, ready=False)], 1, 0, []),  # not idle long enough, no turn used up
    # P2 before P3, least recently active first within each
    ([res("t", steps_in=5, last_active=1.0), res("i2", idle_s=20, ready=False, last_active=3.0),
      res("i1", idle_s=30, ready=False, last_active=2.0)], 3, 0, ["i1", "i2", "t"]),
    # P3: turns used up, least recently active first; P4: no more than the waiters beyond free slots
    ([res("a", steps_in=3, last_active=5.0), res("b", steps_in=4, last_active=4.0), res("c", steps_in=2)], 1, 0, ["b"]),
    ([res("a", steps_in=3, last_active=5.0), res("b", steps_in=4, last_active=4.0)], 3, 1, ["b", "a"]),
    # P4: a run that just came in is not evicted for a turn
    ([res("new", steps_in=0)], 1, 0, []),
])
def test_policy_rules(residents, wanting, free, want):
    assert choose_evictions(residents, wanting, free, KNOBS) == want


def test_rotation_gives_everyone_turns():
    """Simulate 5 always-ready runs through 2 slots with turn_steps=3: each round every resident
    steps once; the policy's evictions rotate the queue so every run gets a turn (none starves)."""
    queue = ["r0", "r1", "r2", "r3", "r4"]
    resident: dict[str, int] = {}  # id -> steps_in
    stepped = {r: 0 for r in queue}
    clock = 0.0
    last: dict[str, float] = {}
    longest_wait = {r: 0.0 for r in queue}  # rounds between two steps of a run (from round 0 for the first)
    last_step = {r: 0.0 for r in queue}
    for _ in range(40):
        clock += 1
        while len(resident) < 2 and queue:
            rid = queue.pop(0)
            resident[rid] = 0
            last[rid] = clock
        for rid in resident:
            resident[rid] += 1
            stepped[rid] += 1
            longest_wait[rid] = max(longest_wait[rid], clock - last_step[rid] - 1)
            last_step[rid] = clock
            last[rid] = clock
        out = choose_evictions([res(r, steps_in=s, last_active=last[r]) for r, s in resident.items()],
                               len(queue), 2 - len(resident), KNOBS)
        for rid in out:
            del resident[rid]
            queue.append(rid)
    assert max(longest_wait.values()) <= 6, longest_wait
    assert min(stepped.values()) >= 12, stepped  # 80 steps over 5 runs; none starves


def test_queue_place_is_shown_in_the_cli_and_the_progress_view():
    import io

    from rich.console import Console

    from api.cli.tenant_commands import adapters_table
    from service.config.adapter import AdapterConfig
    from service.loop.progress import ProgressView
    from service.registry.registry import AdapterRef, AdapterState

    cfg = AdapterConfig(data={"path": "/d/x.jsonl"}, reward={"name": "target_share"})
    queued = AdapterRef("waits", "r1", AdapterState.PENDING, None, 3, cfg, 30, 0, 0, None, {}, None, None, None, None,
                        0.0, 0.0, None, None, queue_position=2)
    evicted = AdapterRef("out", "r2", AdapterState.ACTIVE, None, 4, cfg, 30, 5, 40, 9, {}, None, None, None, None,
                         0.0, 0.0, 1.0, None, queue_position=1)
    assert (queued.residency, evicted.residency) == ("queued", "evicted")

    def text(table) -> str:
        out = io.StringIO()
        Console(file=out, width=200).print(table)
        return out.getvalue()

    view = text(ProgressView(Console(file=io.StringIO())).render([queued, evicted], now=1.0))
    assert "PENDING (queued #2)" in view and "ACTIVE (evicted #1)" in view
    rows = [{"name": r.name, "state": r.state.value, "slot": None, "queue_position": r.queue_position,
             "residency": r.residency, "step": r.step, "total_steps": 30} for r in (queued, evicted)]
    cli = text(adapters_table(rows))
    assert "queued #2" in cli and "evicted #1" in cli
