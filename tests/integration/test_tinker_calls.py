"""Issue 42 items 2, 3 and 5: server-side custom losses, the other calls of the 0.38 SDK (copy_weights,
publish/unpublish, sessions list/get/search, join_sampling_session, client/config), and a tenant
isolation row for every route that takes an id. The official tinker SDK (0.38.0, unmodified) and raw
HTTP (what it sends) against one in-process service on loopback for the module
(tests/tinker_in_process.py: the routes `lorafleet serve` mounts, a real trainer on the tiny world).

Its sampler names an engine URL nothing listens on: no test here samples (sampling itself is
tests/integration/test_tinker_sampling*.py); the rows only create, look up and join sampling sessions.

* Custom losses: the same per-datum loss (a rank-0 input included) through the SDK's default path
  (client/config says server-side: one forward_backward by loss_id) and through the SDK's client-side
  runner (the handle without its loss_id: forward, then a linear cross_entropy) on two models of the
  same seed: the same gradients, and loss:sum and the metrics equal the user's Python function on the
  server's log-probs (the reference: not the graph interpreter). Hostile graphs refused naming the op.
* The other calls: what each answers, and that a published checkpoint is readable by another tenant
  (weights info, load, copy, its run with access_scope=accessible) and never writable; unpublish revokes.
* Isolation: bob on each of alice's ids is 404, and alice's state (slot tensors, session, runs,
  checkpoints, files, futures, losses, sampling session) is the same after the table.
  Plants: tests/integration/isolation_plants.py.
"""

from __future__ import annotations

import dataclasses
import math
import socket

import httpx
import pytest
import torch

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.tinker_views import core, slot_of
from tests.numerics import max_rel_err

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-calls-key-0001", "bob": "tml-bob-calls-key-00002"}
BASE = "tiny-qwen3"
ADAM = dict(learning_rate=1e-2)


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app

    with socket.socket() as s:  # a port nothing listens on: the sampler's engine (no test samples)
        s.bind(("127.0.0.1", 0))
        no_engine = f"http://127.0.0.1:{s.getsockname()[1]}"
    root = tmp_path_factory.mktemp("ckpt")
    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), root, num_slots=6, max_rank=8, base_model=BASE,
                             micro_batch_tokens=256, max_seq_len=96, sglang_url=no_engine, window_s=0.05)
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url, root


def http(url: str, who: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/api/v1", timeout=60, headers={"X-API-Key": KEYS[who]})


def trained(sc, seed: int):
    from tinker import types

    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed, train_unembed=False).result()
    tc.forward_backward(sft(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    return tc


def sft(n: int = 3, offset: int = 0):
    from tinker import types

    g = torch.Generator().manual_seed(offset)
    out = []
    for i in range(n):
        tokens = torch.randint(1, 399, (6 + 2 * i,), generator=g).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.5] + [1.0] * (len(tokens) - 2)}))
    return out


def slot_state(svc, model_id: str) -> dict[str, torch.Tensor]:
    from trainer.swap.slot_checkpoint import slot_state_tensors

    parts = slot_state_tensors(core(svc), slot_of(svc, model_id))
    return {f"{k}.{i}.{n}": t.clone() for k in ("weight", "exp_avg", "exp_avg_sq", "grad") for i in (0, 1)
            for n, t in parts[k][i].items()}


def assert_same_gradients(svc, model_a: str, model_b: str, what: str, tol: float = 1e-5) -> None:
    """The two models' pending gradients agree within `tol` (relative) on every tensor b has non-zero."""
    a, b = slot_state(svc, model_a), slot_state(svc, model_b)
    grads = [k for k in a if k.startswith("grad.") and b[k].abs().max() > 0]
    worst = max(max_rel_err(a[k], b[k]) for k in grads)
    print(f"{what}: gradients worst {worst:.2e} over {len(grads)} tensors")
    assert grads and worst <= tol


