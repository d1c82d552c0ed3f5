"""More tenants than slots on a live service (issue 15): one `lorafleet serve` with 2 trainer slots
(turns of 2 steps, idle eviction after 3 s), reached over REST, shared by this module's tests.
Real everything (Ray, one SGLang CPU server, the trainer rank, the rollout worker, SQLite).

* tenants coming and going: registrations beyond the slots queue (201, queue_position), take
  turns, and all end COMPLETED with every step recorded once; a queued run retired before it
  trained completes with no export and leaves the queue.
The load test (40 registrations against 4 slots) is test_service_oversub_load.py."""

from __future__ import annotations

import pytest

from tests.integration.service_world import prometheus_text, rl, running_service, sft, wait_for

# Opt-in (-m slow, CI budget: 130 s on 2 cores, most of it its own service's start). In the default
# tier, test_service_scale.py covers the same on its shared service: 256 tenants queue, take turns and
# all finish with each step once, and a run retired while queued ends with no export.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOTS = {"num_slots": 2, "max_rank": 8, "turn_steps": 2, "evict_idle_s": 3.0, "max_live_runs": 48}
DONE_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("oversub"), tiny_world, slots=SLOTS) as svc:
        yield svc


def _completed_all_steps(client, name: str, num_step: int) -> dict:
    ref = wait_for(client, name, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
    steps = [s["step"] for s in client.metrics(name)["steps"]]
    assert ref["step"] == num_step and steps == list(range(1, num_step + 1)), (name, ref["step"], steps)
    assert ref["slot"] is None and ref["queue_position"] is None
    return ref


def test_tenants_come_and_go_through_two_slots(service, tiny_world):
    data = tiny_world
    with service.client() as c:
        c.register("rl_a", rl(data, num_step=6))
        c.register("sft_b", sft(data, num_step=6))
        queued = c.register("sft_c", sft(data, num_step=4))
        assert (queued["state"], queued["slot"], queued["residency"]) == ("PENDING", None, "queued")
        assert queued["queue_position"] == 1
        never = c.register("never", sft(data, num_step=4))
        assert never["queue_position"] in (1, 2)  # sft_c may have left the queue already
        c.retire("never")
        gone = wait_for(c, "never", lambda r: r["state"] == "COMPLETED", "COMPLETED")
        if gone["step"] == 0:  # retired while still queued: nothing to export
            assert gone["export_path"] is None
        # sft_c gets a turn although both first tenants still have steps to take
        wait_for(c, "sft_c", lambda r: r["step"] >= 1, "a first step", timeout_s=DONE_TIMEOUT_S)
        c.register("rl_d", rl(data, num_step=4))  # comes while the others train
        for name, n in (("rl_a", 6), ("sft_b", 6), ("sft_c", 4), ("rl_d", 4)):
            _completed_all_steps(c, name, n)
        text = prometheus_text(c)
        assert 'lorafleet_adapters_residency{residency="queued"} 0.0' in text
        assert "lorafleet_adapter_swap_out_seconds{" in text and "lorafleet_adapter_swap_in_seconds{" in text
        assert c.ready()["slots"]["free"] == 2
