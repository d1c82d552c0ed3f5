"""Rollout against a real SGLang server on CPU with the tiny model (one server for the module).

The proofs of issue 4: two adapters served concurrently each by its own
weights (== HF+PEFT greedy), a live version update under load, abort by prefix
of one adapter while another's requests run, the rollout worker's groups
(round robin, stamps, rewards, advantages, staleness, re-registration), and a
killed engine detected with its groups re-queued (it restarts the server, and puts it
back up if it fails half-way, so the tests run in any order).

Steadiness: tests wait on conditions with generous deadlines, never on sleeps; latencies
are printed, not asserted (timings belong in benchmarks).
"""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray
from tests.trainer_probes import train_batch

import asyncio
import time

import pytest

from rollout.engines.client import EngineClient, EngineUnavailable
from rollout.config import DataConfig, RewardConfig, RolloutConfig, SamplingConfig
from rollout.naming import lora_name
from rollout.engines.pool import EnginePool
from rollout.rewards import target_share
from rollout.engines.weights import AdapterWeights
from rollout.messages import AdapterRollout
from tests.integration.rollout_world import count_concurrent_requests, rollout_spec, started_worker, wait_for
from tests.integration.sglang_fixtures import GREEDY, hf_greedy, make_peft_adapter, one_torch_thread, sglang_server_fixture
from tests.rollout_probes import kill_engine, wait_unloaded

pytestmark = pytest.mark.integration

sglang_server = sglang_server_fixture()


@pytest.fixture(scope="module")
def adapters(tiny_world, tmp_path_factory):
    """Two PEFT adapters for the tiny model with different random B."""
    root = tmp_path_factory.mktemp("adapters")
    return {k: make_peft_adapter(tiny_world / "model", root / k, seed=seed) for k, seed in (("one", 1), ("two", 2))}


