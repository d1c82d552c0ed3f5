"""The official tinker SDK against a live `lorafleet serve` (real CLI process, Ray trainer actor,
one SGLang CPU engine, REST with a token) on the tiny world, with a keys file: one service
for the module.

* An SDK client trains (cross_entropy, SL) while a dataset-driven SFT adapter registered
  over REST trains too: the Tinker loss falls, the adapter keeps stepping, and the SDK's
  forward_backward calls ride in the loop's train calls (lorafleet_tinker_joined_steps > 0).
* A Tinker model holds a trainer slot in the registry's count: /ready's free slots drop,
  a model beyond the free slots gets a clear error in its future, and REST registration
  is refused (409) while Tinker models hold the last slots; unloading frees them.
* Auth: an unknown key is 401; another tenant's model id is 404; /metrics has the
  Tinker gauges.
* Sampler weights saved from the fleet's trainer are sampled on the fleet's SGLang engine
  and equal HF+PEFT greedy on the exported folder.
Runtime: 137 s on the 2-core machine, 126 s of it starting the service.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.sdk_clients import close_sdk_clients, open_client, unload_model  # noqa: F401 - autouse fixture
from tests.integration.service_world import TOKEN, UNTIL_RETIRED, Service, serve_job, sft, wait_for

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-serve-key-1", "bob": "tml-bob-serve-key-22"}
BASE = "model"  # the served base model's name: its folder's name (tiny world: .cache/tiny/model)
NUM_SLOTS = 4  # examples/tiny/job.yaml
TOKENIZER_ID = "lorafleet-tiny/tokenizer"  # what get_info tells clients (a hub-style id; a server path would be cut)


@contextlib.contextmanager
def tinker_service(tmp: Path, tiny_world: Path) -> Iterator[Service]:
    from service.fleet.engine_pids import reap_engines

    # Idle Tinker models keep their slots here (no eviction within a test): the slot-count
    # scenarios below are about leases; idle eviction is tests/integration/test_tinker_evict.py.
    job_path = serve_job(tmp, tiny_world, slots={"num_slots": NUM_SLOTS, "max_rank": 8, "evict_idle_s": 3600.0})
    keys = tmp / "tinker_keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    job = yaml.safe_load(job_path.read_text())
    job["service"].update({"tinker_keys_file": str(keys), "tinker_window_ms": 50, "tinker_max_seq_len": 128,
                           "tinker_tokenizer_id": TOKENIZER_ID})
    job_path.write_text(yaml.safe_dump(job))
    svc = Service(job_path, tmp / "state", tmp / "serve.log")
    try:
        svc.start()
        yield svc
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.proc.kill()
        reap_engines(svc.state_dir)


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    with tinker_service(tmp_path_factory.mktemp("tinker-serve"), tiny_world) as svc:
        yield svc


def sdk(url: str, tenant: str):
    return open_client(url, KEYS[tenant])


def free_slots(url: str) -> int:
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        return http.get("/ready").json()["slots"]["free"]


def unload(url: str, tenant: str, model_id: str) -> None:
    unload_model(url, KEYS[tenant], model_id)


def sft_data(tok, tiny_world: Path, n: int):
    from tinker import types

    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:n]
    data = []
    for r in rows:
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        full = p + c
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    return data


@contextlib.contextmanager
def _leaves_nothing_behind(url: str, rest, loaded: list[tuple[str, str]], runs: tuple[str, ...]):
    """However the block ends, unload its Tinker models still loaded and retire its live REST runs,
    so that a failure here does not starve the module's later tests of slots (best effort: the
    block's own error is the one reported)."""
    try:
        yield
    finally:
        for tenant, model_id in list(loaded):
            with contextlib.suppress(Exception):
                unload(url, tenant, model_id)
        for name in runs:
            with contextlib.suppress(Exception):
                if rest.get(name)["state"] in ("PENDING", "ACTIVE"):
                    rest.retire(name)