def retrieve(client: httpx.Client, rid: str) -> dict:
    from tests.waiting import wait_until

    def answered() -> dict | None:
        body = client.post("retrieve_future", json={"request_id": rid}).json()
        return None if body.get("type") == "try_again" else body

    return wait_until(answered, f"future {rid}", timeout_s=120, interval_s=0.1)


# -- custom losses ------------------------------------------------------------------------------------


def tilted_nll(logprobs, weights, beta):
    """A user's per-datum loss (as create_custom_loss documents it): weighted NLL plus beta times the
    weighted squared spread of the log-probs about their mean (nonlinear, coupling the positions)."""
    nll = -(logprobs * weights).sum()
    spread = (logprobs - logprobs.mean()) ** 2
    return nll + beta * (spread * weights).sum(), {"custom/nll:sum": nll, "custom/spread:mean": spread.mean()}


def custom_data(n: int = 3):
    from tinker import types

    data = sft(n, offset=7)
    for i, d in enumerate(data):
        d.loss_fn_inputs["beta"] = types.TensorData(data=[0.25 + 0.5 * i], dtype="float32", shape=[])  # rank 0
    return data


def test_custom_loss_server_side_equals_client_side(world):
    svc, url, _ = world
    sc = open_client(url, KEYS["alice"])
    assert sc.holder.get_client_config().custom_loss_server_side is True
    handle = sc.create_custom_loss(tilted_nll, input_ranks={"logprobs": 1, "weights": 1, "beta": 0}).result()
    assert handle.loss_id == f"{sc.holder.get_session_id()}:loss:0"
    server, client_side = (sc.create_lora_training_client(base_model=BASE, rank=4, seed=21, train_unembed=False).result()
                           for _ in range(2))
    data = custom_data()
    calls = svc.metrics()["forward_backward_calls"]
    on_server = server.forward_backward_custom(data, handle).result()
    assert svc.metrics()["forward_backward_calls"] == calls + 1  # one round trip: no forward, no surrogate
    on_client = client_side.forward_backward_custom(data, dataclasses.replace(handle, loss_id=None)).result()
    assert "surrogate_loss:sum" not in on_server.metrics and "surrogate_loss:sum" in on_client.metrics

    # the reference: the user's own function on the log-probs the server computed
    lps = [o["logprobs"].to_torch() for o in on_server.loss_fn_outputs]
    per_datum = [tilted_nll(lp, d.loss_fn_inputs["weights"].to_torch(), d.loss_fn_inputs["beta"].to_torch())
                 for lp, d in zip(lps, data)]
    want = {"loss:sum": sum(float(loss) for loss, _ in per_datum),
            "custom/nll:sum": sum(float(m["custom/nll:sum"]) for _, m in per_datum),
            "custom/spread:mean": sum(float(m["custom/spread:mean"]) for _, m in per_datum) / len(data)}
    print("server-side metrics", on_server.metrics, "reference", want)
    assert set(on_server.metrics) == set(want)
    for key, value in want.items():
        assert on_server.metrics[key] == pytest.approx(value, rel=1e-5), key
        assert on_client.metrics[key] == pytest.approx(value, rel=1e-5), key
    assert_same_gradients(svc, server.model_id, client_side.model_id, "server-side vs client-side")

    # a forward with the loss: its loss, no gradient added; bad data refused before the pass (the datum check's
    # message, not the pass's)
    before = slot_state(svc, server.model_id)
    fwd = server.forward(data, "custom", {"loss_id": handle.loss_id}).result()
    assert fwd.metrics["loss:sum"] == pytest.approx(want["loss:sum"], rel=1e-5)
    bad = custom_data(1)
    del bad[0].loss_fn_inputs["beta"]
    with pytest.raises(Exception, match=r"datum 0: loss_fn_inputs lacks 'beta', which custom loss 'tilted_nll' takes \(it"):
        server.forward_backward(bad, "custom", {"loss_id": handle.loss_id}).result()
    after = slot_state(svc, server.model_id)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for m in (server, client_side):
        svc.unload(m.model_id)


