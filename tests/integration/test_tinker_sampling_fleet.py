"""Tinker sampling over TWO real SGLang CPU engines (started once for the module, ~35-60 s and 3.5 GB
each), the official SDK against the in-process Tinker service, whose sampler follows a live list of
both engines (api/tinker/sampling/engines.py; in the fleet the list is the rollout worker's) and keeps
its sessions and stability records in the host's registry (service/registry/sampling_records.py):

* several sessions of different adapters: both engines serve, each session sticks to its engine, no
  request waits for adapter room (4 adapters, 2 places per engine: loaded once each, nothing
  unloaded), and the same weights give the same greedy tokens on either engine;
* stable_reinforce on samples recorded with record_stability_info: the call's loss is the definition's
  (tests/reference/stable_reinforce.py) of the log-probs the trainer returns and the log-probs the
  engine recorded (equal to what the SDK received), whatever log-probs the client sends; its
  statistics come back (ratio ~1: engine and trainer agree); another tenant, or a sample made
  without record_stability_info, is refused;
* a session outlives its sampler (a restart of the service's sampling side over the same registry):
  the same SDK client samples on, its adapter reloaded on demand, the same greedy tokens;
* an engine frozen with a request in flight and then killed: the request is retried on the other
  engine and answered in full; the engine, restarted (a new URL), is used at once.
The last test breaks an engine and restores it (it restarts it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-fleet-sampling-1", "bob": "tml-bob-fleet-sampling-22"}
BASE = "tiny-qwen3"
PLACES = 2  # sampler adapters per engine


@pytest.fixture(scope="module")
def engines(tiny_world, tmp_path_factory):
    from rollout.config import EngineConfig
    from rollout.engines.engine import EngineProcess
    from tests.integration.sglang_fixtures import DEFAULT_ENGINE

    logs = tmp_path_factory.mktemp("sglang-logs")
    procs = [EngineProcess(i, EngineConfig(**DEFAULT_ENGINE), tiny_world / "model", log_dir=logs) for i in range(2)]
    try:
        for p in procs:  # both start at once: the module pays one start, not two
            p.start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory, engines):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from api.tinker.sampling.engines import EngineEntry
    from api.tinker.sampling.sampler import SglangSampler
    from tests.tinker_in_process import in_process_service, tinker_app

    async def fleet_list():  # what the rollout worker's engine_health gives in the fleet
        return [EngineEntry(p.index, p.url, p.is_alive(), 0, p.starts) for p in engines if p.port is not None]

    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), tmp_path_factory.mktemp("ckpt"), num_slots=2, max_rank=8,
                             base_model=BASE)  # each test unloads its models
    svc.sampler = SglangSampler(fleet_list, records=svc.host.registry, max_loaded=PLACES, refresh_s=0.5)
    svc.fleet_list = fleet_list
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url


def _prompts(tiny_world, tok, n):
    rows = [json.loads(line) for line in (tiny_world / "data" / "digits.jsonl").read_text().splitlines()][:n]
    return [tok.encode(r["prompt"]) for r in rows]


def _trained_model(svc, sc, tiny_world, steps=2):
    """Alice's model after a few SFT steps (its samples differ from the base model's)."""
    from tests.integration.test_tinker_sampling import sft_then_sampler_weights

    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:8]
    sft_then_sampler_weights(svc, tc, rows, steps, "warm")
    return tc, tc.get_tokenizer()


def _sampling_client(svc, url, tiny_world, name):
    """Alice's trained model, a sampler checkpoint of it under ``name``, a sampling client of that, a prompt."""
    sc = open_client(url, KEYS["alice"])
    tc, tok = _trained_model(svc, sc, tiny_world, steps=1)
    path = tc.save_weights_for_sampler(name).result().path
    return sc, tc, path, sc.create_sampling_client(model_path=path).result(), _prompts(tiny_world, tok, 1)[0]


@contextlib.contextmanager
def frozen(engine):  # noqa: ANN001 - a rollout.engines.engine.EngineProcess
    """The engine's processes stopped (SIGSTOP): a request sent to it stays in flight; continued at exit."""
    pgid = os.getpgid(engine.pid)
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield pgid
    finally:
        try:
            os.killpg(pgid, signal.SIGCONT)
        except ProcessLookupError:  # killed meanwhile
            pass


def _greedy(client, prompt, n=1, max_tokens=8):
    from tinker import types

    res = client.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(s.tokens) for s in res.result().sequences]


def _session_of(svc, model_path):
    return next(s for s in svc.sampler.sessions.values() if s.model_path == model_path)