@pytest.fixture(scope="module")
def tokenizer(tiny_world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_world / "model")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["<|user|>ab 12 ou\n<|assistant|>", "<|user|>kk 9 ee 41\n<|assistant|>", "zz 12 aei", "<|user|>7 7 ua\n<|assistant|>"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_logprobs(model_dir, adapter_dir, prompt, tokens):
    """log p(token_i | prompt, tokens_<i) under HF+PEFT."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad(), one_torch_thread():
        logp = model(ids).logits[0].log_softmax(-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_two_adapters_concurrently_each_served_by_its_own_weights(sglang_server, adapters, prompts, tiny_world):
    """Adapter A sent by tensors, B by folder; requests interleaved; outputs == HF+PEFT greedy per adapter."""
    model_dir = tiny_world / "model"
    want = {k: hf_greedy(model_dir, adapters[k], prompts) for k in adapters}
    assert want["one"] != want["two"] and want["one"] != hf_greedy(model_dir, None, prompts)

    async def run():
        by_tensors = EnginePool([sglang_server.client()], weight_transfer="tensors")
        by_disk = EnginePool([sglang_server.client()], weight_transfer="disk")
        try:
            await by_tensors.publish("conc-a", 0, AdapterWeights.from_folder(adapters["one"]))
            await by_disk.publish("conc-b", 0, AdapterWeights.from_folder(adapters["two"]))
            jobs = []
            for ids in prompts:
                jobs.append(by_tensors.generate_group("conc-a", ids, GREEDY, 2))
                jobs.append(by_disk.generate_group("conc-b", ids, GREEDY, 2))
            out = await asyncio.gather(*jobs)
            loaded = await sglang_server.client().loaded_adapters()
            await by_tensors.remove_adapter("conc-a")
            await by_disk.remove_adapter("conc-b")
            await wait_unloaded(by_tensors)
            await wait_unloaded(by_disk)
            return out, loaded
        finally:
            await by_tensors.aclose()
            await by_disk.aclose()

    out, loaded = asyncio.run(run())
    assert {"conc-a@v0", "conc-b@v0"} <= set(loaded)
    for i, ids in enumerate(prompts):
        for g, key in ((out[2 * i], "one"), (out[2 * i + 1], "two")):
            assert g.version == 0 and len(g.results) == 2
            for r in g.results:
                assert r.token_ids == want[key][i], (key, i)
                assert r.finish_reason == "length" and len(r.logprobs) == len(r.token_ids)
    # Logprobs are those of the served adapter (what the trainer's importance ratios need).
    ref = hf_logprobs(model_dir, adapters["one"], prompts[0], want["one"][0])
    assert max(abs(a - b) for a, b in zip(out[0].results[0].logprobs, ref)) < 1e-4


def test_generate_many_runs_a_group_in_one_request_each_sample_by_the_adapter(sglang_server, adapters, prompts, tiny_world):
    """EngineClient.generate_many (the Tinker sampler's one request per group): one answer per rid, in
    order, each the served adapter's HF+PEFT greedy tokens with its log-probabilities; the base model
    (lora_name None) likewise."""
    model_dir = tiny_world / "model"
    want = hf_greedy(model_dir, adapters["one"], prompts[:1])[0]
    base = hf_greedy(model_dir, None, prompts[:1])[0]
    assert want != base

    async def run():
        pool = EnginePool([sglang_server.client()], weight_transfer="disk")
        client = sglang_server.client()
        try:
            await pool.publish("many-a", 0, AdapterWeights.from_folder(adapters["one"]))
            rids = [f"many::{i}" for i in range(3)]
            got = await client.generate_many(rids=rids, input_ids=prompts[0], sampling_params=[GREEDY] * 3,
                                              lora_name="many-a@v0")
            on_base = await client.generate_many(rids=["many::b0", "many::b1"], input_ids=prompts[0],
                                                 sampling_params=[GREEDY] * 2, lora_name=None)
            await pool.remove_adapter("many-a")
            await wait_unloaded(pool)
            return got, on_base
        finally:
            await pool.aclose()
            await client.aclose()

    got, on_base = asyncio.run(run())
    assert [r.rid for r in got] == [f"many::{i}" for i in range(3)]
    assert all(r.token_ids == want for r in got) and all(r.token_ids == base for r in on_base)
    ref = hf_logprobs(model_dir, adapters["one"], prompts[0], want)
    assert max(abs(a - b) for r in got for a, b in zip(r.logprobs, ref)) < 1e-4


def test_stock_server_advertises_no_upsert_or_prefix_abort(sglang_server):
    async def run():
        async with sglang_server.client() as c:
            return await c.capabilities()

    caps = asyncio.run(run())
    assert not caps.prefix_abort and not caps.upsert_from_tensors and not caps.upsert_from_path


def test_version_update_under_load(sglang_server, adapters, prompts, tiny_world):
    """In-flight requests finish on v0, later ones use v1, nothing errors, v0 is unloaded afterwards."""
    model_dir = tiny_world / "model"
    long = {**GREEDY, "max_new_tokens": 200}  # long enough to be mid-generation at the update on a fast machine
    want_v0 = hf_greedy(model_dir, adapters["one"], prompts, 200)
    want_v1 = hf_greedy(model_dir, adapters["two"], prompts, 200)

    async def run():
        pool = EnginePool([sglang_server.client()])
        client = sglang_server.client()
        try:
            await pool.publish("upd", 0, AdapterWeights.from_folder(adapters["one"]))
            before = [asyncio.create_task(pool.generate_group("upd", ids, long, 2)) for ids in prompts]
            await wait_for(lambda: pool.inflight("upd") == 2 * len(prompts), 60, "the v0 requests in flight")
            t0 = time.perf_counter()
            await pool.publish("upd", 1, AdapterWeights.from_folder(adapters["two"]))
            update_s = time.perf_counter() - t0
            still_running = pool.inflight("upd")
            during = await client.loaded_adapters()
            after = [asyncio.create_task(pool.generate_group("upd", ids, long, 2)) for ids in prompts]
            old, new = await asyncio.gather(asyncio.gather(*before), asyncio.gather(*after))
            await wait_unloaded(pool)
            final = await client.loaded_adapters()
            await pool.remove_adapter("upd")
            await wait_unloaded(pool)
            return old, new, update_s, still_running, during, final
        finally:
            await pool.aclose()
            await client.aclose()

    old, new, update_s, still_running, during, final = asyncio.run(run())
    assert still_running == 2 * len(prompts), "the v0 requests ended before the update: the test proved nothing"
    assert {"upd@v0", "upd@v1"} <= set(during)
    for i in range(len(prompts)):
        assert old[i].version == 0 and [r.token_ids for r in old[i].results] == [want_v0[i]] * 2
        assert new[i].version == 1 and [r.token_ids for r in new[i].results] == [want_v1[i]] * 2
    assert "upd@v1" in final and "upd@v0" not in final
    print(f"\nupdate latency (load v1 + switch) {update_s * 1000:.0f} ms with {still_running} requests in flight")


def test_abort_by_prefix_spares_other_adapters(sglang_server, adapters, prompts):
    """24 requests of A and 24 of B in flight; abort A: all of A end aborted (the pool re-sends
    aborts that reach the server before their request), B untouched."""
    sampling = {"temperature": 1.0, "max_new_tokens": 256, "ignore_eos": True}

    async def run():
        pool = EnginePool([sglang_server.client()])
        try:
            await pool.publish("abort-a", 0, AdapterWeights.from_folder(adapters["one"]))
            await pool.publish("abort-b", 0, AdapterWeights.from_folder(adapters["two"]))
            a = [asyncio.create_task(pool.generate_group("abort-a", prompts[i % 4], sampling, 4)) for i in range(6)]
            b = [asyncio.create_task(pool.generate_group("abort-b", prompts[i % 4], sampling, 4)) for i in range(6)]
            await wait_for(lambda: pool.inflight("abort-a") == 24 and pool.inflight("abort-b") == 24, 60,
                           "24 requests of each adapter in flight")
            t0 = time.perf_counter()
            count = await pool.abort_adapter("abort-a")
            a_groups = await asyncio.gather(*a)
            a_done_s = time.perf_counter() - t0
            b_inflight_after_a = pool.inflight("abort-b")
            b_groups = await asyncio.gather(*b)
            await pool.remove_adapter("abort-a")
            await pool.remove_adapter("abort-b")
            await wait_unloaded(pool)
            async with sglang_server.client() as c:
                left = [n for n in await c.loaded_adapters() if n.startswith("abort-")]
            return count, a_groups, a_done_s, b_inflight_after_a, b_groups, left
        finally:
            await pool.aclose()

    count, a_groups, a_done_s, b_inflight_after_a, b_groups, left = asyncio.run(run())
    assert left == []  # removal leaves nothing of either adapter on the server
    assert count == 24
    assert all(r.aborted and len(r.token_ids) < 256 for g in a_groups for r in g.results)
    assert b_inflight_after_a > 0  # B was still running when A's abort had completed
    assert all(r.finish_reason == "length" and len(r.token_ids) == 256 for g in b_groups for r in g.results)
    print(f"\nabort latency: {count} requests of A ended {a_done_s * 1000:.0f} ms after the abort call")


def test_remove_unloads_versions_the_pool_did_not_know_were_still_held(sglang_server, adapters):
    """A version loaded behind the pool's back (as a failed or skipped unload would leave one)
    is found on the server's own list at removal and unloaded; other names are left alone."""

    async def run():
        pool = EnginePool([sglang_server.client()])
        async with sglang_server.client() as direct:
            try:
                await pool.publish("sweep", 0, AdapterWeights.from_folder(adapters["one"]))
                await pool.publish("sweepy", 0, AdapterWeights.from_folder(adapters["two"]))
                await direct.load_adapter(lora_name("sweep", 7), AdapterWeights.from_folder(adapters["two"]), transfer="disk")
                before = await direct.loaded_adapters()
                await pool.remove_adapter("sweep")
                after = await direct.loaded_adapters()
                await pool.remove_adapter("sweepy")
                return before, after, await direct.loaded_adapters()
            finally:
                await pool.aclose()

    before, after, end = asyncio.run(run())
    mine = lambda names: [n for n in names if n.startswith("sweep")]  # noqa: E731
    assert mine(before) == ["sweep@v0", "sweep@v7", "sweepy@v0"]
    assert mine(after) == ["sweepy@v0"]
    assert mine(end) == []


def test_engine_client_errors_carry_the_body(sglang_server):
    async def run():
        async with sglang_server.client() as c:
            with pytest.raises(Exception) as unknown:
                await c.generate(rid="x::" + "0" * 32, input_ids=[1, 2], sampling_params=GREEDY, lora_name="no-such-adapter")
            with pytest.raises(Exception) as dup:
                await c.unload_adapter("never-loaded")
        async with EngineClient("http://127.0.0.1:9", admin_timeout_s=2) as dead:
            with pytest.raises(EngineUnavailable):
                await dead.loaded_adapters()
        return unknown.value, dup.value

    unknown, dup = asyncio.run(run())
    assert unknown.status == 400 and "no-such-adapter" in str(unknown)
    assert dup.status == 400 and "never-loaded" in str(dup)


def test_refused_update_changes_nothing(sglang_server, adapters, prompts, tiny_world, tmp_path):
    """The server refuses v1 (rank 16 > --max-lora-rank 8): publish raises with the server's
    message, v0 keeps serving, nothing of v1 stays loaded."""
    too_big = make_peft_adapter(tiny_world / "model", tmp_path / "r16", seed=3, rank=16)

    async def run():
        pool = EnginePool([sglang_server.client()])
        try:
            await pool.publish("refuse", 0, AdapterWeights.from_folder(adapters["one"]))
            with pytest.raises(Exception) as err:
                await pool.publish("refuse", 1, AdapterWeights.from_folder(too_big))
            version = pool.current_version("refuse")
            g = await pool.generate_group("refuse", prompts[0], GREEDY, 1)
            loaded = await pool.client(0).loaded_adapters()
            await pool.remove_adapter("refuse")
            return err.value, version, g, loaded
        finally:
            await pool.aclose()

    err, version, g, loaded = asyncio.run(run())
    assert getattr(err, "status", None) == 400 and "rank" in str(err).lower()
    assert version == 0 and g.version == 0
    assert g.results[0].token_ids == hf_greedy(tiny_world / "model", adapters["one"], prompts[:1])[0]
    assert "refuse@v0" in loaded and "refuse@v1" not in loaded


# --- the rollout worker ------------------------------------------------------------------------


def test_worker_groups_round_robin_stamped_and_scored(sglang_server, adapters, tiny_world):
    cfg = RolloutConfig(max_inflight_per_adapter=8, max_inflight_total=12, max_staleness=0, max_buffered_groups_per_adapter=4)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["digits", "vowels"]) as worker:
            core = worker.core
            peak = count_concurrent_requests(worker.pool.client(0))
            await worker.add_adapter(rollout_spec(tiny_world, "digits", "digits", "reg-d1"), AdapterWeights.from_folder(adapters["one"]))
            await worker.add_adapter(rollout_spec(tiny_world, "vowels", "vowels", "reg-v1"), AdapterWeights.from_folder(adapters["two"]))
            await wait_for(lambda: all(core.stats(n).buffered_groups >= 4 for n in ("digits", "vowels")), 120, "4 buffered groups each")
            peak = dict(peak)  # the peaks while the buffers filled
            stats_full = {n: core.stats(n) for n in ("digits", "vowels")}
            groups = {n: await worker.pop_groups(n, 10) for n in ("digits", "vowels")}

            # A new version: groups generated by v0 and still buffered are stale (max_staleness 0).
            await wait_for(lambda: core.stats("digits").buffered_groups >= 2, 60, "more digits groups")
            await worker.publish_version("digits", 1, AdapterWeights.from_folder(adapters["two"]))
            popped_after_update = await worker.pop_groups("digits", 10)
            v1_groups = []

            async def popped_a_group():  # groups still in flight on v0 finish stale and are dropped on pop
                v1_groups.extend(await worker.pop_groups("digits", 10))
                return bool(v1_groups)

            await wait_for(popped_a_group, 120, "a digits group of v1")
            stats_after = core.stats("digits")
            cursor = await worker.data_cursor("digits")

            # Re-registration: the name comes back as a new tenant; nothing of the old one leaks.
            await worker.remove_adapter("vowels")
            await worker.add_adapter(rollout_spec(tiny_world, "vowels", "vowels", "reg-v2"), AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("vowels").buffered_groups >= 1, 60, "a group of the new vowels tenant")
            new_tenant = await worker.pop_groups("vowels", 10)
            return stats_full, groups, popped_after_update, v1_groups, stats_after, cursor, new_tenant, peak

    stats_full, groups, popped_after_update, v1_groups, stats_after, cursor, new_tenant, peak = asyncio.run(run())
    # Bounds: per adapter 8 requests (2 groups of 4), 12 overall, 4 groups buffered; counted at
    # the client's generate calls, so no request in between goes unseen.
    assert peak["digits"] <= 8 and peak["vowels"] <= 8 and peak["total"] <= 12 and peak["total"] >= 8
    assert all(s.buffered_groups == 4 and s.inflight_groups == 0 for s in stats_full.values())  # a full buffer stops its adapter
    for name, reg in (("digits", "reg-d1"), ("vowels", "reg-v1")):
        gs = groups[name]
        assert len(gs) == 4 and len({g.prompt_index for g in gs}) == 4
        label = "0123456789" if name == "digits" else "aeiou"
        for g in gs:
            assert (g.adapter, g.registration_id, g.version, g.label) == (name, reg, 0, label)
            assert g.prompt_text.startswith("<|user|>") and len(g.samples) == 4
            for smp in g.samples:
                assert smp.reward == pytest.approx(target_share(smp.response_text, label)) and smp.reward_error is None
                assert len(smp.logprobs) == len(smp.response_ids) <= 12 and all(lp <= 0 for lp in smp.logprobs)
            assert sum(smp.advantage for smp in g.samples) == pytest.approx(0.0, abs=1e-5)
    assert popped_after_update == []  # every buffered v0 group was stale for v1 ...
    assert stats_after.dropped_stale >= 2 and stats_after.groups_requeued >= 2  # ... dropped, prompts re-queued
    assert v1_groups and all(g.version == 1 for g in v1_groups)
    assert stats_after.groups_consumed == 4 + len(v1_groups) == cursor.consumed
    assert all(g.registration_id == "reg-v2" and g.version == 0 for g in new_tenant)


def test_worker_abort_requeues_and_does_not_count(sglang_server, adapters, tiny_world):
    cfg = RolloutConfig(max_inflight_per_adapter=8, max_inflight_total=8, max_buffered_groups_per_adapter=64)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["ab"]) as worker:
            core = worker.core
            spec = rollout_spec(tiny_world, "ab", "digits", "reg-1", max_new_tokens=400, ignore_eos=True)
            await worker.add_adapter(spec, AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("ab").inflight_requests == 8, 60, "8 requests in flight")
            before = core.stats("ab")
            aborted = await worker.abort_adapter("ab", pause=True)
            await wait_for(lambda: core.stats("ab").inflight_groups == 0, 60, "aborted groups to end")
            after = core.stats("ab")
            cursor = await worker.data_cursor("ab")
            return before, aborted, after, cursor

    before, aborted, after, cursor = asyncio.run(run())
    assert aborted == 8
    assert after.groups_aborted == 2 and after.groups_requeued == 2
    assert after.groups_completed == before.groups_completed and after.groups_consumed == 0
    assert after.data.consumed == 0 and after.data.pending == before.data.pending  # their prompts wait to be served again
    assert len(cursor.pending) == after.data.pending