def matmul_loss(logprobs, weights):
    return -torch.matmul(logprobs, weights), {}


def node(op: str, name: str, target: str, *args) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


def graph_with(call: dict) -> dict:
    return {"format": 1, "nodes": [node("placeholder", "logprobs", "logprobs"), call,
                                   node("output", "output", "output", {"tuple": [{"ref": call["name"]}, {"dict": {}}]})]}


def test_hostile_custom_graphs_are_refused_naming_the_op(world):
    svc, url, _ = world
    sc = open_client(url, KEYS["alice"])
    with pytest.raises(Exception, match="function 'torch.matmul' is not allowed"):  # the SDK allows it; the server not
        sc.create_custom_loss(matmul_loss, input_ranks={"logprobs": 1, "weights": 1}).result()
    session = sc.holder.get_session_id()
    huge = {"format": 1, "nodes": [node("placeholder", "logprobs", "logprobs")]
            + [node("call_function", f"n{i}", "torch.neg", {"ref": "logprobs"}) for i in range(300)]}
    cases = [  # (graph, what the refusal names)
        (graph_with(node("call_function", "run", "os.system", "rm -rf /")), "function 'os.system' is not allowed"),
        (graph_with(node("call_function", "ev", "builtins.eval", "1")), "function 'builtins.eval' is not allowed"),
        (graph_with(node("call_method", "m", "__class__", {"ref": "logprobs"})), "method '__class__' is not allowed"),
        (graph_with(node("call_module", "mod", "torch.nn.Linear", {"ref": "logprobs"})), "may not call modules"),
        (huge, "a custom loss may have at most 256"),
    ]
    with http(url, "alice") as alice:
        for seq, (graph, text) in enumerate(cases, start=10):
            body = {"session_id": session, "custom_loss_seq_id": seq, "name": "hostile",
                    "inputs": [{"name": "logprobs", "rank": 1}], "graph": graph}
            got = retrieve(alice, alice.post("create_custom_loss", json=body).json()["request_id"])
            assert got["category"] == "user" and text in got["error"], (text, got)
            assert svc.records.custom_loss("alice", f"{session}:loss:{seq}") is None  # nothing stored


# -- top-K cross_entropy ([N, K] targets: the cookbook's sdft) ------------------------------------------


def topk_data(k: int = 5, same_column: bool = False):
    """Two datums whose target_tokens and weights are [N, K] (the first position weighted 0, as a
    prompt's); ``same_column``: every column names the same target (the 1-D identity below)."""
    from tinker import types

    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(2):
        tokens = torch.randint(1, 399, (7 + 3 * i,), generator=g).tolist()
        n = len(tokens) - 1
        targets = torch.randint(0, 400, (n, 1 if same_column else k), generator=g).expand(n, k).contiguous()
        weights = torch.rand(n, k, generator=g)
        weights[0] = 0.0
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets),
                                               "weights": types.TensorData.from_torch(weights)}))
    return out


