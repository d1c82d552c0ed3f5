"""The Tinker wire pieces alone: keys, loss resolution, protobuf bodies against the SDK's own
encoder/decoder, and the futures' try-again protocol (the per-model order of operations: tests/unit/test_scheduler.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.unit


# -- keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"alice": "sk-alice-123456789"}, "must be a string starting with 'tml-'"),
        ({"alice": "tml-short"}, "at least 8 more characters"),
        ({"alice": "tml-same-key-1234", "bob": "tml-same-key-1234"}, "share one key"),
        ({"bad name": "tml-alice-123456789"}, "tenant name 'bad name' invalid"),
        ({"alice": 12345}, "must be a string"),
    ],
)
def test_bad_key_files_are_refused(mapping, message):
    from api.tinker.auth import TenantKeys

    with pytest.raises(ValueError, match=message):
        TenantKeys(mapping)


def test_key_file_maps_keys_to_tenants(tmp_path):
    from api.tinker.auth import TenantKeys

    f = tmp_path / "keys.yaml"
    f.write_text("alice: tml-alice-123456789\nbob: tml-bob-987654321\n")
    keys = TenantKeys.from_file(f)
    assert keys.tenant_of("tml-bob-987654321") == "bob"
    assert keys.tenant_of("tml-nobody-0000000") is None and keys.tenant_of(None) is None
    f.write_text("- alice\n")
    with pytest.raises(ValueError, match="mapping of 'tenant: key'"):
        TenantKeys.from_file(f)


# -- losses ---------------------------------------------------------------------------------------


def test_loss_resolution_defaults_and_refusals():
    from trainer.losses.table import resolve_loss

    assert resolve_loss("ppo", None)[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss("cispo", {"clip_high_threshold": 2})[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert resolve_loss("dro", {"beta": 0.05})[1] == {"beta": 0.05}
    for loss_fn, cfg, message in [
        ("dro", None, r"needs loss_fn_config\['beta'\]"),
        ("ppo", {"clip": 0.2}, r"keys \['clip'\] are not known to 'ppo'; allowed: \['clip_high_threshold', 'clip_low_threshold'\]"),
        ("cross_entropy", {"beta": 1}, "allowed: none"),
        ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= clip_high_threshold"),
        ("dro", {"beta": float("inf")}, "must be a finite number"),
        ("custom", None, "named by its loss_id in a Tinker forward_backward; a dataset run cannot name one"),
        ("mse", None, "unknown loss_fn 'mse'; supported: \\['cispo', 'cross_entropy', 'dro', 'gspo', 'importance_sampling', 'ppo', "
                        "'stable_reinforce'\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_loss(loss_fn, cfg)


# -- protobuf ---------------------------------------------------------------------------------------


def _sdk_request(**cfg):
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]})
    return types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum, datum], loss_fn="ppo", loss_fn_config=cfg or None),
        model_id="s-1:train:0", seq_id=3)


@pytest.mark.parametrize("compress", [False, True])
def test_forward_backward_body_decodes_what_the_sdk_encodes(compress):
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from api.tinker.proto_io import decode_forward_backward

    msg = forward_backward_request_to_proto(_sdk_request(clip_low_threshold=0.7))
    msg.forward_only = True
    body = msg.SerializeToString()
    if compress:
        body = zstandard.ZstdCompressor().compress(body)
    fb = decode_forward_backward(body, "zstd" if compress else None)
    assert (fb.model_id, fb.seq_id, fb.loss_fn, fb.forward_only) == ("s-1:train:0", 3, "ppo", True)
    assert fb.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert len(fb.data) == 2 and fb.data[1].tokens == [5, 6, 7]
    assert fb.data[0].inputs["target_tokens"].dtype == torch.int64 and fb.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert fb.data[0].inputs["weights"].tolist() == [0.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="not a ForwardBackwardRequest protobuf"):
        decode_forward_backward(b"\xff\xff\xff")


def test_forward_backward_output_reads_back_in_the_sdk():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from api.tinker.proto_io import encode_forward_backward_output
    from trainer.step.round_runner import CallResult

    res = CallResult(outputs=[{"logprobs": torch.tensor([-1.0, -2.0]), "elementwise_loss": torch.tensor([0.0, 2.0])},
                              {"logprobs": torch.tensor([-0.5, -0.25, -3.0]), "elementwise_loss": torch.tensor([1.0, 1.0, 1.0])}],
                     metrics={"loss:sum": 5.0})
    out = deserialize_forward_backward_output(encode_forward_backward_output(res))
    assert out.metrics == {"loss:sum": 5.0} and len(out.loss_fn_outputs) == 2
    assert out.loss_fn_outputs[1]["logprobs"].tolist() == [-0.5, -0.25, -3.0]
    assert out.loss_fn_outputs[0]["elementwise_loss"].tolist() == [0.0, 2.0]


# -- futures and coalescing -------------------------------------------------------------------------------


def test_futures_try_again_then_result_and_owner_only(tmp_path):
    from api.tinker.futures import FutureStore, Outcome
    from service.registry.tinker_records import TinkerRecords

    records = TinkerRecords(tmp_path / "records.sqlite")

    async def scenario():
        store = FutureStore(records, poll_s=0.01)
        rid = store.create("alice", "m1")
        assert await store.retrieve("alice", rid) is None  # still running: try again
        with pytest.raises(KeyError):
            await store.retrieve("bob", rid)
        store.resolve(rid, Outcome(json={"type": "optim_step"}))
        assert (await store.retrieve("alice", rid)).json == {"type": "optim_step"}
        rid2 = store.create("alice", "m1")
        assert store.cancel("alice", rid2) is True and "cancelled" in (await store.retrieve("alice", rid2)).json["error"]
        assert store.cancel("alice", rid) is False

    asyncio.run(scenario())
    records.close()


def test_a_request_in_flight_at_a_restart_is_answered_after_it(tmp_path):
    """A sample pending when the process stopped answers HTTP 410 after the restart (the SDK's sampling
    client sends it again: tinker/lib/api_future_impl.py, RETRYABLE_EXCEPTION); any other request of
    no model answers a server error saying to send it again. Both are read from the records by a
    new process's FutureStore."""
    from api.tinker.auth import TenantKeys
    from api.tinker.futures import FutureStore
    from api.tinker.service import TinkerService

    models = _models(tmp_path)

    async def first_process():
        store = FutureStore(models.records)
        ids = store.create("alice", None, kind="sample"), store.create("alice", None, kind="check")
        await store.durable()
        return ids

    sample, check = asyncio.run(first_process())
    models.records.close()
    models = _models(tmp_path)  # the next process, over the same records file

    async def second_process():
        svc = TinkerService(models, TenantKeys({"alice": "tml-alice-0123456789"}), poll_s=0.01, session_timeout_s=None)
        await svc.start()
        got_sample, got_check = await svc.futures.retrieve("alice", sample), await svc.futures.retrieve("alice", check)
        await svc.futures.durable()
        return got_sample, got_check

    got_sample, got_check = asyncio.run(second_process())
    assert got_sample.status == 410 and "send it again" in got_sample.json["error"]
    assert got_check.status == 200 and got_check.json["category"] == "server" and "send it again" in got_check.json["error"]
    models.records.close()
    models = _models(tmp_path)  # a third process reads the same answers from the records

    async def third_process():
        store = FutureStore(models.records)
        return await store.retrieve("alice", sample), await store.retrieve("alice", check)

    again_sample, again_check = asyncio.run(third_process())
    assert (again_sample.status, again_sample.json) == (410, got_sample.json)
    assert (again_check.status, again_check.json) == (200, got_check.json)
    models.records.close()


