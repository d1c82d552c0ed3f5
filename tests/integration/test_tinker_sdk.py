"""The official tinker SDK (0.38.0, unmodified) against lorafleet's Tinker routes, served by
uvicorn on loopback over an in-process trainer on the tiny world (one server per module).

* SL loop: cross_entropy on the tiny world's SFT data, loss falls clearly in 20 steps.
* The SDK's defaults (``create_lora_training_client(base_model, rank)``: LoRA on attention, MLP
  and the unembedding): the loss falls, the unembedding LoRA trains, save_state/load_state
  round-trips it exactly, weights_info reports the targets; train_attn/train_mlp False too.
* Four SDK clients (four tenants) at once: fewer mixed steps than forward_backward
  calls, and each model's weights and Adam moments after 3 steps equal the same model
  trained alone (fp32).
* save_state -> create_training_client_from_state_with_optimizer resumes exactly;
  the weights-only load starts the optimizer afresh.
* Auth and isolation scenario table (raw HTTP: what the SDK would send).
* Bad input: a clear error in the future's result, nothing changed for anyone.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.tinker_views import core, slot_of
from tests.numerics import max_rel_err
from tests.reference.losses import tinker_token_loss

pytestmark = pytest.mark.integration

KEYS = {f"t{i}": f"tml-tenant{i}-secret-key" for i in range(5)}
BASE = "tiny-qwen3"
WINDOW_S = 0.3  # generous so that the four clients' calls land in one window even on a busy CI machine
MAX_SEQ = 96
EQ_ADAM = dict(learning_rate=2e-2, eps=1e-2)  # eps: see tests/integration/test_trainer_equivalence.py


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app

    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), tmp_path_factory.mktemp("ckpt"), num_slots=6,
                             max_rank=8, base_model=BASE, window_s=WINDOW_S, micro_batch_tokens=256, max_seq_len=MAX_SEQ)
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url


def client(url, tenant):
    return open_client(url, KEYS[tenant])


def training_client(sc, seed=0, rank=4):
    return sc.create_lora_training_client(base_model=BASE, rank=rank, seed=seed, train_unembed=False).result()


def sft_data(tok, tiny_world, start, n):
    from tinker import types

    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][start : start + n]
    data = []
    for r in rows:
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        full = p + c
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    return data


def slot_state(svc, model_id):
    from trainer.swap.slot_checkpoint import slot_state_tensors

    parts = slot_state_tensors(core(svc), slot_of(svc, model_id))
    return {f"{k}.{i}.{n}": t for k in ("weight", "exp_avg", "exp_avg_sq", "grad") for i in (0, 1) for n, t in parts[k][i].items()}


def train(tc, data, steps, adam):
    from tinker import types

    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(**adam))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def test_sl_loop_loss_falls(world, tiny_world):
    svc, url = world
    sc = client(url, "t0")
    tc = training_client(sc, seed=1)
    data = sft_data(tc.get_tokenizer(), tiny_world, 0, 16)
    losses = train(tc, data, 20, dict(learning_rate=5e-3))
    # measured: 607 -> 482, falling steadily after step 4
    assert losses[-1] < 0.85 * losses[0] and max(losses[-5:]) < min(losses[:5]), losses
    svc.unload(tc.model_id)


def test_sdk_defaults_train_the_unembedding_and_round_trip(world, tiny_world):
    """The plain SDK call, as every cookbook recipe makes it: LoRA on attention, MLP and lm_head."""
    svc, url = world
    sc = client(url, "t0")
    tc = sc.create_lora_training_client(base_model=BASE, rank=8).result()
    assert core(svc).slots[slot_of(svc, tc.model_id)].hyper.targets == ("attention", "mlp", "unembed")
    data = sft_data(tc.get_tokenizer(), tiny_world, 80, 8)
    losses = train(tc, data, 8, dict(learning_rate=5e-3))
    print("SDK-default losses", [round(x, 1) for x in losses])
    assert losses[-1] < 0.9 * losses[0], losses
    state = slot_state(svc, tc.model_id)
    assert state["weight.1.output_layer"].abs().max() > 0  # the unembedding's B moved
    assert state["exp_avg_sq.1.output_layer"].abs().max() > 0
    path = tc.save_state("defaults").result().path
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:
        info = http.post("weights_info", headers={"X-API-Key": KEYS["t0"]}, json={"tinker_path": path}).json()
    assert info["train_unembed"] is True and info["train_mlp"] is True and info["train_attn"] is True, info
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    got = slot_state(svc, resumed.model_id)
    assert set(got) == set(state) and all(torch.equal(state[k], got[k]) for k in state)  # bit-exact, lm_head included
    train(tc, data, 1, dict(learning_rate=5e-3))
    train(resumed, data, 1, dict(learning_rate=5e-3))
    a, b = slot_state(svc, tc.model_id), slot_state(svc, resumed.model_id)
    assert all(torch.equal(a[k], b[k]) for k in a)  # and it trains on exactly as the original

    # the other flags are honoured too; all off is refused with what to do
    narrow = sc.create_lora_training_client(base_model=BASE, rank=8, train_attn=False, train_mlp=False).result()
    assert core(svc).slots[slot_of(svc, narrow.model_id)].hyper.targets == ("unembed",)
    narrow_path = narrow.save_state("unembed-only").result().path
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:
        info = http.post("weights_info", headers={"X-API-Key": KEYS["t0"]}, json={"tinker_path": narrow_path}).json()
    assert (info["train_unembed"], info["train_mlp"], info["train_attn"]) == (True, False, False), info
    with pytest.raises(Exception, match="checkpoint trains \\['unembed'\\], the model trains \\['attention', 'mlp', 'unembed'\\]"):
        tc.load_state(narrow_path).result()
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:  # the SDK refuses it itself: raw HTTP
        key = {"X-API-Key": KEYS["t0"]}
        sid = http.post("create_session", headers=key, json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
        off = {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}
        rid = http.post("create_model", headers=key, json={"session_id": sid, "model_seq_id": 0, "base_model": BASE,
                                                           "lora_config": off}).json()["request_id"]
        got = http.post("retrieve_future", headers=key, json={"request_id": rid}).json()
        assert got["category"] == "user" and "all False: at least one must be True" in got["error"], got
    for m in (tc, resumed, narrow):
        svc.unload(m.model_id)


def test_four_clients_coalesce_and_equal_alone(world, tiny_world):
    svc, url = world
    tenants = ["t1", "t2", "t3", "t4"]
    clients = {t: training_client(client(url, t), seed=10 + i) for i, t in enumerate(tenants)}
    tok = clients["t1"].get_tokenizer()
    data = {t: sft_data(tok, tiny_world, 20 + 4 * i, 3 + i) for i, t in enumerate(tenants)}
    before = svc.metrics()
    barrier = threading.Barrier(len(tenants))
    errors = []

    def run(t):
        try:
            barrier.wait(timeout=60)
            train(clients[t], data[t], 3, EQ_ADAM)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,)) for t in tenants]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    after = svc.metrics()
    calls = after["forward_backward_calls"] - before["forward_backward_calls"]
    steps = after["mixed_steps"] - before["mixed_steps"]
    assert calls == 12 and steps < calls, after
    mixed = {t: {k: v.clone() for k, v in slot_state(svc, clients[t].model_id).items()} for t in tenants}
    for t in tenants:
        svc.unload(clients[t].model_id)

    for i, t in enumerate(tenants):  # each model again, alone
        alone = training_client(client(url, t), seed=10 + i)
        train(alone, data[t], 3, EQ_ADAM)
        ref = slot_state(svc, alone.model_id)
        worst = max(max_rel_err(mixed[t][k], ref[k]) for k in ref if ref[k].abs().max() > 0)
        assert worst <= 1e-5, f"{t}: mixed vs alone {worst:.2e}"
        assert ref["weight.1.decoder.layers.0.self_attention.linear_qkv"].abs().max() > 0  # B moved
        svc.unload(alone.model_id)


def test_save_state_then_load_with_optimizer_resumes_exactly(world, tiny_world):
    svc, url = world
    sc = client(url, "t0")
    tc = training_client(sc, seed=3)
    data = sft_data(tc.get_tokenizer(), tiny_world, 40, 4)
    adam = dict(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)
    train(tc, data, 2, adam)
    path = tc.save_state("mid").result().path
    assert path == f"tinker://{tc.model_id}/weights/mid"
    train(tc, data, 1, adam)
    straight = {k: v.clone() for k, v in slot_state(svc, tc.model_id).items()}

    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    train(resumed, data, 1, adam)
    got = slot_state(svc, resumed.model_id)
    assert all(torch.equal(straight[k], got[k]) for k in straight)

    weights_only = sc.create_training_client_from_state(path).result()
    state = slot_state(svc, weights_only.model_id)
    assert all(not state[k].any() for k in state if k.startswith(("exp_avg", "grad")))
    assert core(svc).slots[slot_of(svc, weights_only.model_id)].step == 0
    for m in (tc, resumed, weights_only):
        svc.unload(m.model_id)


def test_auth_and_isolation_table(world, tiny_world):
    svc, url = world
    sc = client(url, "t0")
    tc = training_client(sc, seed=4)
    path = tc.save_state("private").result().path
    session = sc.holder.get_session_id()
    alice, bob = {"X-API-Key": KEYS["t0"]}, {"X-API-Key": KEYS["t1"]}
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:  # one of alice's futures
        rid = http.post("save_weights", headers=alice, json={"model_id": tc.model_id, "path": "probe"}).json()["request_id"]
    scenarios = [  # (headers, method, route, body, expected status, substring)
        ({}, "post", "create_session", {"tags": [], "sdk_version": "x"}, 401, "API key"),
        ({"X-API-Key": "tml-not-a-tenant-key"}, "get", "get_server_capabilities", None, 401, "unknown API key"),
        ({"Authorization": f"Bearer {KEYS['t1']}"}, "get", "get_server_capabilities", None, 200, BASE),
        (bob, "post", "get_info", {"model_id": tc.model_id}, 404, "unknown model"),
        (bob, "post", "optim_step", {"model_id": tc.model_id, "adam_params": {"learning_rate": 1.0}}, 404, "unknown model"),
        (bob, "post", "save_weights", {"model_id": tc.model_id, "path": "steal"}, 404, "unknown model"),
        (bob, "post", "session_heartbeat", {"session_id": session}, 404, "unknown session"),
        (bob, "post", "weights_info", {"tinker_path": path}, 404, "no checkpoint"),
        (alice, "post", "weights_info", {"tinker_path": path}, 200, '"lora_rank":4'),
        (alice, "post", "get_info", {"model_id": tc.model_id}, 200, str(tiny_world / "model")),
        (bob, "post", "retrieve_future", {"request_id": rid}, 404, "unknown request"),
        (bob, "post", "cancel_future", {"request_id": rid}, 404, "unknown request"),
        (alice, "post", "retrieve_future", {"request_id": rid}, 200, "/weights/probe"),
    ]
    before = {k: v.clone() for k, v in slot_state(svc, tc.model_id).items()}
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:
        for headers, method, route, body, status, text in scenarios:
            resp = http.request(method.upper(), route, headers=headers, json=body)
            assert resp.status_code == status and text in resp.text, (route, headers, resp.status_code, resp.text[:300])
        # bob loads alice's checkpoint path into his own new model: refused in the future's result
        bob_sc = client(url, "t1")
        with pytest.raises(Exception, match="no checkpoint .* for this API key"):
            bob_sc.create_training_client_from_state_with_optimizer(path).result()
    after = slot_state(svc, tc.model_id)
    assert all(torch.equal(before[k], after[k]) for k in before)
    svc.unload(tc.model_id)


def test_bad_input_is_a_clear_error_and_changes_nothing(world, tiny_world):
    from tinker import types

    svc, url = world
    sc = client(url, "t0")
    tc = training_client(sc, seed=5)
    other = training_client(client(url, "t1"), seed=6)
    good = sft_data(tc.get_tokenizer(), tiny_world, 60, 2)
    other_fb = other.forward_backward(good, "cross_entropy")
    other_fb.result()
    before = {m: {k: v.clone() for k, v in slot_state(svc, m).items()} for m in (tc.model_id, other.model_id)}

    def datum(tokens, **inputs):
        return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)

    rl = dict(target_tokens=[5, 6, 7], logprobs=[-1.0, -1.0, -1.0])
    cases = [  # (data, loss_fn, loss_fn_config, error substring)
        ([datum([1, 2, 3], target_tokens=[2, 3], weights=[1.0, 1.0])], "cross_entropy", None, "has shape (2,); model_input has 3 tokens"),
        ([datum([1, 2, 999], target_tokens=[2, 3, 4], weights=[1.0] * 3)], "cross_entropy", None, "token ids must be in [0, 400)"),
        ([datum(list(range(1, MAX_SEQ + 2)), target_tokens=list(range(2, MAX_SEQ + 3)), weights=[1.0] * (MAX_SEQ + 1))],
         "cross_entropy", None, f"more than this server allows ({MAX_SEQ})"),
        ([datum([1, 2, 3], advantages=[0.0, float("nan"), 1.0], **rl)], "importance_sampling", None, "non-finite"),
        ([datum([1, 2, 3], advantages=[1.0] * 3, **rl)], "ppo", {"clip_eps": 0.2}, "keys ['clip_eps'] are not known to 'ppo'"),
        ([datum([1, 2, 3], advantages=[1.0] * 3, **rl)], "gspo", None, "lacks ['sequence_ratio_mask']"),
        ([datum([1, 2, 3], advantages=[1.0] * 3, sequence_ratio_mask=[0.0] * 3, **rl)], "gspo", None, "marks no position"),
        ([datum([1, 2, 3], advantages=[1.0] * 3, **rl)], "stable_reinforce", None, "stable_reinforce needs the provenance of every datum"),
        ([datum([1, 2, 3], advantages=[1.0] * 3, **rl)], "dro", None, "needs loss_fn_config['beta']"),
    ]
    for data, loss_fn, cfg, text in cases:
        with pytest.raises(Exception) as err:
            tc.forward_backward(data, loss_fn, cfg).result()
        assert text in str(err.value), (loss_fn, str(err.value)[:400])
    # gspo through the SDK's own encoding (sequence_ratio_mask as float32): loss:sum is the reference's
    # loss (tests/reference/losses.py) of the logprobs the server returns; forward changes nothing
    cfg = {"clip_high_threshold": 1.5}
    g = datum([1, 2, 3, 4], target_tokens=[2, 3, 4, 5], logprobs=[-3.0, -2.0, -4.0, -5.0], advantages=[0.0, 1.0, -0.5, 2.0],
              sequence_ratio_mask=[0.0, 1.0, 1.0, 1.0])
    out = tc.forward([g], "gspo", cfg).result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    want = tinker_token_loss("gspo", cfg, lp, {k: v.to_torch() for k, v in g.loss_fn_inputs.items()}).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(want), rel=1e-5, abs=1e-5)
    with pytest.raises(Exception, match="LoRA rank 64 not supported: 1..8"):
        client(url, "t2").create_lora_training_client(base_model=BASE, rank=64, train_unembed=False).result()
    with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:  # empty data: the SDK sends no request for it
        from tinker.proto import tinker_public_pb2 as pb

        body = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy").SerializeToString()
        rid = http.post("forward_backward", content=body, headers={"X-API-Key": KEYS["t0"], "Content-Type": "application/x-protobuf"}).json()["request_id"]
        got = http.post("retrieve_future", json={"request_id": rid}, headers={"X-API-Key": KEYS["t0"]}).json()
        assert got["category"] == "user" and "data is empty" in got["error"]
    for m in (tc.model_id, other.model_id):
        after = slot_state(svc, m)
        assert all(torch.equal(before[m][k], after[k]) for k in after), m
    for m in (tc, other):
        svc.unload(m.model_id)


def test_silent_session_is_saved_and_its_slot_freed(world):
    """A session without heartbeats (raw HTTP, no SDK loop) past the timeout: its model is saved
    under tinker://<model>/weights/expired-<time> and its slot freed; the session is gone."""
    import time

    svc, url = world
    key = {"X-API-Key": KEYS["t3"]}
    free_before = sum(1 for s in core(svc).slots if s is None)
    svc.session_timeout_s = 2.0
    try:
        with httpx.Client(base_url=url + "/api/v1", timeout=30) as http:
            sid = http.post("create_session", headers=key, json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
            body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2, "seed": 1, "train_unembed": False}}
            rid = http.post("create_model", headers=key, json=body).json()["request_id"]
            model_id = http.post("retrieve_future", headers=key, json={"request_id": rid}).json()["model_id"]
            assert sum(1 for s in core(svc).slots if s is None) == free_before - 1
            deadline = time.monotonic() + 120
            while model_id in svc.models and time.monotonic() < deadline:
                time.sleep(0.2)  # polling a condition with a deadline
            assert model_id not in svc.models
            assert http.post("session_heartbeat", headers=key, json={"session_id": sid}).status_code == 404
    finally:
        svc.session_timeout_s = 300.0
    saved = [c for c in svc.runs.list_checkpoints("t3", model_id)["checkpoints"] if "/weights/expired-" in c["tinker_path"]]
    assert len(saved) == 1
    name = saved[0]["tinker_path"].rsplit("/", 1)[1]
    assert (svc.runs.checkpoint_folder("t3", model_id, "weights", name) / "slot_state.json").is_file()
    assert sum(1 for s in core(svc).slots if s is None) == free_before