def hf_logprobs(model_dir, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t, k] | tokens[:t + 1]) under the base model in Hugging Face transformers, fp32
    (a fresh model's LoRA adds nothing: B starts at 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(1, targets)


def test_top_k_cross_entropy_is_its_definition(world, tiny_world):
    """cross_entropy with [N, K] inputs (tinker-docs losses/cross-entropy, "Top-K distillation"): loss:sum
    = -sum_t sum_k w[t, k] log p(x[t, k]) and logprobs [N, K], both against Hugging Face's base model;
    its gradient equals the 1-D datum it reduces to when every column names the same target (weights
    summed over k); shapes off the definition are refused and change nothing."""
    from tinker import types

    svc, url, _ = world
    sc = open_client(url, KEYS["alice"])
    topk, one_d = (sc.create_lora_training_client(base_model=BASE, rank=4, seed=31, train_unembed=False).result()
                   for _ in range(2))
    data = topk_data()
    out = topk.forward(data, "cross_entropy").result()
    want_loss, worst = 0.0, 0.0
    for d, o in zip(data, out.loss_fn_outputs):
        targets, weights = d.loss_fn_inputs["target_tokens"].to_torch(), d.loss_fn_inputs["weights"].to_torch()
        ref = hf_logprobs(tiny_world / "model", d.model_input.to_ints(), targets)
        got = o["logprobs"].to_torch()
        assert tuple(got.shape) == tuple(targets.shape) == tuple(o["elementwise_loss"].to_torch().shape)
        worst = max(worst, (got - ref).abs().max().item())
        assert torch.allclose(o["elementwise_loss"].to_torch(), -got * weights, atol=1e-6)
        want_loss += float(-(ref * weights).sum())
    print(f"top-K logprobs against HF: worst {worst:.2e}; loss:sum {out.metrics['loss:sum']:.6f} vs {want_loss:.6f}")
    assert worst <= 1e-5
    assert out.metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)

    # the gradient: K columns of one target with weights w[t, k] == one 1-D datum with weights sum_k w[t, k]
    same = topk_data(same_column=True)
    reduced = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(d.loss_fn_inputs["target_tokens"].to_torch()[:, 0].contiguous()),
        "weights": types.TensorData.from_torch(d.loss_fn_inputs["weights"].to_torch().sum(1))}) for d in same]
    a = topk.forward_backward(same, "cross_entropy").result()
    b = one_d.forward_backward(reduced, "cross_entropy").result()
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    assert_same_gradients(svc, topk.model_id, one_d.model_id, "top-K vs its 1-D reduction")

    # refused, naming what is allowed, and nothing changes
    before = slot_state(svc, topk.model_id)
    bad_weights = topk_data()
    bad_weights[1].loss_fn_inputs["weights"] = types.TensorData.from_torch(torch.ones(len(bad_weights[1].model_input.to_ints())))
    too_wide = topk_data(k=65)
    rl_topk = topk_data()  # only cross_entropy takes [N, K]
    for d in rl_topk:
        w = d.loss_fn_inputs.pop("weights").to_torch()
        d.loss_fn_inputs.update(logprobs=types.TensorData.from_torch(-w), advantages=types.TensorData.from_torch(w))
    cases = [(bad_weights, "cross_entropy", r"datum 1: loss_fn_inputs have different shapes"),
             (too_wide, "cross_entropy", r"datum 0: loss_fn_inputs\['(target_tokens|weights)'\] has shape \(6, 65\); .*need \(6,\) or \(6, K\) with 1 <= K <= 64"),
             (rl_topk, "importance_sampling", r"datum 0: loss_fn_inputs\['(target_tokens|logprobs|advantages)'\] has shape \(6, 5\); model_input has 6 tokens, need \(6,\) for")]
    for bad, loss_fn, message in cases:
        with pytest.raises(Exception, match=message):
            topk.forward_backward(bad, loss_fn).result()
    after = slot_state(svc, topk.model_id)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for m in (topk, one_d):
        svc.unload(m.model_id)


# -- the other calls ----------------------------------------------------------------------------------