def test_sdk_trains_beside_a_dataset_run_and_holds_a_slot(service, tiny_world):
    from tinker import types

    loaded: list[tuple[str, str]] = []  # (tenant, model id) still loaded: unloaded however the test ends
    with service.client() as rest, _leaves_nothing_behind(service.url, rest, loaded, ("rest-sft", "late")):
        rest.register("rest-sft", sft(tiny_world, num_step=UNTIL_RETIRED))  # trains until retired (1,000 tiny steps can end mid-test)
        wait_for(rest, "rest-sft", lambda r: r["state"] == "ACTIVE" and r["step"] >= 1, "first step")
        assert free_slots(service.url) == NUM_SLOTS - 1

        tc = sdk(service.url, "alice").create_lora_training_client(base_model=BASE, rank=4, seed=1, train_unembed=False).result()
        loaded.append(("alice", tc.model_id))
        assert free_slots(service.url) == NUM_SLOTS - 2  # the Tinker model holds a slot in the registry's count
        from transformers import AutoTokenizer

        data = sft_data(AutoTokenizer.from_pretrained(tiny_world / "model"), tiny_world, 12)  # this machine's copy
        rest_step_before = rest.get("rest-sft")["step"]
        losses = []
        for _ in range(12):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        assert losses[-1] < 0.9 * losses[0] and max(losses[-3:]) < min(losses[:3]), losses
        # the dataset-driven run kept training on the same trainer meanwhile
        wait_for(rest, "rest-sft", lambda r: r["step"] > rest_step_before, "a step during the Tinker loop", timeout_s=120)

        with httpx.Client(base_url=service.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            metrics = http.get("/metrics").text
        assert re.search(r"^lorafleet_tinker_models 1\.0$", metrics, re.M), metrics
        gauge = lambda name: float(re.search(rf"^lorafleet_tinker_{name} (\S+)$", metrics, re.M).group(1))  # noqa: E731
        assert gauge("forward_backward_calls") >= 12
        # ONE mixed step of both kinds: the loop trained throughout, so forward_backward calls
        # rode in its train calls (the coalescer leaves them to a training loop for up to 2 s)
        assert gauge("joined_steps") > 0 and gauge("joined_calls") >= gauge("joined_steps"), metrics
        print(f"joined steps {gauge('joined_steps'):g}, joined calls {gauge('joined_calls'):g} of "
              f"{gauge('forward_backward_calls'):g} forward_backward calls; Tinker losses {losses[0]:.2f} -> {losses[-1]:.2f}")

        # Tinker models take the remaining slots. One more model still gets one: the fairness rule
        # (service/scheduling/residency.py choose_evictions: an idle tenant first, else one whose turn of
        # turn_steps steps is used up) swaps out a resident that has trained past its turn (the
        # REST run or alice's model: whichever the policy picks); it comes back, not lost. A REST registration queues too (it never takes a model's slot);
        # unloading the models gives the slots back and both runs get one.
        bob = sdk(service.url, "bob")
        extra = [bob.create_lora_training_client(base_model=BASE, rank=4, seed=2 + i, train_unembed=False).result()
                 for i in range(NUM_SLOTS - 2)]
        loaded += [("bob", m.model_id) for m in extra]
        assert free_slots(service.url) == 0
        extra.append(bob.create_lora_training_client(base_model=BASE, rank=4, seed=9, train_unembed=False).result())
        loaded.append(("bob", extra[-1].model_id))
        assert free_slots(service.url) == 0  # five tenants in four slots: one resident was swapped out for it
        with httpx.Client(base_url=service.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            resp = http.post("/v1/adapters", json={"name": "late", "config": sft(tiny_world)})
        assert resp.status_code == 201 and resp.json()["queue_position"] >= 1, resp.text
        for m in extra:
            unload(service.url, "bob", m.model_id)
            loaded.remove(("bob", m.model_id))
        wait_for(rest, "late", lambda r: r["slot"] is not None, "a slot once the Tinker models are unloaded", timeout_s=120)
        unload(service.url, "alice", tc.model_id)
        loaded.remove(("alice", tc.model_id))
        for name in ("late", "rest-sft"):
            rest.retire(name)
        for name in ("late", "rest-sft"):
            wait_for(rest, name, lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=180)
        assert free_slots(service.url) == NUM_SLOTS


def test_the_coordinator_left_what_it_started_with_out_of_later_collections(service):
    """Once up, the coordinator froze what it holds (service/modes.py freeze_startup_objects: torch, Ray
    and FastAPI loaded, several hundred thousand objects), so the collector's full passes walk only what
    came after; its passes by generation are on /metrics beside it."""
    with httpx.Client(base_url=service.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        metrics = http.get("/metrics").text
    frozen = float(re.search(r"^lorafleet_coordinator_gc_frozen_objects (\S+)$", metrics, re.M).group(1))
    assert frozen > 100_000, metrics
    assert re.search(r'^lorafleet_coordinator_gc_collections\{generation="2"\} \S+$', metrics, re.M), metrics


def test_unknown_key_401_and_other_tenants_model_404(service):
    tc = sdk(service.url, "alice").create_lora_training_client(base_model=BASE, rank=4, seed=3, train_unembed=False).result()
    scenarios = [  # (headers, method, route, body, expected status, substring)
        ({"X-API-Key": "tml-not-a-tenant-key"}, "GET", "get_server_capabilities", None, 401, "unknown API key"),
        ({}, "POST", "create_session", {"tags": [], "sdk_version": "x"}, 401, "API key"),
        ({"Authorization": f"Bearer {TOKEN}"}, "GET", "get_server_capabilities", None, 401, "API key"),  # the REST token is no Tinker key
        ({"X-API-Key": KEYS["bob"]}, "POST", "get_info", {"model_id": tc.model_id}, 404, "unknown model"),
        ({"X-API-Key": KEYS["bob"]}, "POST", "optim_step", {"model_id": tc.model_id, "adam_params": {"learning_rate": 1.0}}, 404, "unknown model"),
        ({"X-API-Key": KEYS["alice"]}, "POST", "get_info", {"model_id": tc.model_id}, 200, f'"tokenizer_id":"{TOKENIZER_ID}"'),
    ]
    with httpx.Client(base_url=service.url + "/api/v1", timeout=30) as http:
        for headers, method, route, body, status, text in scenarios:
            resp = http.request(method, route, headers=headers, json=body)
            assert resp.status_code == status and text in resp.text, (route, headers, resp.status_code, resp.text[:300])
    unload(service.url, "alice", tc.model_id)


def test_forward_backward_bodies_get_the_tinker_limit(service):
    """Data-carrying Tinker routes take bodies above max_body_bytes (1 MiB); other routes still 413."""
    big = b"\0" * (2 << 20)
    with httpx.Client(base_url=service.url, timeout=60) as http:
        fb = http.post("/api/v1/forward_backward", content=big, headers={"X-API-Key": KEYS["alice"], "content-type": "application/x-protobuf"})
        rest = http.post("/v1/adapters", content=big, headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert fb.status_code != 413 and fb.status_code < 500, (fb.status_code, fb.text[:300])  # reached the route: a clear 4xx
    assert rest.status_code == 413 and "LORAFLEET_MAX_BODY_BYTES" in rest.text, rest.text[:300]


def test_api_server_awaits_its_stop_hooks_on_the_serving_loop():
    """uvicorn runs with lifespan off: ApiServer.stop awaits the app's stop hooks (TinkerService.stop) itself."""
    import asyncio
    import threading

    from fastapi import FastAPI

    from api.server import ApiServer

    seen = []

    async def hook():
        seen.append((threading.current_thread().name, asyncio.get_running_loop().is_running()))

    server = ApiServer(FastAPI(), on_stop=[hook])
    server.start()
    server.stop()
    assert seen == [("lorafleet-api", True)]


def test_sampler_weights_reach_the_service_engine(service, tiny_world):
    """save_weights_for_sampler on the fleet's trainer, sampled on the fleet's SGLang engine: greedy
    samples equal HF+PEFT on the exported folder, and differ from the base model's."""
    from tinker import types
    from transformers import AutoTokenizer

    from tests.integration.sglang_fixtures import hf_greedy

    sc = sdk(service.url, "alice")
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5, train_unembed=False).result()
    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    data = sft_data(tok, tiny_world, 8)
    for _ in range(4):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("after-4").result().path
    folder = service.state_dir / "tinker" / "alice" / tc.model_id.replace(":", "_") / "sampler_weights" / "after-4"
    assert (folder / "adapter_model.safetensors").is_file(), path
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()[:2]]
    prompts = [tok.encode(r["prompt"]) for r in rows]
    base_ref = hf_greedy(tiny_world / "model", None, prompts, max_new_tokens=10)
    peft_ref = hf_greedy(tiny_world / "model", folder, prompts, max_new_tokens=10)
    assert peft_ref != base_ref  # training changed the greedy outputs
    sampler = sc.create_sampling_client(model_path=path).result()
    for p, ref in zip(prompts, peft_ref):
        res = sampler.sample(types.ModelInput.from_ints(p), 1, types.SamplingParams(max_tokens=10, temperature=0.0)).result()
        got = list(res.sequences[0].tokens)
        # sampling stops at EOS (token 0 in the tiny world); HF's reference does not: compare the prefix
        assert got == ref[: len(got)] and (len(got) == len(ref) or got[-1] == 0), (got, ref)
    unload(service.url, "alice", tc.model_id)


def test_the_keys_are_the_rest_apis_tenants_too(service, tiny_world):
    """Issue 14 F5 on the live service: a key of the keys file is its tenant on the REST API as well
    (X-API-Key or bearer); another tenant's run is 404 exactly like a missing one and stays untouched;
    the operator routes are the admin token's. Ends with every slot free again."""
    headers = {"bob": {"X-API-Key": KEYS["bob"]}, "alice": {"Authorization": f"Bearer {KEYS['alice']}"}}
    with httpx.Client(base_url=service.url, timeout=30, headers=headers["bob"]) as bob, \
            httpx.Client(base_url=service.url, timeout=30, headers=headers["alice"]) as alice, service.client() as admin:
        r = bob.post("/v1/adapters", json={"name": "bob-rest", "config": sft(tiny_world)})
        assert r.status_code == 201 and r.json()["owner"] == "bob", r.text
        for method, path in [("GET", ""), ("GET", "/metrics"), ("GET", "/runs"), ("DELETE", ""), ("POST", "/abort")]:
            theirs, nothing = (alice.request(method, f"/v1/adapters/{n}{path}") for n in ("bob-rest", "no-such-run"))
            assert theirs.status_code == nothing.status_code == 404, (method, path, theirs.text)
            assert theirs.json() == json.loads(nothing.text.replace("no-such-run", "bob-rest")), (method, path)
        assert "bob-rest" not in [a["name"] for a in alice.get("/v1/adapters").json()["adapters"]]
        assert [a["name"] for a in bob.get("/v1/adapters").json()["adapters"]] == ["bob-rest"]
        assert admin.get("bob-rest")["owner"] == "bob" and admin.get("bob-rest")["state"] in ("PENDING", "ACTIVE")
        assert bob.get("/v1/fleet").status_code == 403 and bob.get("/metrics").status_code == 403
        assert alice.get("/v1/adapters", headers={"Authorization": "Bearer tml-not-a-tenant-key"}).status_code == 401
        assert bob.delete("/v1/adapters/bob-rest").status_code == 202
        done = wait_for(admin, "bob-rest", lambda a: a["state"] == "COMPLETED", "COMPLETED", timeout_s=180)
        assert done["owner"] == "bob"
    assert free_slots(service.url) == NUM_SLOTS
