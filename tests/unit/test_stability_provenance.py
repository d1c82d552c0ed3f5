"""stable_reinforce's provenance (api/tinker/sampling/stability.py) through the wire: datums built and encoded by
the official SDK (``Datum.with_provenance``, its protobuf encoder), decoded by the server
(api/tinker/proto_io.py), checked against sampling records in a real Registry (SQLite,
service/registry/sampling_records.py).

Accepted: the loss's inputs come from the records (the client's ``logprobs`` is replaced), sequences
are numbered in order; the rl_loop recipe's layout (prompt targets 0 with advantage 0) passes.
Refused, each with a message naming the datum and what is wrong, and nothing used: no provenance, a
span list that does not tile its field, another tenant's or an expired or unknown sequence, a span
past the recorded tokens, tokens that are not the recorded ones, an advantage on a prompt position,
a client-sent ``sampled_sequence``. An accepted call restarts its records' day; a refused one does not.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.unit

PROMPT = [1, 2, 3, 4]
SEQS = [([10, 11, 12], [-0.1, -0.2, -0.3]), ([13, 14], [-0.4, -0.5])]
DAY = 86400.0


@pytest.fixture
def registry(tmp_path):
    from service.registry.registry import Registry

    reg = Registry(tmp_path / "registry.sqlite", 2)
    reg.record_samples("r1", "alice", "samp-a", "tinker://m/sampler_weights/s1", PROMPT, SEQS, now=time.time() - 0.9 * DAY)
    reg.record_samples("old", "alice", "samp-a", "base", PROMPT, SEQS, now=time.time() - 1.5 * DAY)
    yield reg
    reg.close()


def rl_datum(seq: int = 0, adv: float = 1.0, **overrides):
    """The rl_loop recipe's datum of sequence r1-<seq>: prompt + sampled[:-1] in, prompt[1:] (as 0s) +
    sampled as targets, advantage 0 on the prompt, provenance as rl_loop's with_sampled_provenance."""
    from tinker import types

    tokens, lps = SEQS[seq]
    ob = len(PROMPT) - 1
    sid = overrides.pop("sequence_id", f"r1-{seq}")
    inputs = {"target_tokens": [0] * ob + tokens, "logprobs": [0.0] * ob + [9.0] * len(tokens),  # the client's copy: ignored
              "advantages": [0.0] * ob + [adv] * len(tokens), **overrides.pop("inputs", {})}
    model_input = overrides.pop("model_input", PROMPT + tokens[:-1])
    d = types.Datum(model_input=types.ModelInput.from_ints(model_input), loss_fn_inputs=inputs)
    spans_in = overrides.pop("spans_in", [types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                                          types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1)])
    spans_out = overrides.pop("spans_out", [types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
                                            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens))])
    return d if spans_in is None else d.with_provenance(model_input=spans_in, loss_fn_inputs=spans_out)


