"""Keep-warm eviction of Tinker models (the scheduler's one policy, service/scheduling/residency.py) with the official SDK against
the Tinker routes on loopback, over an in-process trainer with ONE slot (tiny world, fp32 CPU).

The idle threshold is measured on a test-owned clock (``StepClock``: a number the test moves
forward), so "A has been idle for longer than the threshold" is a statement the test makes,
not a race with wall time. The swap is the trainer's real swap_out/swap_in.

* B's creation waits while A was called recently (its future answers try_again with why);
  once A is idle, B's creation evicts A; A's next forward_backward waits (try_again,
  paused_capacity, with the reason) until B is idle, then swaps A back in, evicting B;
  A's weights, gradients and Adam moments after its 4 steps equal an uninterrupted twin's
  EXACTLY (torch.equal).
* Unloading an evicted model forgets its snapshot and takes no slot.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.integration.sdk_clients import close_sdk_clients  # noqa: F401 - autouse fixture
from tests.integration.tinker_views import core, evicted, scheduler, slot_of, waiting
from tests.integration.test_tinker_sdk import BASE, KEYS, MAX_SEQ, client, sft_data, slot_state, train, training_client
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

IDLE_S = 60.0
ADAM = dict(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)


class StepClock:
    """A monotonic clock the test moves by hand (the scheduler's idle measure)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def idle_everyone(self) -> None:
        self.now += 10 * IDLE_S


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app

    clock = StepClock()
    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), tmp_path_factory.mktemp("ckpt"), num_slots=1,
                             max_rank=8, base_model=BASE, window_s=0.0, micro_batch_tokens=256, max_seq_len=MAX_SEQ,
                             idle_evict_s=IDLE_S, clock=clock)
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url, clock


def test_idle_model_evicted_and_returns_bit_exact(world, tiny_world):
    svc, url, clock = world
    twin = training_client(client(url, "t0"), seed=21)
    data = sft_data(twin.get_tokenizer(), tiny_world, 60, 4)
    train(twin, data, 4, ADAM)
    want = {k: v.clone() for k, v in slot_state(svc, twin.model_id).items()}
    assert core(svc).slots[slot_of(svc, twin.model_id)].step == 4
    svc.unload(twin.model_id)

    a = training_client(client(url, "t0"), seed=21)
    train(a, data, 2, ADAM)
    sc_b = client(url, "t1")
    with ThreadPoolExecutor(1) as pool:
        creating = pool.submit(training_client, sc_b, seed=5)  # A called just now: B's creation waits (E1)
        wait_until(lambda: len(waiting(svc)) == 1, "B's creation to wait for the slot", timeout_s=120.0)
        (b_id,) = waiting(svc)
        assert b_id != a.model_id and slot_of(svc, a.model_id) is not None and slot_of(svc, b_id) is None
        assert "waiting for a trainer slot" in next(m for m in svc.fleet.models() if m.key == b_id).waiting_reason
        clock.idle_everyone()
        b = creating.result(timeout=300)  # A idle: swapped out for B, whose creation then runs
    assert b.model_id == b_id
    assert evicted(svc) == {a.model_id} and slot_of(svc, b.model_id) is not None
    assert core(svc).swap.swapped()["keys"] == [a.model_id]
    train(b, sft_data(b.get_tokenizer(), tiny_world, 0, 3), 1, ADAM)

    fb = a.forward_backward(data, "cross_entropy")  # B was just called: A waits for the slot (E2)
    wait_until(lambda: a.model_id in waiting(svc), "A to wait for a slot", timeout_s=120.0)
    with httpx.Client(base_url=url + "/api/v1", timeout=60) as http:
        pending = [r for r, e in svc.futures._entries.items() if e.model_id == a.model_id and not e.done.done()]
        body = http.post("retrieve_future", headers={"X-API-Key": KEYS["t0"]}, json={"request_id": pending[0]}).json()
    assert body["type"] == "try_again" and body["queue_state"] == "paused_capacity", body
    assert "waiting for a trainer slot" in body["queue_state_reason"], body
    assert a.model_id in evicted(svc)

    clock.idle_everyone()  # now B is idle: the next placement brings A back, evicting B
    fb.result(timeout=120)
    from tinker import types

    a.optim_step(types.AdamParams(**ADAM)).result()
    train(a, data, 1, ADAM)
    assert evicted(svc) == {b.model_id}
    got = slot_state(svc, a.model_id)
    assert core(svc).slots[slot_of(svc, a.model_id)].step == 4
    diff = [k for k in want if not torch.equal(want[k], got[k])]
    assert not diff, f"evicted-and-restored A differs from its uninterrupted twin in {diff[:4]}"
    assert any(want[k].abs().max() > 0 for k in want if k.startswith("exp_avg_sq"))  # the moments were compared
    assert scheduler(svc).counters["evictions"] == 2 and scheduler(svc).counters["restores"] == 1
    m = svc.metrics()
    assert m["models_evicted"] == 1 and m["evictions"] == 2 and m["restores"] == 1, m

    svc.unload(b.model_id)  # evicted: its snapshot is forgotten, no slot taken
    assert b.model_id not in evicted(svc) and core(svc).swap.swapped()["keys"] == []
    assert slot_of(svc, b.model_id) is None
    svc.unload(a.model_id)
