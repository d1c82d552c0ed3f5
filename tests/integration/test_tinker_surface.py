"""The RestClient's surface (tinker 0.38.0, unmodified) on lorafleet's Tinker routes: training
runs, checkpoints, TTLs, external weights and their signed URLs, the served base-model name,
and the calls that are refused (publishing, copies and sessions: tests/integration/test_tinker_calls.py).
One in-process service on loopback for the module (the same routes `lorafleet serve` mounts), two tenants.

* Scenario table: each of bob's calls on alice's run id or tinker path is 404 and changes
  nothing of alice's; each of alice's is served.
* TTL: a checkpoint past its TTL (the records' clock moved on) is gone from every listing,
  from disk, and cannot be loaded; TTLs outside 1 hour..10 years are refused.
* External weights: the downloaded PEFT folder, loaded by HF + PEFT (independent of the
  trainer), gives the trainer's own log-probs (SDK `forward`); an age-encrypted export decrypts
  to the same bytes; a URL opens only its own file, only until it expires.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-surface-key-1", "bob": "tml-bob-surface-key-22"}
SERVED = "Qwen/Qwen3-8B-Base"  # examples/tiny/build.py SERVED_NAME: the tiny model under a hub id
HOUR = 3600


class Clock:
    """The run records' wall clock, moved by the tests (never slept on)."""

    def __init__(self) -> None:
        import time

        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app

    root = tmp_path_factory.mktemp("ckpt")
    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), root, num_slots=4, max_rank=8, base_model=SERVED,
                             tokenizer_id=SERVED, micro_batch_tokens=256, max_seq_len=96)
    clock = Clock()
    svc.runs.clock = clock
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url, clock, root


def sc(url, tenant):
    return open_client(url, KEYS[tenant])


def data(tiny_world, n=4):
    from tinker import types
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    rows = [json.loads(line) for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()][:n]
    out = []
    for r in rows:
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        full = p + c
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    return out