def test_ray_actor_wrapper(sglang_server, adapters, tiny_world):
    """The RolloutWorker Ray actor (real Ray) serves the same interface."""
    ray = pytest.importorskip("ray")
    from rollout.worker_actor import RolloutWorker

    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = RolloutWorker.remote(sglang_server.cfg, RolloutConfig(max_inflight_per_adapter=4, max_inflight_total=4),
                                      str(tiny_world / "model"), engine_urls=[sglang_server.url])
        health = ray.get(worker.start.remote(), timeout=120)
        assert [h.routable for h in health] == [True]
        spec = rollout_spec(tiny_world, "ray-a", "vowels", "reg-r", max_new_tokens=8)
        ray.get(worker.add_adapter.remote(spec, AdapterWeights.from_folder(adapters["one"])), timeout=60)
        groups, deadline = [], time.monotonic() + 60
        while not groups and time.monotonic() < deadline:
            groups = ray.get(worker.pop_groups.remote("ray-a", 2), timeout=30)
            time.sleep(0.1)
        assert groups and groups[0].adapter == "ray-a" and groups[0].registration_id == "reg-r"
        assert ray.get(worker.remove_adapter.remote("ray-a"), timeout=30) >= 0
        ray.get(worker.shutdown.remote(), timeout=60)
    finally:
        stop_ray()


