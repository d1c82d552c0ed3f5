"""Many tenants on one live service (issue 26): one `lorafleet serve` for the module (real CLI
process, Ray, the trainer rank, one SGLang CPU engine, the rollout worker, SQLite, REST with two
tenant keys and the Tinker API with a third), 4 trainer slots, turns of 1 step.

1. 256 tiny tenants at once: 240 REST runs (232 SFT, 8 RL; two tenant keys, registered from 8
   threads) and 16 Tinker models (the official SDK, 2 steps each). Every registration is accepted,
   every run ends COMPLETED with each of its steps recorded once, every model's steps are answered;
   none is lost (the paged list holds them all); waiters get slots first come, first served (read
   back from the scheduler's own log: new runs leave the queue in registration order, and no run
   evicted after an SFT run is restored before it); at the end no slot, queue entry, evicted
   snapshot or Tinker model is left (/ready, /metrics).
2. registrations beyond the slots queue; one retired while queued ends with no export and leaves the
   queue, the others finish; the turns' swap gauges are on /metrics;
3. kill -9 halfway and a restart on the same state dir: 24 SFT runs checkpointing every step; the
   service is killed while they train and started again (an RL run beside them); every run resumes from its checkpoint
   (the steps up to it keep their first records) and finishes, none lost, none with a step counted
   twice (samples_trained is its steps' samples). It kills the module's service: it runs last.

Short runs (1-2 steps of 2 rows) keep it cheap; the rest of the module's time is two service starts.
"""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path

import pytest

from api.cli.client import LorafleetClient
from tests.integration.sdk_clients import close_sdk_clients, open_client, unload_model  # noqa: F401 - autouse fixture
from tests.integration.service_world import (Service, prometheus_text, register_from_threads, registry_left_in, rl,
                                             running_service, sft, wait_for)
from tests.integration.test_tinker_serve import BASE, sft_data
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SLOTS = {"num_slots": 4, "max_rank": 8, "turn_steps": 1, "evict_idle_s": 3.0}
KEYS = {"alice": "tml-alice-scale-key-1", "bob": "tml-bob-scale-key-22", "carol": "tml-carol-scale-key-3"}
SFT_RUNS, RL_RUNS, MODELS, THREADS = 232, 8, 16, 8
DONE_TIMEOUT_S = 1800
RESTART_RUNS, RESTART_STEPS = 24, 4
_LOG = re.compile(r"^(\S+ \S+) \w+ [\w.]+: (.*)$")


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("scale"), tiny_world, slots=SLOTS, keys=KEYS,
                         service={"tinker_window_ms": 20, "tinker_max_seq_len": 128}) as svc:
        yield svc


def rest(service: Service, tenant: str, timeout_s: float = 60.0) -> LorafleetClient:
    return LorafleetClient(service.url, KEYS[tenant], timeout_s)


def _register_all(service: Service, tiny_world: Path) -> dict[str, tuple[str, int]]:
    """name -> (tenant, steps) of every run, registered from THREADS threads; asserts every one got 201."""
    plan = {f"s{i:03d}": ("alice" if i % 2 else "bob", 1 + i % 2) for i in range(SFT_RUNS)}
    plan.update({f"r{i:02d}": ("alice" if i % 2 else "bob", 1) for i in range(RL_RUNS)})
    configs = {name: (rl(tiny_world, num_step=steps) if name.startswith("r") else sft(tiny_world, num_step=steps, prompts_per_step=2))
               for name, (_, steps) in plan.items()}
    statuses = register_from_threads(service.url, lambda name: KEYS[plan[name][0]], configs, THREADS)
    assert statuses == {201: len(plan)}, statuses
    return plan


def _tinker_model(service: Service, client, data: list, i: int, out: dict, errors: list) -> None:
    """One Tinker tenant: create (waits while every slot's resident is new in its turn), two steps, unload.
    `client`: the key's one ServiceClient (the SDK keeps one session per key and process; its training
    clients are numbered in it)."""
    try:
        from tinker import types

        # while every slot's resident is new in its turn, the creation waits for a slot (never refused for room)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=i, train_unembed=False).result()
        steps = []
        for _ in range(2):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            loss = fb.result(timeout=DONE_TIMEOUT_S).metrics["loss:sum"]
            opt.result(timeout=DONE_TIMEOUT_S)
            steps.append(loss)
        out[tc.model_id] = steps
        unload(service.url, "carol", tc.model_id)  # what the SDK sends for unload_model; its slot or snapshot freed
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(f"model {i}: {type(e).__name__}: {e}")