def _delta(after, before, key):
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_sessions_spread_stick_and_never_wait_for_room(world, tiny_world):
    from tinker import types

    svc, url = world
    sc = open_client(url, KEYS["alice"])
    tc, tok = _trained_model(svc, sc, tiny_world)
    paths = [tc.save_weights_for_sampler(f"spread-{i}").result().path for i in range(2 * PLACES)]
    clients = [sc.create_sampling_client(model_path=p).result() for p in paths]
    prompt = _prompts(tiny_world, tok, 1)[0]
    before = svc.sampler.metrics()
    rounds = []
    for _ in range(3):
        futures = [c.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, temperature=0.0))
                   for c in clients]
        rounds.append([[list(s.tokens) for s in f.result().sequences] for f in futures])
        holders = [svc.sampler.engines.holders(_session_of(svc, p).lora_name) for p in paths]
        assert all(len(h) == 1 for h in holders), holders  # each adapter on one engine
        if len(rounds) == 1:
            first_holders = holders
        assert holders == first_holders  # R1: every session stays on its engine
    after = svc.sampler.metrics()
    served = [_delta(after, before, f"sampler.requests.{i}") for i in range(2)]
    loads = sum(_delta(after, before, f"sampler.adapter_loads.{i}") for i in range(2))
    unloads = sum(_delta(after, before, f"sampler.adapter_unloads.{i}") for i in range(2))
    print("requests per engine", served, "loads", loads, "unloads", unloads, "holders", first_holders)
    assert all(n > 0 for n in served), served  # both engines served
    assert sorted(h[0] for h in first_holders) == [0, 0, 1, 1]  # two adapters per engine: room used where it was
    assert loads == 2 * PLACES and unloads == 0  # loaded once each; nothing unloaded for room while an engine had room
    tokens = {json.dumps(r) for rnd in rounds for r in rnd}
    assert len(tokens) == 1, tokens  # the same weights greedy: the same tokens, on either engine, every round

    from prometheus_client import CollectorRegistry, generate_latest

    from api.tinker.metrics import add_tinker_gauges

    reg = CollectorRegistry(auto_describe=False)
    add_tinker_gauges(reg, after)
    text = generate_latest(reg).decode()
    for i in range(2):
        assert f'lorafleet_tinker_sample_requests_total{{engine="{i}"}} {after[f"sampler.requests.{i}"]}' in text, text
    svc.unload(tc.model_id)


def _rl_datums(prompt, seqs, advantages, client_logprobs):
    """The rl_loop recipe's datums (tinker_cookbook/recipes/rl_loop.py, with_sampled_provenance)."""
    from tinker import types

    out = []
    for s, adv in zip(seqs, advantages):
        tokens, ob = list(s.tokens), len(prompt) - 1
        d = types.Datum(model_input=types.ModelInput.from_ints(prompt + tokens[:-1]), loss_fn_inputs={
            "target_tokens": [0] * ob + tokens, "logprobs": [0.0] * ob + [client_logprobs] * len(tokens),
            "advantages": [0.0] * ob + [adv] * len(tokens)})
        out.append(d.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=ob),
                            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(tokens))]))
    return out


def test_stable_reinforce_trains_on_what_the_engine_recorded(world, tiny_world):
    from tinker import types

    from tests.reference.stable_reinforce import reference_loss_and_grad

    svc, url = world
    sc = open_client(url, KEYS["alice"])
    tc, tok = _trained_model(svc, sc, tiny_world, steps=1)
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = _prompts(tiny_world, tok, 1)[0]
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, temperature=1.0)).result().sequences
    seqs = [s for s in seqs if len(s.tokens) >= 2]
    assert seqs and all(s.sequence_id for s in seqs)
    recs = svc.host.registry.sampled_sequences("alice", [s.sequence_id for s in seqs], touch=False)
    for s in seqs:  # the record is what the SDK received from the engine
        assert list(recs[s.sequence_id].tokens) == list(s.tokens) and list(recs[s.sequence_id].logprobs) == list(s.logprobs)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(seqs))]
    cfg = {"kl_coeff": 0.1}
    out = {}
    for garbage in (-5.0, -0.01):  # the client's logprobs are not what the loss uses
        out[garbage] = tc.forward(_rl_datums(prompt, seqs, advantages, garbage), "stable_reinforce", cfg).result()
    assert out[-5.0].metrics["loss:sum"] == out[-0.01].metrics["loss:sum"]
    res = out[-5.0]
    terms, ratios = [], []
    for s, adv, o in zip(seqs, advantages, res.loss_fn_outputs):
        lp = o["logprobs"].to_torch().double().tolist()
        ob = len(prompt) - 1
        q = [0.0] * ob + list(recs[s.sequence_id].logprobs)
        groups = [0] * ob + [1] * len(s.tokens)
        terms += reference_loss_and_grad(lp, q, [0.0] * ob + [adv] * len(s.tokens), groups, cfg)[0]
        ratios += [pow(2.718281828459045, a - b) for a, b in zip(lp[ob:], q[ob:])]
    want = sum(terms)
    # The trainer sums the terms in fp32, and terms of both signs (advantages +-1) cancel to a small
    # loss: the error bound of an fp32 sum of n terms is n * 2^-24 * sum |term| (gamma_n, Higham 4.2),
    # with a few more ulps for each term's own exp and product. A fixed 1e-6 failed in CI at 1.1e-6.
    tol = (len(terms) + 4) * 2.0**-24 * sum(abs(t) for t in terms)
    m = res.metrics
    print("stable_reinforce metrics", m, "reference loss", want, "fp32 bound", tol)
    assert m["loss:sum"] == pytest.approx(want, rel=0, abs=tol)
    assert m["stable_reinforce/sequences:sum"] == len(seqs) and m["stable_reinforce/masked_sequences:sum"] == 0
    assert m["stable_reinforce/sampled_tokens:sum"] == sum(len(s.tokens) for s in seqs)
    assert m["stable_reinforce/ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)
    assert abs(m["stable_reinforce/ratio:mean"] - 1) < 1e-4  # the CPU engine and the fp32 trainer agree (~1e-6)
    # it trains: forward_backward + optim_step with the same data
    fb = tc.forward_backward(_rl_datums(prompt, seqs, advantages, 0.0), "stable_reinforce", cfg).result()
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=0, abs=tol)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result() is not None
    assert svc.sampler.metrics()["stable_reinforce.calls"] >= 3

    bob = open_client(url, KEYS["bob"]).create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    with pytest.raises(Exception, match="which is not a sequence this API key sampled"):
        bob.forward(_rl_datums(prompt, seqs, advantages, 0.0), "stable_reinforce").result()
    plain = tc.save_weights_and_get_sampling_client().result()  # no record_stability_info: ids, but no records
    unrecorded = plain.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4)).result().sequences
    with pytest.raises(Exception, match="record_stability_info=True"):
        tc.forward(_rl_datums(prompt, [s for s in unrecorded if len(s.tokens) >= 2][:1], [1.0], 0.0), "stable_reinforce").result()
    svc.unload(tc.model_id)
    svc.unload(bob.model_id)