def test_an_engine_unreachable_during_a_publish_leaves_routing_and_the_version_is_served(sglang_server, adapters, prompts):
    """An engine that dies before the pool noticed (its address refuses connections: port 9) fails
    its part of a publish with EngineUnavailable. It leaves routing, as a dead engine, and the
    publish goes on: the version is current and served by the live engine (CI saw a run registered
    just after an engine was killed FAILED: 'prepare_adapter failed: EngineUnavailable')."""

    async def run():
        dead = EngineClient("http://127.0.0.1:9", admin_timeout_s=2)
        pool = EnginePool([sglang_server.client(), dead])
        try:
            await pool.publish("reach", 0, AdapterWeights.from_folder(adapters["one"]))
            state = pool.current_version("reach"), pool.healthy(0), pool.healthy(1)
            g = await pool.generate_group("reach", prompts[0], GREEDY, 1)
            loaded = await pool.client(0).loaded_adapters()
            await pool.remove_adapter("reach")
            await wait_unloaded(pool)  # the server is shared by the module: the next test's readmit lists it
            return state, g, loaded
        finally:
            await pool.aclose()

    (version, live, reachable), g, loaded = asyncio.run(run())
    assert version == 0 and live and not reachable
    assert g.engine == 0 and g.version == 0 and g.results[0].finish_reason != "abort"
    assert any(n.startswith("reach") for n in loaded)