def test_client_config_says_what_is_served(world):
    _, url, _ = world
    sc = open_client(url, KEYS["bob"])
    cfg = sc.holder.get_client_config()
    assert (cfg.custom_loss_server_side, cfg.sample_join_sampling_session, cfg.pjwt_auth_enabled) == (True, True, False)
    with http(url, "bob") as bob:
        assert bob.post("client/dynamic_config", json={}).json() == {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


def test_sessions_are_listed_got_and_searched_for_their_tenant(world):
    import tinker
    from tinker import types

    svc, url, _ = world
    with http(url, "alice") as alice:
        made = [alice.post("create_session", json={"tags": [], "sdk_version": "raw", "display_name": name,
                                                   "user_metadata": {"team": team}}).json()["session_id"]
                for name, team in (("Nightly sweep", "a"), ("nightly eval", "b"), ("adhoc", "a"))]
        assert alice.post(f"sessions/{made[1]}/finish", json={"reason": {"type": "errored"}, "detail": "oom"}).status_code == 200
        assert alice.post(f"sessions/{made[1]}/finish", json={"reason": {"type": "success"}}).status_code == 404  # ended
    sc = open_client(url, KEYS["alice"])
    tc = trained(sc, seed=3)
    sampler = sc.create_sampling_client(base_model=BASE).result()  # a sampling session of this session
    rest = sc.create_rest_client()
    session = sc.holder.get_session_id()
    listed = rest.list_sessions(limit=1000).result().sessions
    assert listed[:4] == [session, *reversed(made)]  # newest first
    got = rest.get_session(session).result()
    assert got.training_run_ids == [tc.model_id] and got.sampler_ids == [sampler._sampling_session_id]
    assert rest.get_session(made[0]).result().display_name == "Nightly sweep"

    def search(**kw):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # search_sessions is experimental
            return rest.search_sessions(types.SessionSearchRequest(**kw)).result()

    page = search(display_name="NIGHTLY")
    assert [s.session_id for s in page.sessions] == [made[1], made[0]]
    assert page.sessions[0].status.type == "client_finished" and page.sessions[0].status.reason.type == "errored"
    assert [s.session_id for s in search(user_metadata={"team": "a"}).sessions] == [made[2], made[0]]
    finished = search(statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])])
    assert [s.session_id for s in finished.sessions] == [made[1]]
    mine = search(session_id=session).sessions[0]
    assert (mine.owner, mine.status.type, mine.checkpoints_count) == ("alice", "active", 0)
    seen, cursor = [], None  # pages of 2 meet every session once
    while True:
        page = search(limit=2, cursor=cursor)
        seen += [s.session_id for s in page.sessions]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == rest.list_sessions(limit=1000).result().sessions
    with pytest.raises(tinker.BadRequestError, match="a tenant sees its own sessions only"):
        search(owner=types.UserSearchOwner(owner_urns=["urn:bob"]))
    svc.unload(tc.model_id)


def test_publish_share_copy_and_unpublish(world, tiny_world):
    import tinker

    svc, url, root = world
    alice_sc, bob_sc = open_client(url, KEYS["alice"]), open_client(url, KEYS["bob"])
    tc = trained(alice_sc, seed=5)
    path = tc.save_state("shared").result().path
    alice, bob = alice_sc.create_rest_client(), bob_sc.create_rest_client()
    with pytest.raises(tinker.NotFoundError):  # not published yet
        bob.get_weights_info_by_tinker_path(path).result()
    alice.publish_checkpoint_from_tinker_path(path).result()
    alice.publish_checkpoint_from_tinker_path(path).result()  # idempotent (a retry after a lost answer)
    assert [c.public for c in alice.list_checkpoints(tc.model_id).result().checkpoints] == [True]

    assert bob.get_weights_info_by_tinker_path(path).result().lora_rank == 4  # readable
    loaded = bob_sc.create_training_client_from_state_with_optimizer(path).result()  # bob's own model from it
    want, got = slot_state(svc, tc.model_id), slot_state(svc, loaded.model_id)
    assert all(torch.equal(want[k], got[k]) for k in want)
    run = bob.get_training_run_by_tinker_path(path, access_scope="accessible").result()
    assert (run.model_owner, run.last_checkpoint.tinker_path) == ("alice", path)
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run_by_tinker_path(path).result()  # owned scope: not bob's
    copy = bob.copy_weights(path, "archive", ttl_seconds=7200).result()
    assert copy.endswith("/weights/shared") and copy != path
    copied = bob.list_checkpoints(copy.split("/")[2]).result().checkpoints
    assert [c.tinker_path for c in copied] == [copy] and copied[0].expires_at is not None
    for write in (lambda: bob.delete_checkpoint_from_tinker_path(path).result(),
                  lambda: bob.set_checkpoint_ttl_from_tinker_path(path, 3600).result(),
                  lambda: bob.unpublish_checkpoint_from_tinker_path(path).result()):
        with pytest.raises(tinker.NotFoundError):  # never writable by another tenant
            write()

    alice.unpublish_checkpoint_from_tinker_path(path).result()  # revoked
    with pytest.raises(tinker.NotFoundError):
        bob.get_weights_info_by_tinker_path(path).result()
    with pytest.raises(Exception, match="no checkpoint .* for this API key"):
        bob_sc.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.copy_weights(path, "archive").result()
    assert bob.get_weights_info_by_tinker_path(copy).result().lora_rank == 4  # bob's copy is his own
    fresh = bob_sc.create_training_client_from_state(copy).result()
    assert all(torch.equal(want[k], slot_state(svc, fresh.model_id)[k]) for k in want if k.startswith("weight"))
    assert alice.get_training_run(tc.model_id).result().last_checkpoint.public is False
    for m in (tc, loaded, fresh):
        svc.unload(m.model_id)