def wire(data, loss_fn="stable_reinforce"):
    """What the server decodes from the SDK's encoding of a forward_backward of ``data``."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from api.tinker.proto_io import decode_forward_backward

    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
                                       model_id="s-1:train:0", seq_id=1)
    return decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())


def attach(registry, data, tenant="alice", loss_fn="stable_reinforce"):
    from api.tinker.sampling.stability import attach_recorded_inputs

    fb = wire(data, loss_fn)
    return attach_recorded_inputs(tenant, fb.loss_fn, fb.data, fb.provenance, registry)


def test_accepted_inputs_come_from_the_records(registry):
    out = attach(registry, [rl_datum(0), rl_datum(1, adv=-0.5)])
    ob = len(PROMPT) - 1
    q0 = out[0].inputs["logprobs"].tolist()
    assert q0[:ob] == [0.0] * ob and q0[ob:] == pytest.approx([-0.1, -0.2, -0.3])  # the record's, not the client's 9.0
    assert out[1].inputs["logprobs"].tolist()[ob:] == pytest.approx([-0.4, -0.5])
    assert out[0].inputs["sampled_sequence"].tolist() == [0.0] * ob + [1.0] * 3
    assert out[0].inputs["advantages"].tolist() == [0.0] * ob + [1.0] * 3
    # the inputs are exactly what the table's entry takes
    from trainer.losses.table import check_inputs, resolve_loss

    spec, _ = resolve_loss("stable_reinforce", None)
    for d in out:
        check_inputs("stable_reinforce", spec, len(d.tokens), d.inputs)


def test_two_sequences_in_one_datum_are_numbered_in_order(registry):
    """A multi-turn datum: sequence r1-1's prompt, its sampled tokens, then r1-0's sampled tokens."""
    from tinker import types

    t0, t1 = SEQS[0][0], SEQS[1][0]
    d = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + t1 + t0[:-1]),
                    loss_fn_inputs={"target_tokens": PROMPT[1:] + t1 + t0, "advantages": [0.0] * 3 + [1.0] * 5})
    d = d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="r1-1", length=4), types.SampledProvenanceSpan(sequence_id="r1-1", length=2),
                     types.SampledProvenanceSpan(sequence_id="r1-0", length=2)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="r1-1", offset=1, length=3),
                        types.SampledProvenanceSpan(sequence_id="r1-1", length=2), types.SampledProvenanceSpan(sequence_id="r1-0", length=3)])
    (out,) = attach(registry, [d])
    assert out.inputs["sampled_sequence"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert out.inputs["logprobs"].tolist()[3:] == pytest.approx([-0.4, -0.5, -0.1, -0.2, -0.3])


def _refused(registry, data, match, tenant="alice"):
    with pytest.raises(ValueError, match=match):
        attach(registry, data, tenant)


def test_refusals_name_the_datum_and_what_is_wrong(registry):
    from tinker import types

    P, S = types.PromptProvenanceSpan, types.SampledProvenanceSpan
    _refused(registry, [rl_datum(0), rl_datum(0, spans_in=None)], r"datum 1: stable_reinforce needs the provenance of every datum")
    _refused(registry, [rl_datum(0)], r"datum 0: .*sequence 'r1-0', which is not a sequence this API key sampled", tenant="bob")
    _refused(registry, [rl_datum(0, sequence_id="old-0")], "'old-0', which is not a sequence .*or its record expired")
    _refused(registry, [rl_datum(0, sequence_id="nope-0")], "'nope-0', which is not a sequence this API key sampled")
    # P3: a span past the recorded tokens; tokens that are not the recorded ones
    _refused(registry, [rl_datum(1, model_input=PROMPT + [13, 14], spans_in=[P(sequence_id="r1-1", length=4), S(sequence_id="r1-1", length=2)],
                                 spans_out=[P(sequence_id="r1-1", offset=1, length=3), S(sequence_id="r1-1", offset=1, length=2)])],
             r"datum 0: loss_fn_inputs span 1: it claims sampled tokens \[1, 3\) of sequence 'r1-1', which has 2 sampled tokens")
    _refused(registry, [rl_datum(0, model_input=[1, 2, 9, 4, 10, 11])],
             r"model_input span 0 \(positions \[0, 4\)\) is not the prompt tokens \[0, 4\) that sequence 'r1-0' recorded")
    _refused(registry, [rl_datum(0, inputs={"target_tokens": [0, 0, 0, 10, 99, 12]})],
             r"loss_fn_inputs span 1: target_tokens \[3, 6\) are not the sampled tokens \[0, 3\) of sequence 'r1-0'")
    # P4: an advantage on a prompt position
    _refused(registry, [rl_datum(0, inputs={"advantages": [0.0, 0.5, 0.0, 1.0, 1.0, 1.0]})],
             r"advantages are non-zero at position 1, a prompt token of sequence 'r1-0' \(loss_fn_inputs span 0\)")
    # P5: the server's input sent by the client
    _refused(registry, [rl_datum(0, inputs={"sampled_sequence": torch.tensor([0.0] * 3 + [1.0] * 3)})],
             r"loss_fn_inputs\['sampled_sequence'\] is filled by the server")
    _refused(registry, [_without(rl_datum(0), "advantages")], r"loss_fn_inputs lacks \['advantages'\]")


def _without(datum, key):
    import dataclasses

    return dataclasses.replace(datum, loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != key})


def test_spans_that_do_not_tile_are_refused_by_the_server_too(registry):
    """The SDK checks the tiling when it builds a datum; a client that bypasses it (here: the spans
    edited after with_provenance) is refused by the server."""
    import dataclasses

    from tinker import types

    d = rl_datum(0)
    short = dataclasses.replace(d, loss_fn_input_spans=[types.SampledProvenanceSpan(sequence_id="r1-0", length=3)])
    _refused(registry, [short], r"datum 0: the loss_fn_inputs spans cover 3 positions but loss_fn_inputs has 6")
    long = dataclasses.replace(d, model_input_spans=[*d.model_input_spans, types.SampledProvenanceSpan(sequence_id="r1-0", length=1)])
    _refused(registry, [long], r"the model_input spans cover 7 positions but model_input has 6")


def test_provenance_is_ignored_by_other_losses_and_a_refusal_uses_no_record(registry):
    data = [rl_datum(0)]
    fb = wire(data, "importance_sampling")
    assert fb.provenance[0] is not None
    from api.tinker.sampling.stability import attach_recorded_inputs

    assert attach_recorded_inputs("alice", "importance_sampling", fb.data, fb.provenance, registry) is fb.data
    later = time.time() + 0.2 * DAY  # r1 was sampled 0.9 days ago: at `later` it expired unless used since
    _refused(registry, [rl_datum(0), rl_datum(0, sequence_id="nope-0")], "nope-0")
    assert registry.sampled_sequences("alice", ["r1-0"], now=later, touch=False) == {}  # the refusal did not use it
    attach(registry, data)
    assert list(registry.sampled_sequences("alice", ["r1-0", "r1-1"], now=later, touch=False)) == ["r1-0"]  # used: a new day


def test_a_half_provenance_is_a_bad_body():
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker import types

    from api.tinker.proto_io import decode_forward_backward

    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[rl_datum(0)], loss_fn="stable_reinforce"),
                                       model_id="m", seq_id=1)
    msg = forward_backward_request_to_proto(req)
    del msg.data[0].loss_fn_input_spans[:]
    with pytest.raises(ValueError, match="datum 0: provenance comes as a pair"):
        decode_forward_backward(msg.SerializeToString())


def test_records_expire_a_day_after_their_last_use(registry):
    now = time.time()
    assert list(registry.sampled_sequences("alice", ["r1-0", "old-0"], now=now)) == ["r1-0"]  # old: sampled 1.5 days ago
    assert registry.sweep_sampling_records(now=now) == 2  # old's two sequences (and its request) are deleted
    assert registry.sampled_sequences("alice", ["r1-0"], now=now + 0.99 * DAY, touch=False)  # used at `now`
    assert registry.sweep_sampling_records(now=now + 1.01 * DAY) == 2
    assert registry._db.execute("SELECT COUNT(*) FROM tinker_sample_requests").fetchone()[0] == 0
    with pytest.raises(ValueError, match="3 tokens but 2 log-probabilities"):
        registry.record_samples("r2", "alice", "samp-a", "base", PROMPT, [([1, 2, 3], [-1.0, -1.0])])