def test_engine_out_of_routing_is_readmitted_with_its_adapters_brought_up_to_date(sglang_server, adapters, prompts):
    """A connection error takes a live engine out of routing (``mark_unhealthy`` leaves the
    pool exactly as that error does; the real server cannot be made to drop one connection on
    cue). While it is out, the retired v0's unload is skipped, so the server still holds it,
    and with no engine in routing a new version of "back" and a new adapter "fresh" are
    still published (they become current; a tenant is not failed for an engine restart).
    ``readmit`` unloads v0 and v1, loads v2 and fresh's v0, routes to the engine again, and both serve."""
    long = {**GREEDY, "max_new_tokens": 120}

    async def run():
        pool = EnginePool([sglang_server.client()])
        client = sglang_server.client()
        try:
            await pool.publish("back", 0, AdapterWeights.from_folder(adapters["one"]))
            running = asyncio.create_task(pool.generate_group("back", prompts[0], long, 1))
            while pool.inflight("back") < 1:
                await asyncio.sleep(0.01)
            await pool.publish("back", 1, AdapterWeights.from_folder(adapters["two"]))  # v0 retires when its request ends
            pool.mark_unhealthy(0)
            await running  # v0's last request ends while the engine is out: its unload is not sent
            await wait_unloaded(pool)
            await pool.publish("back", 2, AdapterWeights.from_folder(adapters["one"]))
            await pool.publish("fresh", 0, AdapterWeights.from_folder(adapters["two"]))
            current_while_out = pool.current_version("back"), pool.current_version("fresh")
            mine = ("back@", "fresh@")  # the server is shared by the module
            held_while_out = [n for n in await client.loaded_adapters() if n.startswith(mine)]
            t0 = time.perf_counter()
            readmitted = await pool.readmit(0)
            readmit_s = time.perf_counter() - t0
            held_after = await client.loaded_adapters()
            groups = [await pool.generate_group(a, prompts[1], GREEDY, 1) for a in ("back", "fresh")]
            for a in ("back", "fresh"):
                await pool.remove_adapter(a)
            await wait_unloaded(pool)
            return current_while_out, held_while_out, readmitted, readmit_s, held_after, pool.healthy(0), groups
        finally:
            await pool.aclose()
            await client.aclose()

    current_while_out, held_while_out, readmitted, readmit_s, held_after, healthy, groups = asyncio.run(run())
    assert current_while_out == (2, 0)
    assert held_while_out == ["back@v0", "back@v1"]  # the skipped unload left v0; v2 and fresh wait for the engine
    assert readmitted and healthy
    assert held_after == ["back@v2", "fresh@v0"]
    assert [(g.adapter, g.version) for g in groups] == [("back", 2), ("fresh", 0)]
    assert all(g.results[0].finish_reason != "abort" for g in groups)
    print(f"\nengine re-admitted in {readmit_s * 1000:.0f} ms")


def test_worker_readmits_a_live_engine_by_itself(sglang_server, adapters, tiny_world):
    """The rollout worker's watcher takes a live engine back into routing by itself (no restart)."""
    cfg = RolloutConfig(max_inflight_per_adapter=4, max_inflight_total=4)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["watch"], managed=True) as worker:
            await worker.add_adapter(rollout_spec(tiny_world, "watch", "digits", "reg-w", max_new_tokens=8),
                                     AdapterWeights.from_folder(adapters["one"]))
            starts = sglang_server.engine.starts
            worker.pool.mark_unhealthy(0)
            t0 = time.perf_counter()
            await wait_for(lambda: worker.pool.healthy(0), 60, "the watcher to re-admit the engine")
            back_s = time.perf_counter() - t0
            done = worker.core.stats("watch").groups_completed
            await wait_for(lambda: worker.core.stats("watch").groups_completed > done, 60, "a group after re-admission")
            return back_s, starts, sglang_server.engine.starts

    back_s, starts_before, starts_after = asyncio.run(run())
    assert starts_after == starts_before  # taken back, not restarted
    print(f"\nworker re-admitted the engine after {back_s * 1000:.0f} ms")


def test_killed_engine_is_detected_and_its_groups_requeued(sglang_server, adapters, tiny_world):
    """Kill the server mid-generation: the worker marks it dead, re-queues its groups; a restart resumes."""
    cfg = RolloutConfig(max_inflight_per_adapter=8, max_inflight_total=8)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["kill"], managed=True) as worker:
            core = worker.core
            await worker.add_adapter(rollout_spec(tiny_world, "kill", "digits", "reg-k", max_new_tokens=400, ignore_eos=True),
                                     AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("kill").inflight_groups == 2, 60, "2 groups in flight")
            before = core.stats("kill")  # no await between this and the kill: nothing can finish in between
            starts = sglang_server.engine.starts
            t0 = time.perf_counter()
            kill_engine(sglang_server.engine)
            await wait_for(lambda: core.stats("kill").inflight_groups == 0, 60, "the dead engine's groups to end")
            detect_s = time.perf_counter() - t0
            await wait_for(lambda: not sglang_server.engine.is_alive() and not worker.pool.healthy(0), 60,
                           "the engine process gone and out of routing")
            after_kill = core.stats("kill")
            health = await worker.engine_health()
            restarted = await worker.restart_engine(0)
            loaded = await worker.pool.client(0).loaded_adapters()
            await wait_for(lambda: core.stats("kill").groups_completed > after_kill.groups_completed, 120, "a group after the restart")
            return before, detect_s, after_kill, health, starts, restarted, loaded, core.stats("kill")

    try:
        before, detect_s, after_kill, health, starts, restarted, loaded, final = asyncio.run(run())
    finally:  # the module's server is this test's to restore, whatever happened
        if not sglang_server.engine.is_alive():
            sglang_server.engine.restart()
    assert before.inflight_groups == 2 and before.groups_completed == 0  # 400 tokens each: none done yet
    assert after_kill.groups_failed >= 2 and after_kill.groups_requeued == after_kill.groups_failed
    assert after_kill.groups_completed == 0 and after_kill.inflight_groups == 0
    assert "EngineUnavailable" in after_kill.last_error
    # every failed group's prompt waits to be served again; nothing counted as progress
    assert after_kill.data.pending == after_kill.groups_failed and after_kill.data.consumed == 0
    assert [(h.alive, h.routable) for h in health] == [(False, False)]
    assert restarted.alive and restarted.routable and restarted.starts == starts + 1
    assert loaded == [lora_name("kill", 0)]  # the restarted server got the adapter's current version
    assert final.groups_completed >= 1
    print(f"\nkilled engine: its {before.inflight_groups} groups re-queued {detect_s * 1000:.0f} ms after the kill")


# --- one tenant's over-long rows (issue 14 F1, F2) ---------------------------------------------------