def test_join_sampling_session_counts_clones(world):
    """A clone made from a sampler handle asks the server for its id (client/config says so) before its
    first sample; the SDK's own join (run here without sampling: no engine) gets 1, the next ones 2, 3."""
    import tinker

    _, url, _ = world
    sc = open_client(url, KEYS["alice"])
    original = sc.create_sampling_client(base_model=BASE).result()
    sid = original._sampling_session_id
    clone = tinker.SamplingClient.from_sampler_handle(original.get_sampler_handle(), api_key=KEYS["alice"])
    assert clone._cloned_sampler_id is None  # waits for the server's number
    clone.holder.run_coroutine_threadsafe(clone._join_sampling_session()).result(timeout=60)
    assert clone._cloned_sampler_id == 1 and clone._request_id_counter == 1_000_000_000
    with http(url, "alice") as alice, http(url, "bob") as bob:
        got = [alice.post("join_sampling_session", json={"sampling_session_id": sid}).json()["client_counter"] for _ in range(2)]
        assert got == [2, 3]
        assert bob.post("join_sampling_session", json={"sampling_session_id": sid}).status_code == 404
        assert alice.post("join_sampling_session", json={"sampling_session_id": "samp-nope"}).status_code == 404


# -- isolation: a cross-tenant row for every route that takes an id --------------------------------------


def proto_fb(model_id: str, loss_fn: str, config: dict | None, data) -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config))
    return forward_backward_request_to_proto(request).SerializeToString()


def files_of(root, tenant: str) -> list[tuple[str, int, int]]:
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in (root / tenant).rglob("*") if p.is_file())


def owner_state(svc, url: str, root, ids: dict) -> dict:
    """Everything of alice's the table could change, read as alice (and from her slot and files)."""
    with http(url, "alice") as alice:
        run = alice.get(f"training_runs/{ids['run']}").json()
        run.pop("last_request_time")  # alice's own reads move it (R4); nothing of bob's does
        return {"slot": slot_state(svc, ids["run"]), "run": run, "files": files_of(root, "alice"),
                "checkpoints": alice.get(f"training_runs/{ids['run']}/checkpoints").json(),
                "session": alice.get(f"sessions/{ids['session']}").json(),
                "heartbeat": alice.post("session_heartbeat", json={"session_id": ids["session"]}).status_code,
                "future": alice.post("retrieve_future", json={"request_id": ids["future"]}).json(),
                "sampler": alice.get(f"samplers/{ids['sampler']}").status_code,
                "loss": svc.records.custom_loss("alice", ids["loss"]), "model": ids["run"] in svc.models}