def test_a_session_outlives_its_sampler(world, tiny_world):
    """The service's sampling side restarts over the same registry (a new sampler; the engines keep
    what they held): the same SDK client samples on; its adapter is reloaded on demand (the stale copy
    the engine still held is unloaded first); the same greedy tokens."""
    from api.tinker.sampling.sampler import SglangSampler

    svc, url = world
    _, tc, path, client, prompt = _sampling_client(svc, url, tiny_world, "survivor")
    before = _greedy(client, prompt)
    lora = _session_of(svc, path).lora_name
    # the old sampler's HTTP clients are left to the garbage collector (closing them needs the serving loop)
    svc.sampler = SglangSampler(svc.fleet_list, records=svc.host.registry, max_loaded=PLACES, refresh_s=0.5)
    assert lora and not svc.sampler.sessions  # the new sampler knows no session in memory
    assert _greedy(client, prompt) == before
    assert svc.sampler.sessions[_session_of(svc, path).session_id].lora_name == lora
    assert sum(v for k, v in svc.sampler.metrics().items() if k.startswith("sampler.adapter_loads.")) == 1
    svc.unload(tc.model_id)


def test_an_engine_killed_mid_request_is_retried_on_the_other_and_its_restart_is_used(world, engines, tiny_world):
    from tinker import types

    svc, url = world
    sc, tc, path, client, prompt = _sampling_client(svc, url, tiny_world, "victim")
    want = _greedy(client, prompt, n=2)
    (k,) = svc.sampler.engines.holders(_session_of(svc, path).lora_name)
    other = 1 - k
    victim = engines[k]
    before = svc.sampler.metrics()
    with frozen(victim) as pgid:  # the next request of the session goes to it (sticky) and hangs there
        future = client.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, temperature=0.0))
        wait_until(lambda: svc.sampler.metrics().get(f"sampler.requests.{k}", 0) > before.get(f"sampler.requests.{k}", 0),
                   f"the request routed to the frozen engine {k}", timeout_s=60)
        os.killpg(pgid, signal.SIGKILL)  # the engine dies with the request in flight
    got = [list(s.tokens) for s in future.result(timeout=120).sequences]
    assert got == want  # answered in full by the other engine, the same greedy tokens
    after = svc.sampler.metrics()
    assert _delta(after, before, f"sampler.requests.{other}") == 1 and _delta(after, before, f"sampler.adapter_loads.{other}") == 1
    assert svc.sampler.engines.holders(_session_of(svc, path).lora_name) == [other]

    victim.restart()  # a new process on a new port: the fleet's list names it anew
    with frozen(engines[other]):  # the other engine busy (frozen) with a request...
        busy = client.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, temperature=0.0))
        wait_until(lambda: svc.sampler.metrics()[f"sampler.requests.{other}"] > after[f"sampler.requests.{other}"],
                   "a request in flight on the frozen engine", timeout_s=60)
        base = sc.create_sampling_client(base_model=BASE).result()
        assert _greedy(base, prompt)  # ...so the least loaded is the restarted engine: used at once
        assert svc.sampler.metrics()[f"sampler.requests.{k}"] > after[f"sampler.requests.{k}"]
    assert busy.result(timeout=120).sequences
    svc.unload(tc.model_id)