def long_rows_spec(tmp_path, tiny_world, name, registration_id, *, limits: bool) -> AdapterRollout:
    """An RL adapter whose 16 prompts are 100,000 characters each (tens of thousands of tokens against
    the tiny model's 512-token context), with the limits registration gives it, or none (as before)."""
    import json

    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} " + "ab 12 " * 16_666, "label": "0123456789"}) + "\n" for i in range(16)))
    data = DataConfig(path=str(path), shuffle_seed=0)
    if limits:
        from service.config.adapter import AdapterConfig
        from service.config.job import SlotCapacity
        from service.config.settings import ServiceSettings
        from service.control.config_checks import row_limits

        cfg = AdapterConfig(data={"path": str(path)}, reward={"name": "target_share"}, sampling={"max_new_tokens": 12, "n_samples_per_prompt": 4})
        data = data.model_copy(update=row_limits(cfg, ServiceSettings(data_roots=[tmp_path]), SlotCapacity(context_tokens=512)))
    return AdapterRollout(name=name, registration_id=registration_id, data=data, reward=RewardConfig(name="target_share"),
                          sampling=SamplingConfig(temperature=1.0, max_new_tokens=12, n_samples_per_prompt=4))


def test_over_long_rows_are_skipped_and_counted_while_another_tenant_generates(sglang_server, adapters, tiny_world, tmp_path):
    """F1/F2: an adapter whose every prompt is over the model's context sends no request at all: its
    rows are skipped and counted, its stats carry a fatal_reason (the service fails the run with it),
    and the other tenant on the same engine keeps generating."""
    cfg = RolloutConfig(max_inflight_per_adapter=8, max_inflight_total=16, max_buffered_groups_per_adapter=3)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["digits", "long"]) as worker:
            core = worker.core
            await worker.add_adapter(long_rows_spec(tmp_path, tiny_world, "long", "reg-long", limits=True), AdapterWeights.from_folder(adapters["two"]))
            await worker.add_adapter(rollout_spec(tiny_world, "digits", "digits", "reg-d"), AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("long").fatal_reason is not None, 120, "the long adapter's fatal_reason")
            await wait_for(lambda: core.stats("digits").groups_completed >= 3, 120, "3 digits groups")
            return core.stats("long"), core.stats("digits")

    long, digits = asyncio.run(run())
    assert long.fatal_reason.startswith("no usable rows: all 16 rows of long.jsonl are over a length limit (e.g. prompt of "), long.fatal_reason
    assert "tokens > max_prompt_tokens 500" in long.fatal_reason  # 512-token context minus 12 new tokens
    assert (long.data.skipped_too_long, long.data.skip_metrics()["rows_skipped_too_long"]) == (16, 16.0)
    assert (long.groups_failed, long.rejections_in_a_row, long.inflight_requests, long.groups_completed) == (0, 0, 0, 0)  # nothing reached the engine
    assert digits.fatal_reason is None and digits.groups_failed == 0 and digits.data.skipped_too_long == 0


def test_requests_the_engine_keeps_refusing_stop_the_adapter_with_a_reason(sglang_server, adapters, tiny_world, tmp_path):
    """F2: without length limits (as before issue 14) the engine answered 400 to every request of the
    adapter, about 5 a second, and the run sat ACTIVE at step 0 with no reason. Now it stops after
    max_rejections_in_a_row refusals and its stats say why; the other tenant is unaffected."""
    cfg = RolloutConfig(max_inflight_per_adapter=8, max_inflight_total=16, max_buffered_groups_per_adapter=3, max_rejections_in_a_row=3)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["digits", "long"]) as worker:
            core = worker.core
            await worker.add_adapter(long_rows_spec(tmp_path, tiny_world, "long", "reg-long", limits=False), AdapterWeights.from_folder(adapters["two"]))
            await worker.add_adapter(rollout_spec(tiny_world, "digits", "digits", "reg-d"), AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("long").fatal_reason is not None, 120, "the long adapter's fatal_reason")
            stopped = core.stats("long")
            failed_then, inflight_then = stopped.groups_failed, stopped.inflight_groups
            await wait_for(lambda: core.stats("digits").groups_completed >= 3, 120, "3 digits groups")
            # requests already in flight when it stopped still come back (refused); none is sent after
            await wait_for(lambda: core.stats("long").inflight_requests == 0, 120, "the long adapter's requests in flight")
            return core.stats("long"), failed_then, inflight_then, core.stats("digits")

    long, failed_then, inflight_then, digits = asyncio.run(run())
    assert long.fatal_reason.startswith("the engines refused 3 requests in a row (HTTP 400); last: "), long.fatal_reason
    assert "longer than the model's context length (512 tokens)" in long.fatal_reason
    assert 3 <= long.groups_failed <= failed_then + inflight_then, (long.groups_failed, failed_then, inflight_then)  # no new group after the stop
    assert digits.fatal_reason is None and digits.groups_completed >= 3


# --- publishing that scales (issue 18 items 3-4) -------------------------------------------------


def _handoff_copy(src, root, tag) -> AdapterWeights:
    """A handoff folder, as the trainer writes it for one version (service/fleet/fleet_runtime.py _engine_weights)."""
    import shutil

    dest = root / tag
    shutil.copytree(src, dest)
    return AdapterWeights.from_folder(dest, handoff=True)