def trained(client, tiny_world, metadata=None):
    """A model of the served base, trained one step."""
    from tinker import types

    tc = client.create_lora_training_client(base_model=SERVED, rank=4, seed=3, train_unembed=False,
                                            user_metadata=metadata).result()
    tc.forward_backward(data(tiny_world), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def status_of(call) -> int:
    import tinker

    try:
        call()
    except tinker.APIStatusError as err:
        return err.status_code
    return 200


def test_served_name_reaches_capabilities_info_and_runs(world, tiny_world):
    svc, url, _, _ = world
    client = sc(url, "alice")
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [SERVED]
    tc = client.create_lora_training_client(base_model=SERVED, rank=2, seed=0, train_unembed=False).result()
    info = tc.get_info()
    assert (info.model_data.model_name, info.model_data.tokenizer_id) == (SERVED, SERVED)
    assert client.create_rest_client().get_training_run(tc.model_id).result().base_model == SERVED
    with pytest.raises(Exception, match="is not served here; this server trains 'Qwen/Qwen3-8B-Base'"):
        client.create_lora_training_client(base_model="model", rank=2, train_unembed=False).result()
    tc.save_state("unused").result()  # so that the run is not the only thing left after unload
    svc.unload(tc.model_id)


def test_runs_and_checkpoints_are_the_callers_own(world, tiny_world):
    svc, url, clock, root = world
    alice, bob = sc(url, "alice"), sc(url, "bob")
    tc = trained(alice, tiny_world, metadata={"renderer_name": "role_colon"})
    state = tc.save_state("s1", user_metadata={"step": "1"}).result().path
    sampler = tc.save_weights_for_sampler("w1").result().path
    bob_tc = trained(bob, tiny_world)
    bob_state = bob_tc.save_state("b1").result().path
    ra, rb = alice.create_rest_client(), bob.create_rest_client()
    run_id = tc.model_id

    run = ra.get_training_run(run_id).result()
    assert (run.training_run_id, run.base_model, run.model_owner, run.lora_rank) == (run_id, SERVED, "alice", 4)
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    assert ra.get_training_run_by_tinker_path(sampler).result().training_run_id == run_id
    listed = {c.tinker_path: c for c in ra.list_checkpoints(run_id).result().checkpoints}
    assert set(listed) == {state, sampler}
    assert (listed[state].checkpoint_type, listed[state].user_metadata, listed[state].expires_at) == ("training", {"step": "1"}, None)
    assert listed[sampler].checkpoint_type == "sampler" and listed[sampler].size_bytes > 0
    mine = ra.list_user_checkpoints().result()
    assert bob_state not in {c.tinker_path for c in mine.checkpoints} and {state, sampler} <= {c.tinker_path for c in mine.checkpoints}
    assert run_id in {r.training_run_id for r in ra.list_training_runs().result().training_runs}
    assert {r.training_run_id for r in rb.list_training_runs().result().training_runs} == {bob_tc.model_id}
    page = ra.list_training_runs(limit=1, offset=0).result()
    assert len(page.training_runs) == 1 and page.cursor.total_count >= 2

    before = sorted(p.relative_to(root).as_posix() for p in (root / "alice").rglob("*"))
    # Scenario table: bob on alice's run id / paths -> 404 each, nothing of alice's changes.
    scenarios = [
        ("get run", lambda: rb.get_training_run(run_id).result(), 404),
        ("get run by path", lambda: rb.get_training_run_by_tinker_path(state).result(), 404),
        ("list checkpoints", lambda: rb.list_checkpoints(run_id).result(), 404),
        ("delete", lambda: rb.delete_checkpoint_from_tinker_path(state).result(), 404),
        ("set ttl", lambda: rb.set_checkpoint_ttl_from_tinker_path(sampler, HOUR).result(), 404),
        ("weights info", lambda: rb.get_weights_info_by_tinker_path(state).result(), 404),
        ("publish", lambda: rb.publish_checkpoint_from_tinker_path(state).result(), 404),
        ("unknown run", lambda: ra.get_training_run("s-0000000000000000:train:9").result(), 404),
        ("bad run id", lambda: ra.get_training_run("..").result(), 404),
        ("unknown checkpoint", lambda: ra.delete_checkpoint_from_tinker_path(f"tinker://{run_id}/weights/nope").result(), 404),
        ("assign project", lambda: ra.assign_session_project(alice.holder.get_session_id(), "p").result(), 400),
        ("bad ttl", lambda: ra.set_checkpoint_ttl_from_tinker_path(state, 10).result(), 400),
        ("own run", lambda: ra.get_training_run(run_id).result(), 200),
    ]
    got = [(what, status_of(call)) for what, call, _ in scenarios]
    assert got == [(what, want) for what, _, want in scenarios]
    assert sorted(p.relative_to(root).as_posix() for p in (root / "alice").rglob("*")) == before
    import tinker

    with pytest.raises(tinker.BadRequestError, match="3600 \\(1 hour\\) to 315360000 \\(10 years\\)"):
        ra.set_checkpoint_ttl_from_tinker_path(state, 10).result()
    with pytest.raises(tinker.BadRequestError, match="projects are not served by lorafleet"):
        ra.assign_session_project(alice.holder.get_session_id(), "p").result()

    # Delete: gone from the listing and from disk; a second delete is 404.
    ra.delete_checkpoint_from_tinker_path(sampler).result()
    assert {c.tinker_path for c in ra.list_checkpoints(run_id).result().checkpoints} == {state}
    assert not (root / "alice" / run_id.replace(":", "_") / "sampler_weights" / "w1").exists()
    assert status_of(lambda: ra.delete_checkpoint_from_tinker_path(sampler).result()) == 404

    # TTL: listed with its expiry; past it, gone everywhere and not loadable.
    ra.set_checkpoint_ttl_from_tinker_path(state, HOUR).result()
    (c,) = ra.list_checkpoints(run_id).result().checkpoints
    assert abs(c.expires_at.timestamp() - (clock.now + HOUR)) < 1
    clock.now += HOUR - 5
    assert [c.tinker_path for c in ra.list_checkpoints(run_id).result().checkpoints] == [state]
    clock.now += 10
    assert ra.list_checkpoints(run_id).result().checkpoints == []
    assert ra.get_training_run(run_id).result().last_checkpoint is None
    assert not (root / "alice" / run_id.replace(":", "_") / "weights" / "s1").exists()
    with pytest.raises(Exception, match="no checkpoint"):
        alice.create_training_client_from_state(state).result()
    # bob's checkpoint (no TTL) is untouched by alice's expiry.
    assert [c.tinker_path for c in rb.list_checkpoints(bob_tc.model_id).result().checkpoints] == [bob_state]
    # A run outlives its model: unloaded, it is still listed (and bob still sees none of it).
    svc.unload(run_id)
    assert ra.get_training_run(run_id).result().user_metadata == {"renderer_name": "role_colon"}
    svc.unload(bob_tc.model_id)


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:  # noqa: S310 - loopback URL the server signed
        return r.read()


def _peft_logprobs(hf_model, folder: Path, datum) -> torch.Tensor:
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).eval()
    ids = torch.tensor([datum.model_input.to_ints()])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]


