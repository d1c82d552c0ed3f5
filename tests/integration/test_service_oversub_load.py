"""The load test of issue 15 on a live service: 40 short registrations against 4 trainer slots
from 8 threads (one `lorafleet serve` for this module; real Ray, SGLang CPU server, trainer
rank, rollout worker and SQLite). Every registration answers 201 (no 5xx, none refused: the
bound is above 40), none is lost (all listed), all end COMPLETED with each of their steps
recorded once, and no slot leaks (all 4 free at the end, no resident or queued run left).
Short SFT runs (2 steps of 2 rows) keep it cheap; turns of 1 step keep the queue moving."""

from __future__ import annotations

import pytest

from tests.integration.service_world import TOKEN, prometheus_text, register_from_threads, running_service, sft, wait_for

# Opt-in (-m slow): test_service_scale.py runs the same kind of load bigger in the default tier (256
# tenants through 4 slots from client threads, none lost, slots back to free); this one stays for
# the 40-run figure of issue 15.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOTS = {"num_slots": 4, "max_rank": 8, "turn_steps": 1, "evict_idle_s": 3.0, "max_live_runs": 48}
RUNS, THREADS, STEPS = 40, 8, 2
DONE_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("oversub_load"), tiny_world, slots=SLOTS) as svc:
        yield svc


def test_forty_registrations_against_four_slots_from_eight_threads(service, tiny_world):
    names = [f"load{i:02d}" for i in range(RUNS)]
    statuses = register_from_threads(service.url, lambda _: TOKEN, {n: sft(tiny_world, num_step=STEPS, prompts_per_step=2)
                                                                    for n in names}, THREADS)
    assert statuses == {201: RUNS}, statuses
    with service.client() as c:
        listed = {a["name"] for a in c.list()}
        assert set(names) <= listed  # none lost
        for name in names:
            ref = wait_for(c, name, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
            steps = [s["step"] for s in c.metrics(name)["steps"]]
            assert ref["step"] == STEPS and steps == list(range(1, STEPS + 1)), (name, ref["step"], steps)
            assert ref["slot"] is None and ref["queue_position"] is None
        assert c.ready()["slots"]["free"] == SLOTS["num_slots"]  # no slot leaked
        assert all(a["state"] == "COMPLETED" for a in c.list() if a["name"] in names)
        text = prometheus_text(c)
        for where in ("resident", "queued", "evicted"):
            assert f'lorafleet_adapters_residency{{residency="{where}"}} 0.0' in text, where