def test_handoff_folders_are_deleted_once_superseded_failed_or_removed(sglang_server, adapters, prompts, tiny_world, tmp_path):
    """File handoff (weight_transfer 'disk'): the engine reads each version's folder; the folder of a
    version is deleted once a newer one is loaded, when its load fails, and when the adapter is removed,
    so 20 publishes under load leave exactly one folder (the current one, which an engine that comes
    back would load) and the server serves the last version's weights (== HF+PEFT greedy)."""
    root = tmp_path / "handoff"
    root.mkdir()
    bad = make_peft_adapter(tiny_world / "model", tmp_path / "r16", seed=3, rank=16)  # refused: rank 16 > --max-lora-rank 8
    want = hf_greedy(tiny_world / "model", adapters["two"], prompts[:2])

    async def run():
        pool = EnginePool([sglang_server.client()], weight_transfer="disk")
        counts = []
        try:
            await pool.publish("ho", 0, _handoff_copy(adapters["one"], root, "v0"))
            params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
            for v in range(1, 21):
                load = [asyncio.create_task(pool.generate_group("ho", prompts[0], params, 2)) for _ in range(2)]
                await pool.publish("ho", v, _handoff_copy(adapters["one" if v % 2 else "two"], root, f"v{v}"))
                counts.append(len(list(root.iterdir())))
                await asyncio.gather(*load)
            refused = None
            try:
                await pool.publish("ho", 21, _handoff_copy(bad, root, "v21"))
            except Exception as e:  # noqa: BLE001 - the engine refuses it (HTTP 400)
                refused = e
            after_refusal = sorted(p.name for p in root.iterdir())
            out = await asyncio.gather(*(pool.generate_group("ho", ids, GREEDY, 1) for ids in prompts[:2]))
            await pool.remove_adapter("ho")
            await wait_unloaded(pool)
            return counts, refused, after_refusal, out, pool.current_version, sorted(p.name for p in root.iterdir())
        finally:
            await pool.aclose()

    counts, refused, after_refusal, out, _, after_remove = asyncio.run(run())
    assert counts == [1] * 20  # only the current version's folder, after every publish
    assert getattr(refused, "status", None) == 400 and after_refusal == ["v20"]  # the refused version's folder is gone, v20 still current
    assert [g.results[0].token_ids for g in out] == want  # v20 (adapter two) is what the server serves
    assert after_remove == []


def test_a_publish_counts_for_staleness_before_the_engines_loaded_it(sglang_server, adapters, tiny_world):
    """Issue 18 item 4, G1: the loop hands a version over and trains on while the engines load it. A
    step that pops groups during that load must see the groups of the older weights one publish
    behind (max_staleness 0: none of them is handed out), not as fresh."""
    cfg = RolloutConfig(max_inflight_per_adapter=4, max_inflight_total=4, max_staleness=0, max_buffered_groups_per_adapter=4)

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["st"]) as worker:
            core = worker.core
            await worker.add_adapter(rollout_spec(tiny_world, "st", "digits", "reg-st"), AdapterWeights.from_folder(adapters["one"]))
            await wait_for(lambda: core.stats("st").buffered_groups >= 2, 120, "2 buffered groups of v0")
            publish = asyncio.create_task(worker.publish_version("st", 1, AdapterWeights.from_folder(adapters["two"])))
            await asyncio.sleep(0)  # the publish has started: its load request is in flight, not finished
            version_while_loading = core.pool.current_version("st")
            popped_while_loading = await worker.pop_groups("st", 10)
            await publish
            fresh = []

            async def popped_a_group():
                fresh.extend(await worker.pop_groups("st", 10))
                return bool(fresh)

            await wait_for(popped_a_group, 120, "a group of v1")
            return version_while_loading, popped_while_loading, fresh, core.stats("st")

    version_while_loading, popped_while_loading, fresh, stats = asyncio.run(run())
    assert version_while_loading == 0  # the engines did not serve v1 yet ...
    assert popped_while_loading == []  # ... yet the v0 groups already counted as stale for max_staleness 0
    assert stats.dropped_stale >= 2
    assert fresh and all(g.version == 1 and g.staleness == 0 for g in fresh)


def test_the_worker_loads_a_handoff_folder_once_the_trainer_wrote_it(sglang_server, adapters, prompts, tiny_world, tmp_path):
    """The loop hands over a folder the trainer is still writing (rollout.engines.weights.PendingFolder): the
    worker counts the version at once, loads it once the write finished (the server then serves it,
    == HF+PEFT greedy), and a failed write fails the publish, deletes the folder and keeps the old version."""
    import shutil

    from rollout.engines.weights import PendingFolder

    cfg = RolloutConfig(max_inflight_per_adapter=4, max_inflight_total=4, max_buffered_groups_per_adapter=2)
    want = hf_greedy(tiny_world / "model", adapters["two"], prompts[:1])

    async def run():
        async with started_worker(sglang_server, cfg, tiny_world, ["pf"]) as worker:
            await worker.add_adapter(rollout_spec(tiny_world, "pf", "digits", "reg-pf"), AdapterWeights.from_folder(adapters["one"]))
            written = asyncio.Event()

            async def trainer_writes(dest):  # stands for the trainer rank's export_peft call
                await written.wait()
                shutil.copytree(adapters["two"], dest)

            dest = tmp_path / "handoff" / "pf-v1"
            publish = asyncio.create_task(worker.publish_version("pf", 1, PendingFolder(dest, [asyncio.create_task(trainer_writes(dest))])))
            await asyncio.sleep(0.2)
            waiting = (not publish.done(), worker.pool.current_version("pf"), worker.core._run("pf").buffer.published[-1])
            written.set()
            await publish
            served = await worker.pool.generate_group("pf", prompts[0], GREEDY, 1)

            async def write_fails():
                (tmp_path / "handoff" / "pf-v2").mkdir()
                raise RuntimeError("trainer rank died while exporting (planted)")

            bad = tmp_path / "handoff" / "pf-v2"
            with pytest.raises(RuntimeError, match="planted"):
                await worker.publish_version("pf", 2, PendingFolder(bad, [asyncio.create_task(write_fails())]))
            return waiting, served, worker.pool.current_version("pf"), bad.exists(), dest.exists()

    waiting, served, version_after_failure, bad_exists, current_exists = asyncio.run(run())
    assert waiting == (True, 0, 1)  # not loaded before the write; already counted for staleness
    assert served.version == 1 and served.results[0].token_ids == want[0]
    assert version_after_failure == 1 and not bad_exists and current_exists