def test_external_weights_download_is_the_trained_adapter(world, tiny_world, hf_model, tmp_path):
    import pyrage

    svc, url, clock, _ = world
    alice, bob = sc(url, "alice"), sc(url, "bob")
    tc = trained(alice, tiny_world)
    batch = data(tiny_world, 2)
    trainer_lps = [torch.tensor(o["logprobs"].tolist()) for o in tc.forward(batch, "cross_entropy").result().loss_fn_outputs]
    ra, rb = alice.create_rest_client(), bob.create_rest_client()

    path = tc.save_weights_external("exp").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/exp"
    urls = ra.get_external_weights_urls(path).result()
    assert sorted(urls.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    out = tmp_path / "download"
    out.mkdir()
    for name, u in urls.urls.items():
        (out / name).write_bytes(_fetch(u))
    for datum, want in zip(batch, trainer_lps, strict=True):
        got = _peft_logprobs(hf_model, out, datum)
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    listed = {c.tinker_path: c for c in ra.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[path].checkpoint_type == "external"
    assert status_of(lambda: rb.get_external_weights_urls(path).result()) == 404

    # A URL opens its own file only, only with its signature, only until it expires.
    good = urls.urls["adapter_config.json"]
    for bad in (good.replace("adapter_config.json", "adapter_model.safetensors"), good[:-1] + ("0" if good[-1] != "0" else "1"),
                good.replace("/alice/", "/bob/"), good.replace("expires=", "expires=9")):
        with pytest.raises(urllib.error.HTTPError) as err:
            _fetch(bad)
        assert err.value.code == 404

    # Encrypted to an age key: only .age files, which decrypt to the same adapter.
    identity = pyrage.x25519.Identity.generate()
    enc = tc.save_weights_external("enc", age_encryption_recipients=[str(identity.to_public())]).result().path
    enc_urls = ra.get_external_weights_urls(enc).result().urls
    assert sorted(enc_urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    plain = pyrage.decrypt(_fetch(enc_urls["adapter_model.safetensors.age"]), [identity])
    assert plain == (out / "adapter_model.safetensors").read_bytes()
    with pytest.raises(Exception, match="neither an age1... key nor an SSH public key"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()

    # Expired (the signer keeps the records' clock): 404; a fresh URL works again.
    clock.now += 3601
    with pytest.raises(urllib.error.HTTPError) as err:
        _fetch(good)
    assert err.value.code == 404
    fresh = ra.get_external_weights_urls(path).result().urls["adapter_config.json"]
    assert _fetch(fresh) == (out / "adapter_config.json").read_bytes()
    # Deleted: its URLs stop working.
    ra.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as err:
        _fetch(fresh)
    assert err.value.code == 404
    svc.unload(tc.model_id)