def test_isolation_table(world):
    """Bob on each of alice's ids: 404 (or, where the SDK learns it from the future, its refusal), and
    alice's state is the same after the table (tests/integration/isolation_plants.py: each plant fails it)."""
    svc, url, root = world
    alice_sc, bob_sc = open_client(url, KEYS["alice"]), open_client(url, KEYS["bob"])
    tc = trained(alice_sc, seed=9)
    tc.forward_backward(sft(2, offset=3), "cross_entropy").result()  # a pending gradient too
    run = tc.model_id
    tc.save_state("private").result()
    tc.save_state("pub").result()
    sampler_path = tc.save_weights_for_sampler("w").result().path
    tc.save_weights_external("ext").result()
    alice_sc.create_rest_client().publish_checkpoint_from_tinker_path(f"tinker://{run}/weights/pub").result()
    handle = alice_sc.create_custom_loss(tilted_nll, input_ranks={"logprobs": 1, "weights": 1, "beta": 0}).result()
    sampler = alice_sc.create_sampling_client(base_model=BASE).result()._sampling_session_id
    with http(url, "alice") as alice:
        rid = alice.post("save_weights", json={"model_id": run, "path": "probe"}).json()["request_id"]
        retrieve(alice, rid)
    ids = {"run": run, "session": alice_sc.holder.get_session_id(), "future": rid, "sampler": sampler, "loss": handle.loss_id}
    bob_tc = bob_sc.create_lora_training_client(base_model=BASE, rank=2, seed=1, train_unembed=False).result()
    before = owner_state(svc, url, root, ids)

    sid, ckpt, private = ids["session"], f"training_runs/{run}/checkpoints", f"tinker://{run}/weights/private"
    graph = {"format": 1, "nodes": [node("placeholder", "logprobs", "logprobs"), node("call_method", "s", "sum", {"ref": "logprobs"}),
                                    node("output", "output", "output", {"tuple": [{"ref": "s"}, {"dict": {}}]})]}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    rows = [  # (method, route, body, substring of the 404's message)
        ("post", "session_heartbeat", {"session_id": sid}, "unknown session"),
        ("post", f"sessions/{sid}/finish", {"reason": {"type": "success"}}, "unknown session"),
        ("get", f"sessions/{sid}", None, "unknown session"),
        ("post", "create_model", {"session_id": sid, "model_seq_id": 9, "base_model": BASE, "lora_config": {"rank": 2}},
         "unknown session"),
        ("post", "create_custom_loss", {"session_id": sid, "custom_loss_seq_id": 5, "name": "x",
                                        "inputs": [{"name": "logprobs", "rank": 1}], "graph": graph}, "unknown session"),
        ("post", "create_sampling_session", {"session_id": sid, "base_model": BASE}, "unknown session"),
        ("post", "load_weights", {"session_id": sid, "model_seq_id": 7, "path": private}, "unknown session"),
        ("post", "get_info", {"model_id": run}, "unknown model"),
        ("post", "unload_model", {"model_id": run}, "unknown model"),
        ("proto", "forward_backward", proto_fb(run, "cross_entropy", None, sft(1)), "unknown model"),
        ("proto", "forward_backward", proto_fb(bob_tc.model_id, "custom", {"loss_id": handle.loss_id}, custom_data(1)),
         "unknown custom loss"),
        ("post", "optim_step", {"model_id": run, "adam_params": {"learning_rate": 1.0}}, "unknown model"),
        ("post", "save_weights", {"model_id": run, "path": "steal"}, "unknown model"),
        ("post", "save_weights_for_sampler", {"model_id": run, "path": "steal"}, "unknown model"),
        ("post", "save_weights_external", {"model_id": run, "path": "steal"}, "unknown model"),
        ("post", "load_weights", {"model_id": run, "path": private}, "unknown model"),
        ("post", "weights_info", {"tinker_path": private}, "no checkpoint"),
        ("get", f"samplers/{sampler}", None, "unknown sampler"),
        ("post", "join_sampling_session", {"sampling_session_id": sampler}, "unknown sampling session"),
        ("post", "asample", {"sampling_session_id": sampler, "prompt": prompt, "num_samples": 1,
                             "sampling_params": {"max_tokens": 1}}, "unknown sampling session"),
        ("post", "retrieve_futures", {"target": {"type": "sampling_session", "sampling_session_id": sampler}, "timeout": 0},
         "unknown sampling session"),
        ("post", "retrieve_future", {"request_id": rid}, "unknown request"),
        ("post", "cancel_future", {"request_id": rid}, "unknown request"),
        ("get", f"training_runs/{run}", None, "unknown training run"),
        ("get", ckpt, None, "unknown training run"),
        ("delete", f"{ckpt}/weights/private", None, "unknown training run"),
        ("put", f"{ckpt}/weights/private/ttl", {"ttl_seconds": 3600}, "unknown training run"),
        ("post", f"{ckpt}/weights/private/publish", None, "unknown training run"),
        ("delete", f"{ckpt}/weights/pub/publish", None, "unknown training run"),  # published: readable, not writable
        ("delete", f"{ckpt}/weights/pub", None, "unknown training run"),
        ("put", f"{ckpt}/weights/pub/ttl", {"ttl_seconds": 3600}, "unknown training run"),
        ("get", f"{ckpt}/external_weights/ext/external_weights_urls", None, "unknown training run"),
        ("post", "copy_weights", {"source_path": private, "destination_project_id": "p"}, "no checkpoint"),
        ("post", "copy_weights", {"source_path": sampler_path, "destination_project_id": "p"}, "no checkpoint"),
    ]
    with http(url, "bob") as bob:
        for method, route, body, text in rows:
            if method == "proto":
                resp = bob.post(route, content=body, headers={"Content-Type": "application/x-protobuf"})
            else:
                resp = bob.request(method.upper(), route, json=body)
            assert (resp.status_code, text in resp.text) == (404, True), (method, route, resp.status_code, resp.text[:300])
        # listings show none of alice's: her session, runs and private checkpoints
        listings = [bob.get("sessions", params={"limit": 1000}).text, bob.post("sessions/search", json={"session_id": sid}).text,
                    bob.get("checkpoints", params={"limit": 1000}).text, bob.get("training_runs", params={"limit": 1000}).text,
                    bob.get("training_runs", params={"limit": 1000, "access_scope": "accessible"}).text]
        assert not any(sid in text for text in listings[:4]) and all("/weights/private" not in text for text in listings)
        assert f"tinker://{run}/weights/pub" in listings[4]  # published: its run is accessible (its id names the session)
        # what the SDK learns from the future: bob's own requests naming alice's private paths
        rid_b = bob.post("asample", json={"model_path": sampler_path, "prompt": prompt, "num_samples": 1,
                                          "sampling_params": {"max_tokens": 1}}).json()["request_id"]
        assert "no checkpoint" in retrieve(bob, rid_b)["error"]
    with pytest.raises(Exception, match="no checkpoint .* for this API key"):
        bob_sc.create_training_client_from_state(private).result()

    after = owner_state(svc, url, root, ids)
    assert after.keys() == before.keys() and all(torch.equal(before["slot"][k], after["slot"][k]) for k in before["slot"])
    assert {k: v for k, v in after.items() if k != "slot"} == {k: v for k, v in before.items() if k != "slot"}
    assert after["heartbeat"] == after["sampler"] == 200 and after["loss"] is not None and after["model"]
    out = tc.forward(custom_data(1), "custom", {"loss_id": handle.loss_id}).result()  # alice's loss still hers
    assert math.isfinite(out.metrics["loss:sum"])
    for m in (tc, bob_tc):
        svc.unload(m.model_id)