def unload(url: str, tenant: str, model_id: str) -> None:
    unload_model(url, KEYS[tenant], model_id, timeout_s=DONE_TIMEOUT_S)


def _placements(log_path: Path) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(event, run name) in log order from the scheduler's and controller's lines (registered, evicted,
    restored, leaves the queue), and registration id prefix -> name."""
    events, names = [], {}
    for line in log_path.read_text(errors="replace").splitlines():
        m = _LOG.match(line)
        if not m:
            continue
        msg = m.group(2)
        if g := re.match(r"registered (\S+) \(registration (\w+), slot (\S+),", msg):
            names[g.group(2)[:8]] = g.group(1)
            events.append(("registered" if g.group(3) == "None" else "registered_in_slot", g.group(1)))
        elif g := re.match(r"evicted (\S+) from slot", msg):
            events.append(("evicted", g.group(1)))
        elif g := re.match(r"restored (\S+) into slot", msg):
            events.append(("restored", g.group(1)))
        elif g := re.match(r"(\w{8}) leaves the queue for slot", msg):
            events.append(("bound", g.group(1)))
    return [(e, names.get(n, n) if e == "bound" else n) for e, n in events], names


def _check_first_come_first_served(events: list[tuple[str, str]], plan: dict[str, tuple[str, int]],
                                   registration_order: list[str]) -> dict[str, float]:
    """New runs leave the queue in registration order (the registry's, the list's order: log lines of
    8 registering threads may come out of it); no run evicted after an evicted SFT run is restored
    before it. Returns the longest wait in placements (and in turns of 4 slots)."""
    bound = [n for e, n in events if e == "bound" and n in plan]
    queued = {n for e, n in events if e == "registered" and n in plan}
    assert bound == [n for n in registration_order if n in queued], "new runs left the queue out of order"
    waiting: list[str] = []  # evicted runs, in eviction order
    longest = 0
    placed_since: dict[str, int] = {}
    for e, n in events:
        if e == "evicted" and n in plan:
            waiting.append(n)
            placed_since[n] = 0
        elif e in ("restored", "bound"):
            for w in waiting:
                placed_since[w] += 1
            if e == "restored" and n in waiting:
                ahead = waiting[: waiting.index(n)]
                overtaken = [w for w in ahead if w.startswith("s")]
                assert not overtaken, f"{n} restored before {overtaken} evicted earlier (SFT runs always want a slot)"
                longest = max(longest, placed_since.pop(n))
                waiting.remove(n)
    return {"placements": longest, "turns": math.ceil(longest / SLOTS["num_slots"])}


def test_256_tenants_through_4_slots_all_finish_none_lost_first_come_first_served(service, tiny_world):
    t0 = time.monotonic()
    errors: list[str] = []
    model_steps: dict[str, list[float]] = {}
    from transformers import AutoTokenizer  # here, once: transformers' lazy imports are not thread-safe

    data = sft_data(AutoTokenizer.from_pretrained(tiny_world / "model"), tiny_world, 2)
    client = open_client(service.url, KEYS["carol"])
    models = [threading.Thread(target=_tinker_model, args=(service, client, data, i, model_steps, errors))
              for i in range(MODELS)]
    for t in models:
        t.start()
    plan = _register_all(service, tiny_world)
    with service.client(timeout_s=60) as c:
        listed = {a["name"] for a in c.list()}
        assert set(plan) <= listed  # none lost
        for name, (_, steps) in plan.items():
            ref = wait_for(c, name, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
            recorded = [s["step"] for s in c.metrics(name)["steps"]]
            assert ref["step"] == steps and recorded == list(range(1, steps + 1)), (name, ref["step"], recorded)
    for t in models:
        t.join(DONE_TIMEOUT_S)
    assert errors == [] and len(model_steps) == MODELS, errors
    assert all(len(v) == 2 and all(math.isfinite(x) for x in v) for v in model_steps.values())
    wall = time.monotonic() - t0
    with service.client() as c:
        order = [a["name"] for a in c.list()]
    fairness = _check_first_come_first_served(_placements(service.log_path)[0], plan, order)
    with service.client() as c:
        assert c.ready()["slots"]["free"] == SLOTS["num_slots"]  # no slot leaked
        text = prometheus_text(c)
    for where in ("resident", "queued", "evicted"):
        assert f'lorafleet_adapters_residency{{residency="{where}"}} 0.0' in text, where
    for tier in ("host", "disk", "prefetched"):
        assert f'lorafleet_swap_snapshots{{tier="{tier}"}} 0.0' in text, tier  # every snapshot dropped
    assert "lorafleet_tinker_models 0.0" in text
    print(f"256 tenants: {wall:.0f} s; longest wait {fairness['placements']} placements ({fairness['turns']} turns of 4 slots)")


def test_a_run_retired_while_queued_ends_without_an_export_and_leaves_the_queue(service, tiny_world):
    """Registrations beyond the slots queue (201 with a queue position); one retired while it waits
    completes with no export (nothing trained) and leaves the queue; the others take their turns and
    finish; the swap gauges of the turns are on /metrics. (test_service_oversub_live.py, opt-in, has
    the same on two slots with RL runs too.)"""
    with rest(service, "bob") as c:
        busy = [f"q{i}" for i in range(SLOTS["num_slots"] + 1)]
        for n in busy:
            c.register(n, sft(tiny_world, num_step=3, prompts_per_step=2))
        waiting = c.register("never", sft(tiny_world, num_step=3, prompts_per_step=2))
        assert waiting["state"] == "PENDING" and waiting["residency"] == "queued" and waiting["slot"] is None
        assert waiting["queue_position"] >= 1, waiting
        c.retire("never")
        gone = wait_for(c, "never", lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
        if gone["step"] == 0:  # retired while still queued (a turn may have come first: then it trained and exported)
            assert gone["export_path"] is None
        assert gone["queue_position"] is None and gone["slot"] is None
        for n in busy:
            ref = wait_for(c, n, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
            assert ref["step"] == 3 and ref["queue_position"] is None, ref
    with service.client() as c:
        text = prometheus_text(c)
        assert c.ready()["slots"]["free"] == SLOTS["num_slots"]
    assert 'lorafleet_adapters_residency{residency="queued"} 0.0' in text
    assert "lorafleet_adapter_swap_out_seconds{" in text and "lorafleet_adapter_swap_in_seconds{" in text


def test_kill_9_halfway_and_restart_every_run_resumes_from_its_checkpoint(service, tiny_world):
    names = [f"k{i:02d}" for i in range(RESTART_RUNS)]
    with rest(service, "alice") as c:
        # an RL run too (its rollout state is rebuilt after the restart; first, so it holds a slot early)
        c.register("k-rl", rl(tiny_world, num_step=RESTART_STEPS, checkpoint_interval=1))
        for n in names:
            c.register(n, sft(tiny_world, num_step=RESTART_STEPS, prompts_per_step=2, checkpoint_interval=1))
        target = RESTART_RUNS * RESTART_STEPS // 2
        wait_until(lambda: sum(a["step"] for a in c.list() if a["name"] in names) >= target, "the runs halfway",
                   timeout_s=DONE_TIMEOUT_S, interval_s=0.5)
    service.kill()
    killed_at = time.time()
    # each run's last checkpoint as the killed service left it (an API read before the kill could
    # miss a step checkpointed between read and kill)
    with registry_left_in(service.state_dir, SLOTS["num_slots"]) as registry:
        before = {ref.name: ref.checkpoint_step or 0 for ref in registry.list() if ref.name in names + ["k-rl"]}
    service.start()  # the same job and state dir: engines of the killed one reaped, live runs prepared again
    with rest(service, "alice") as c:
        for n in names + ["k-rl"]:
            ref = wait_for(c, n, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=DONE_TIMEOUT_S)
            steps = c.metrics(n)["steps"]
            assert [s["step"] for s in steps] == list(range(1, RESTART_STEPS + 1)) and ref["step"] == RESTART_STEPS, (n, steps)
            # no step counted twice: an SFT step is 2 rows; an RL step's samples are what its step recorded
            samples = RESTART_STEPS * 2 if n in names else sum(s["samples"] for s in steps)
            assert ref["samples_trained"] == samples, (n, ref["samples_trained"])
            kept = [s for s in steps if s["step"] <= before[n]]
            assert all(s["recorded_at"] < killed_at for s in kept), (n, "a step up to its checkpoint was trained again")
            assert all(s["recorded_at"] > killed_at for s in steps if s["step"] > before[n])
        assert sum(1 for n in names if 0 < before[n] < RESTART_STEPS) >= 1  # some run really was halfway
        assert c.list_page(limit=1000)["total"] >= RESTART_RUNS  # none lost