# -- the LoRA options of create_model -------------------------------------------------------------


def _models(tmp_path, **kw):
    """TinkerModels over no scheduler (only its checks run here), with real records and a local store."""
    from service.registry.tinker_records import TinkerRecords
    from service.tenants.tinker_models import TinkerModels
    from trainer.storage.local_store import LocalStore

    return TinkerModels(None, TinkerRecords(tmp_path / "records.sqlite"), LocalStore(tmp_path / "store"), base_model="m",
                        tokenizer_id="m", max_rank=8, **kw)


@pytest.mark.parametrize(
    "flags, targets, problem",
    [
        ({}, ("attention", "mlp", "unembed"), None),  # the SDK's defaults
        ({"train_attn": False, "train_mlp": False}, ("unembed",), None),
        ({"train_unembed": False}, ("attention", "mlp"), None),
        ({"train_attn": False, "train_mlp": False, "train_unembed": False}, (),
         "all False: at least one must be True"),
    ],
)
def test_lora_flags_become_targets(flags, targets, problem, tmp_path):
    from api.tinker import wire
    from api.tinker.auth import TenantKeys
    from api.tinker.service import TinkerService, lora_flags, lora_spec

    svc = TinkerService(_models(tmp_path), TenantKeys({}))
    lc = wire.LoraConfigIn(rank=4, **flags)
    got = svc._lora_problem(wire.CreateModelRequest(session_id="s", model_seq_id=0, base_model="m", lora_config=lc))
    assert (got is None) == (problem is None) and (problem is None or problem in got), got
    if problem is None:
        spec = lora_spec(lc, seed=1)
        assert spec.targets == targets
        assert lora_flags(spec) == {"train_attn": lc.train_attn, "train_mlp": lc.train_mlp, "train_unembed": lc.train_unembed}


def test_a_flag_the_trainer_cannot_honour_is_refused(tmp_path):
    """A trainer without output_layer LoRA (trainer.target_modules narrowed): train_unembed=True is
    refused at create_model, naming what to change; TinkerModels.create refuses it too."""
    from api.tinker import wire
    from api.tinker.auth import TenantKeys
    from api.tinker.service import TinkerService
    from service.tenants.tinker_lora import LoraSpec

    models = _models(tmp_path, target_groups=("attention", "mlp"))
    svc = TinkerService(models, TenantKeys({}))
    got = svc._lora_problem(wire.CreateModelRequest(session_id="s", model_seq_id=0, base_model="m",
                                                    lora_config=wire.LoraConfigIn(rank=4)))
    assert got.startswith("train_unembed=True is not available on this server") and "trainer.target_modules" in got, got
    with pytest.raises(ValueError, match=r"LoRA on \['unembed'\] is not available on this server"):
        models.create("x", "alice", LoraSpec(4, 1), "s", lambda value, error: None)