def test_forward_and_client_side_custom_loss(world, tiny_world):
    """forward() gives forward_backward's outputs without a gradient; forward_backward_custom
    (the SDK's client-side path: forward, then a linear cross_entropy) gives the gradient of
    the custom loss: here -sum(logprobs * weights), so equal to cross_entropy's."""
    svc, url = world
    sc = client(url, "t2")
    ce, custom = training_client(sc, seed=8), training_client(sc, seed=8)
    data = sft_data(ce.get_tokenizer(), tiny_world, 70, 3)
    fwd = ce.forward(data, "cross_entropy").result()
    assert not slot_state(svc, ce.model_id)["grad.1.decoder.layers.0.self_attention.linear_qkv"].any()
    fb = ce.forward_backward(data, "cross_entropy").result()
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs):
        assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-6)

    def neg_weighted_ll(batch, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs_list))
        return loss, {}

    custom.forward_backward_custom(data, neg_weighted_ll).result()
    want, got = slot_state(svc, ce.model_id), slot_state(svc, custom.model_id)
    grads = [k for k in want if k.startswith("grad.")]
    assert max(max_rel_err(got[k], want[k]) for k in grads if want[k].abs().max() > 0) <= 1e-5
    for m in (ce, custom):
        svc.unload(m.model_id)