def test_a_burst_of_publishes_serves_the_newest_and_never_a_superseded_one(sglang_server, prompts, tiny_world, tmp_path):
    """Latest-wins (issue 28) over the real trainer (one TrainerGroup rank on Ray, fp32 CPU) and the
    real rollout worker on the module's server. With the trainer's writer held (the named fault
    injection), four steps each publish the adapter keyed by its registration, as the service does:
    v1..v3 are superseded in the writer's queue, so publish_version reports them superseded at once,
    they are never written (no folder, no temporary) and never loaded by the engine; v4 is written
    once the writer runs, loaded and served (== HF+PEFT greedy of its folder, which holds exactly the
    weights of a synchronous export after step 4). The buffer counted all four publishes, so the v0
    groups are 4 publishes behind and dropped (max_staleness 1), and the groups that come back are
    v4's at staleness 0."""
    import shutil

    from rollout.engines.weights import PendingFolder
    from rollout.messages import PUBLISH_LOADED, PUBLISH_SUPERSEDED
    from service.fleet.trainer_group import TrainerGroup
    from tests.trainer_probes import hold_export_writes
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams, TrainerConfig

    import torch
    from safetensors.torch import load_file

    def batch(seed):
        gen = torch.Generator().manual_seed(seed)
        return TrainBatch(samples=[TrainSample(slot=0, tokens=torch.randint(0, 400, (10,), generator=gen).tolist(),
                                               loss_mask=[0, 0] + [1] * 8) for _ in range(2)])

    root = tmp_path / "handoff"
    rollout_cfg = RolloutConfig(max_inflight_per_adapter=4, max_inflight_total=4, max_staleness=1, max_buffered_groups_per_adapter=2)
    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = TrainerGroup(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=1, max_rank=4, micro_batch_tokens=64),
                         setup_timeout_s=300, call_timeout_s=60)
    try:
        group.start()
        group.init_slot(0, SlotHyperParams(rank=4, alpha=8, lr=3e-2, samples_per_step=2, objective="sft"), seed=0)
        assert train_batch(group, batch(0)).stepped == [0]  # B leaves its zero init: the versions differ
        group.export_peft(0, tmp_path / "v0")

        async def run():
            async with started_worker(sglang_server, rollout_cfg, tiny_world, ["lw"]) as worker:
                await worker.add_adapter(rollout_spec(tiny_world, "lw", "digits", "reg-lw", max_new_tokens=6),
                                         AdapterWeights.from_folder(tmp_path / "v0"))
                await wait_for(lambda: worker.core.stats("lw").buffered_groups >= 2, 120, "2 buffered groups of v0")
                client = worker.pool.client(0)
                loads, inner = [], client.load_adapter

                async def recording_load(name, *args, **kwargs):
                    loads.append(name)
                    return await inner(name, *args, **kwargs)

                client.load_adapter = recording_load
                hold_export_writes(group, True)
                try:
                    publishes = []
                    for v in range(1, 5):
                        assert train_batch(group, batch(v)).stepped == [0]
                        folder = root / f"lw-v{v}"
                        refs = group.begin_export_peft(0, folder, "float32", "reg-lw")
                        publishes.append(asyncio.create_task(worker.publish_version("lw", v, PendingFolder(folder, refs))))
                    early = await asyncio.wait_for(asyncio.gather(*publishes[:3]), 120)  # superseded while the writer is held
                    still_waiting = not publishes[3].done()
                    written_while_held = sorted(p.name for p in root.iterdir()) if root.exists() else []
                finally:
                    hold_export_writes(group, False)
                last = await asyncio.wait_for(publishes[3], 120)
                shutil.copytree(root / "lw-v4", tmp_path / "seen-v4")  # what the engine loaded (deleted with the adapter)
                popped = await worker.pop_groups("lw", 10)  # the v0 groups (4 publishes behind) are dropped here
                fresh = []

                async def fresh_groups():
                    fresh.extend(await worker.pop_groups("lw", 10))
                    return bool(fresh)

                await wait_for(fresh_groups, 120, "a group of v4")
                served = await worker.pool.generate_group("lw", prompts[0], GREEDY, 1)
                stats = worker.core.stats("lw")
                published = list(worker.core._run("lw").buffer.published)
                return early, still_waiting, written_while_held, last, popped, fresh, served, stats, published, loads

        early, still_waiting, written_while_held, last, popped, fresh, served, stats, published, loads = asyncio.run(run())
        group.export_peft(0, tmp_path / "sync-v4")
    finally:
        group.stop()
        stop_ray()
    assert early == [PUBLISH_SUPERSEDED] * 3 and still_waiting and written_while_held == []
    assert last == PUBLISH_LOADED
    assert loads == [lora_name("lw", 4)]  # the engine never loaded v1..v3
    assert sorted(p.name for p in root.iterdir()) == []  # v4's handoff folder is gone with the adapter; v1..v3 never were
    assert published == [2, 3, 4]  # every publish counted (the buffer keeps the last max_staleness + 2)
    assert all(g.version == 4 for g in popped) and stats.dropped_stale >= 2  # no v0 group was handed out
    assert fresh and all(g.version == 4 and g.staleness == 0 for g in fresh)
    assert served.version == 4
    want = hf_greedy(tiny_world / "model", tmp_path / "sync-v4", prompts[:1])
    assert served.results[0].token_ids == want[0]  # the engine serves the step-4 weights
    v0, seen, v4 = (load_file(str(tmp_path / x / "adapter_model.safetensors")) for x in ("v0", "seen-v4", "sync-v4"))
    assert sorted(seen) == sorted(v4) and all(torch.equal(seen[k], v4[k]) for k in v4)  # v4 is the step-4 snapshot
    assert any(not torch.equal(v0[k], v4[k]) for k in v0)  # so the greedy check can tell the versions apart
