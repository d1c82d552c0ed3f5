"""trainer/losses/custom_graph.py (with custom_ops.py): the Tinker SDK's server-side custom loss.

The graphs are made by the SDK itself, as ``ServiceClient.create_custom_loss`` makes them: the
user's function traced by ``trace_loss``, encoded by ``encode_graph`` into the SDK's
``CreateCustomLossRequest``, dumped as the SDK's HTTP body (``model_dump(..., mode="json")``) and
through JSON text. Parity: the rebuilt loss against (1) the user's Python function run directly
with torch autograd, summed over datums, metrics reduced as the SDK documents (``:sum`` summed,
``:mean`` averaged over datums), and (2) the SDK's own client-side runner (``run_loss_handle``,
the traced fx GraphModule). Hostile graphs are raw JSON, as a client that bypasses the SDK
would send them.
"""

from __future__ import annotations

import ast
import json
import math

import pytest
import torch
import torch.nn.functional as F
from tinker import types
from tinker._compat import model_dump
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss
from torch.fx.node import _get_qualified_name

from trainer.losses import custom_ops
from trainer.losses.custom_graph import MAX_NODES, CustomLoss, call_loss, compile_custom_loss
from tests.paths import REPO

pytestmark = pytest.mark.unit



# -- the users' losses (per datum, as create_custom_loss documents them) -----------------------------


def weighted_ce(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/weight:mean": weights.sum() / weights.shape[0]}


def clipped_is(logprobs, sampler_logprobs, advantages):
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/clipped:sum": (ratio != clipped).float().sum()}


def masked_mix(logprobs, mask, beta):
    kept = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))
    count = mask.sum().clamp_min(1.0)
    selected = logprobs[mask > 0]  # a boolean mask: a data-dependent shape
    sharp = F.logsigmoid(logprobs - logprobs.detach().mean()).sum()
    scale = math.sqrt(logprobs.shape[0])
    tail = logprobs[..., 1:].to(torch.float64).mean().float()
    loss = -(kept.sum() / count) - beta * sharp / scale + 0.1 * selected.sum() ** 2 / (selected.numel() + 1) + tail
    return loss, {"custom/kept:mean": count, "custom/selected:sum": selected.float().sum(), "custom/len:sum": scale}


def distill(logprobs, teacher_scores):
    weight = torch.softmax(teacher_scores, dim=-1)[:, 0]
    loss = -(weight * logprobs).sum() + torch.logsumexp(teacher_scores, dim=-1).mean() * 0.0
    return loss, {"custom/top:mean": weight.max()}


def _datum_inputs(fn, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    q = -torch.rand(n, generator=g) * 3
    by_name = {
        "weights": torch.rand(n, generator=g) * 2 * (torch.rand(n, generator=g) > 0.3),
        # ratios exp(lp - q) on both sides of each clip bound (lp is drawn around q below)
        "sampler_logprobs": q,
        "advantages": torch.randn(n, generator=g),
        "mask": (torch.rand(n, generator=g) > 0.4).float(),
        "beta": torch.tensor(0.3),  # rank 0
        "teacher_scores": torch.randn(n, 4, generator=g),  # rank 2
        "target_tokens": torch.randint(0, 100, (n,), generator=g),  # read by no loss: ignored
    }
    return {k: v for k, v in by_name.items() if k in RANKS[fn] or k == "target_tokens"}


RANKS = {
    weighted_ce: {"logprobs": 1, "weights": 1},
    clipped_is: {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1},
    masked_mix: {"logprobs": 1, "mask": 1, "beta": 0},
    distill: {"logprobs": 1, "teacher_scores": 2},
}
LENGTHS = (7, 2, 12, 5)


def wire(fn, ranks) -> tuple[dict, object]:
    """The HTTP body create_custom_loss sends for ``fn`` (through JSON text), and the SDK's handle."""
    handle = trace_loss(fn, ranks, "session")
    request = types.CreateCustomLossRequest(session_id="session", custom_loss_seq_id=0, name=handle.name,
                                            inputs=list(handle.inputs), graph=encode_graph(handle))
    body = model_dump(request, exclude_unset=False, exclude_none=True, mode="json")  # as resources/service.py
    return json.loads(json.dumps(body)), handle


def rebuilt(fn, **kw) -> CustomLoss:
    body, _ = wire(fn, RANKS[fn])
    return compile_custom_loss(body["name"], body["inputs"], body["graph"], **kw)


def batch(fn, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    inputs = [_datum_inputs(fn, n, g) for n in LENGTHS]
    logprobs = [((d["sampler_logprobs"] if "sampler_logprobs" in d else -torch.rand(n, generator=g) * 3)
                 + 0.3 * torch.randn(n, generator=g)) for d, n in zip(inputs, LENGTHS)]
    return logprobs, inputs


def sdk_data(logprobs, inputs) -> list[types.Datum]:
    """The datums as the SDK's types (model_input: as many tokens as logprobs)."""
    return [types.Datum(model_input=types.ModelInput.from_ints(list(range(len(lp)))),
                        loss_fn_inputs={k: types.TensorData.from_torch(v) for k, v in d.items()})
            for lp, d in zip(logprobs, inputs)]


def reference(fn, logprobs, inputs):
    """The user's function run per datum with torch autograd; metrics by the SDK's documented rule."""
    lps = [lp.detach().clone().requires_grad_(True) for lp in logprobs]
    names = list(RANKS[fn])[1:]
    outs = [fn(lp, *(d[k] for k in names)) for lp, d in zip(lps, inputs)]
    total = sum(loss for loss, _ in outs)
    total.backward()
    sums = {k: sum(float(torch.as_tensor(m[k]).detach()) for _, m in outs) for k in outs[0][1]}
    metrics = {k: v / len(outs) if k.endswith(":mean") else v for k, v in sums.items()}
    return float(total.detach()), [lp.grad for lp in lps], {"loss:sum": float(total.detach()), **metrics}


# -- (a) the same loss server-side and client-side ---------------------------------------------------


@pytest.mark.parametrize("fn", list(RANKS), ids=lambda f: f.__name__)
def test_rebuilt_loss_equals_the_users_function(fn):
    logprobs, inputs = batch(fn)
    loss = rebuilt(fn)
    for lp, d in zip(logprobs, inputs):
        loss.check_datum(len(lp), d)
    lps = [lp.clone().requires_grad_(True) for lp in logprobs]
    total, metrics = call_loss(loss, lps, inputs)
    total.backward()
    want_total, want_grads, want_metrics = reference(fn, logprobs, inputs)
    assert float(total.detach()) == pytest.approx(want_total, rel=1e-6, abs=1e-6)
    for got, want in zip((lp.grad for lp in lps), want_grads):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (got, want)
    assert metrics.keys() == want_metrics.keys()
    for key, want in want_metrics.items():
        assert metrics[key] == pytest.approx(want, rel=1e-6, abs=1e-6), key
    if fn is clipped_is:  # the data puts ratios outside the clip (else the clamp would not be exercised)
        assert 0 < metrics["custom/clipped:sum"] < sum(LENGTHS)


@pytest.mark.parametrize("fn", list(RANKS), ids=lambda f: f.__name__)
def test_rebuilt_loss_equals_the_sdks_client_side_runner(fn):
    """The SDK runs the same handle client-side with its fx GraphModule (run_loss_handle)."""
    logprobs, inputs = batch(fn, seed=1)
    body, handle = wire(fn, RANKS[fn])
    data = sdk_data(logprobs, inputs)
    sdk_lps = [lp.clone().requires_grad_(True) for lp in logprobs]
    sdk_total, sdk_metrics = run_loss_handle(handle, data, sdk_lps)
    sdk_total.backward()
    lps = [lp.clone().requires_grad_(True) for lp in logprobs]
    total, metrics = call_loss(compile_custom_loss(body["name"], body["inputs"], body["graph"]), lps, inputs)
    total.backward()
    assert float(total.detach()) == pytest.approx(float(sdk_total.detach()), rel=1e-6, abs=1e-6)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7) for a, b in zip(lps, sdk_lps))
    assert {k: v for k, v in metrics.items() if k != "loss:sum"} == pytest.approx(sdk_metrics, rel=1e-9)


def test_metrics_of_chunks_combine_as_the_whole_call():
    """The SDK may split one call into chunks and combines their metrics (:mean weighted by datums)."""
    logprobs, inputs = batch(clipped_is, seed=2)
    loss = rebuilt(clipped_is)
    _, whole = call_loss(loss, logprobs, inputs)

    def chunk(lo: int, hi: int) -> types.ForwardBackwardOutput:
        _, metrics = call_loss(loss, logprobs[lo:hi], inputs[lo:hi])
        outputs = [{"logprobs": types.TensorData.from_torch(lp)} for lp in logprobs[lo:hi]]
        return types.ForwardBackwardOutput(loss_fn_output_type="custom", metrics=metrics, loss_fn_outputs=outputs)

    combined = combine_fwd_bwd_output_results([chunk(0, 1), chunk(1, 4)]).metrics
    assert combined == pytest.approx(whole, rel=1e-9)


def test_every_allowed_function_is_named_as_the_sdk_names_it():
    """The allow-list's keys are what encode_graph sends for each callable (fx's qualified name,
    ``_operator.`` written ``operator.``), so a traced call of it is found."""
    for name, fn in custom_ops.FUNCTIONS.items():
        sent = _get_qualified_name(fn)
        sent = "operator." + sent.removeprefix("_operator.") if sent.startswith("_operator.") else sent
        assert sent == name, (name, sent)
    for name, method in custom_ops.METHODS.items():
        assert not name.endswith("_") and method is getattr(torch.Tensor, name), name


def test_datum_checks_say_what_is_wrong():
    loss = rebuilt(masked_mix)
    (lp, *_), (d, *_) = batch(masked_mix)
    with pytest.raises(ValueError, match=r"loss_fn_inputs lacks 'mask', which custom loss 'masked_mix' takes"):
        loss.check_datum(len(lp), {"beta": d["beta"]})
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['beta'\] has rank 1, but custom loss 'masked_mix' declared rank 0"):
        loss.check_datum(len(lp), {**d, "beta": torch.ones(len(lp))})
    with pytest.raises(ValueError, match=r"node 'where' \(call_function 'torch.where'\) failed: The size of tensor a \(8\) must match"):
        loss.check_datum(len(lp), {**d, "mask": torch.ones(len(lp) + 1)})


def test_the_sdks_forward_backward_request_reaches_the_loss_through_the_protobuf_wire():
    """What forward_backward_custom sends for an uploaded loss (forward_backward(data, "custom",
    {"loss_id": ...})), encoded by the SDK's proto writer and decoded by api/tinker/proto_io.py:
    the loss_id arrives as text (the one text value proto_io reads), and the rank-0 input (written with no shape, read as [1]) is
    read by the loss as 0-dim, so the loss equals the user's function on the original data."""
    from api.tinker.proto_io import decode_forward_backward
    from tinker.proto.request_conv import forward_backward_request_to_proto

    logprobs, inputs = batch(masked_mix, seed=3)
    data = sdk_data(logprobs, inputs)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="custom",
                                                          loss_fn_config={"loss_id": "loss-1"}),
        model_id="m", seq_id=1)
    msg = forward_backward_request_to_proto(request)
    assert msg.loss_fn == "custom" and msg.loss_fn_config_v2["loss_id"].text == "loss-1"
    received = decode_forward_backward(msg.SerializeToString())
    assert (received.loss_fn, received.loss_id, received.loss_fn_config) == ("custom", "loss-1", {})
    assert tuple(received.data[0].inputs["beta"].shape) == (1,)  # rank 0 read as [1]
    loss = rebuilt(masked_mix)
    for lp, d in zip(logprobs, received.data):
        loss.check_datum(len(lp), d.inputs)
    total, metrics = call_loss(loss, logprobs, [d.inputs for d in received.data])
    want_total, _, want_metrics = reference(masked_mix, logprobs, inputs)
    assert float(total) == pytest.approx(want_total, rel=1e-6)
    assert metrics == pytest.approx(want_metrics, rel=1e-6)


def test_the_wire_reads_loss_id_only_as_a_custom_calls_name():
    """proto_io: the one text value of loss_fn_config is a ``custom`` call's loss_id; anything else
    textual, a custom call without its loss_id, or with other keys, is refused saying what to send."""
    from api.tinker.proto_io import decode_forward_backward
    from tinker.proto.request_conv import forward_backward_request_to_proto

    def body(loss_fn: str, config: dict | None) -> bytes:
        data = sdk_data(*batch(weighted_ce))[:1]
        request = types.ForwardBackwardRequest(model_id="m", seq_id=1, forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config))
        return forward_backward_request_to_proto(request).SerializeToString()

    cases = [
        ("ppo", {"loss_id": "x"}, r"loss_fn_config\['loss_id'\] is text; only numbers are supported \(and loss_id"),
        ("custom", None, r"loss_fn 'custom' takes loss_fn_config \{'loss_id'.* got \[\]"),
        ("custom", {"loss_id": "x", "beta": 1.0}, r"and nothing else, got \['beta', 'loss_id'\]"),
        ("custom", {"name": "x"}, r"loss_fn_config\['name'\] is text"),
    ]
    for loss_fn, config, message in cases:
        with pytest.raises(ValueError, match=message):
            decode_forward_backward(body(loss_fn, config))


def no_gradient(logprobs, weights):
    return (logprobs.detach() * weights).sum(), {}


def not_a_scalar(logprobs, weights):
    return -(logprobs * weights), {}


@pytest.mark.parametrize("fn, message", [
    (no_gradient, "its loss does not depend on logprobs"),
    (not_a_scalar, r"must return a 0-dim floating tensor as its loss, got torch.float32 \(4,\)"),
])
def test_a_loss_that_cannot_train_is_refused_before_the_pass(fn, message):
    body, _ = wire(fn, {"logprobs": 1, "weights": 1})
    loss = compile_custom_loss(body["name"], body["inputs"], body["graph"])
    with pytest.raises(ValueError, match=message):
        loss.check_datum(4, {"weights": torch.ones(4)})


# -- (b) hostile graphs -----------------------------------------------------------------------------

INPUTS = [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}]


def node(op: str, name: str, target: str, *args, **kwargs) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def ref(name: str) -> dict:
    return {"ref": name}


def graph(*nodes: dict) -> dict:
    """logprobs, weights, the hostile nodes, then a real loss (logprobs.sum()) and the output."""
    return {"format": 1, "nodes": [
        node("placeholder", "logprobs", "logprobs"), node("placeholder", "weights", "weights"), *nodes,
        node("call_method", "total", "sum", ref("logprobs")),
        node("output", "output", "output", {"tuple": [ref("total"), {"dict": {}}]})]}


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


ALLOWED_FUNCTIONS = "a custom loss may call only ["  # followed by the allow-list
COMPILE_REFUSALS = {
    "os.system": (graph(node("call_function", "pwn", "os.system", "echo pwned")),
                  r"node 'pwn' \(call_function 'os.system'\): function 'os.system' is not allowed"),
    "builtins.eval": (graph(node("call_function", "e", "builtins.eval", "1+1")), "function 'builtins.eval' is not allowed"),
    "eval": (graph(node("call_function", "e", "eval", "1+1")), "function 'eval' is not allowed"),
    "builtins.exec": (graph(node("call_function", "e", "builtins.exec", "x=1")), "function 'builtins.exec' is not allowed"),
    "builtins.__import__": (graph(node("call_function", "i", "builtins.__import__", "os")),
                            "function 'builtins.__import__' is not allowed"),
    "importlib": (graph(node("call_function", "i", "importlib.import_module", "os")),
                  "function 'importlib.import_module' is not allowed"),
    "getattr dunder": (graph(node("call_function", "cls", "getattr", ref("logprobs"), "__class__")),
                       r"node 'cls' \(call_function 'getattr'\): getattr is allowed only as tensor.<attribute> with "
                       r"attribute in \['dtype', 'ndim', 'shape'\]"),
    "getattr on a constant": (graph(node("call_function", "j", "getattr", "abc", "join")),
                              "getattr is allowed only as tensor.<attribute>"),
    "builtins.getattr": (graph(node("call_function", "g", "builtins.getattr", ref("logprobs"), "shape")),
                         "function 'builtins.getattr' is not allowed"),
    "get_attr op": (graph(node("get_attr", "a", "logprobs.__class__")),
                    r"node 'a' \(get_attr 'logprobs.__class__'\): a custom loss may not read attributes"),
    "dunder method": (graph(node("call_method", "r", "__reduce_ex__", ref("logprobs"), 2)),
                      r"method '__reduce_ex__' is not allowed; allowed tensor methods: \['abs', "),
    "in-place method": (graph(node("call_method", "z", "zero_", ref("weights"))), "method 'zero_' is not allowed"),
    "setitem": (graph(node("call_function", "s", "operator.setitem", ref("weights"), 0, 1.0)),
                "function 'operator.setitem' is not allowed"),
    "call_module": (graph(node("call_module", "m", "linear", ref("logprobs"))), "a custom loss may not call modules"),
    "out=": (graph(node("call_function", "o", "torch.exp", ref("logprobs"), out=ref("weights"))),
             r"node 'o' \(call_function 'torch.exp'\): keyword 'out' is not allowed \(writes into an existing tensor\)"),
    "inplace=True": (graph(node("call_function", "r", "torch.nn.functional.relu", ref("weights"), inplace=True)),
                     "inplace=True is not allowed"),
    "device": (graph(node("call_method", "d", "to", ref("logprobs"), {"device": "cuda:1"})),
               "device arguments are not allowed"),
    "string argument": (graph(node("call_method", "d", "to", ref("logprobs"), "cuda:1")),
                        "string arguments are not allowed here"),
    "too many nodes": ({"format": 1, "nodes": graph(*(node("call_function", f"n{i}", "torch.exp", ref("logprobs"))
                                                      for i in range(MAX_NODES)))["nodes"]},
                       f"graph has {MAX_NODES + 4} nodes; a custom loss may have at most {MAX_NODES}"),
    "deeply nested arg": (graph(node("call_function", "deep", "torch.stack", nested(7))),
                          r"node 'deep' \(call_function 'torch.stack'\): its arguments nest deeper than 6 levels"),
    "huge list constant": (graph(node("call_function", "big", "torch.stack", list(range(10_000)))),
                           "its arguments hold more than 64 values"),
    "huge int constant": (graph(node("call_function", "big", "operator.mul", ref("logprobs"), 10**30)),
                          rf"integer constant {10**30} is outside \[-2\*\*53, 2\*\*53\]"),
    "huge string constant": (graph(node("call_function", "big", "torch.exp", "x" * 100_000)),
                             "a string constant is longer than 64 characters"),
    "ref to a later node": (graph(node("call_function", "early", "torch.exp", ref("total"))),
                            r"\{'ref': 'total'\} names no earlier node"),
    "unknown encoding": (graph(node("call_function", "p", "torch.exp", {"pickle": "gASV"})),
                         r"\{'pickle': 'gASV'\} is not an allowed encoded value; allowed kinds"),
    "metric off the rule": ({"format": 1, "nodes": [*graph()["nodes"][:3], node(
        "output", "output", "output", {"tuple": [ref("total"), {"dict": {"loss:sum": ref("total")}}]})]},
        r"metric 'loss:sum' is not allowed; the output is \(loss, \{'custom/<name>:sum'"),
}


@pytest.mark.parametrize("case", list(COMPILE_REFUSALS))
def test_hostile_graph_is_refused_when_created(case):
    hostile, message = COMPILE_REFUSALS[case]
    with pytest.raises(ValueError, match=message) as err:
        compile_custom_loss("evil", INPUTS, json.loads(json.dumps(hostile)))
    assert str(err.value).startswith("custom loss 'evil'")


def test_refusal_of_a_function_lists_what_is_allowed():
    with pytest.raises(ValueError) as err:
        compile_custom_loss("evil", INPUTS, COMPILE_REFUSALS["os.system"][0])
    listed = str(err.value).split(ALLOWED_FUNCTIONS)[1]
    assert "'torch.exp'" in listed and "'operator.mul'" in listed and "'math.sqrt'" in listed


N = 4096  # tokens of the datum the run-time refusals get
RUN_REFUSALS = {
    "integer-tensor index": (graph(node("call_method", "idx", "long", ref("weights")),
                                   node("call_function", "pick", "operator.getitem", ref("logprobs"), ref("idx"))),
                             r"node 'pick' \(call_function 'operator.getitem'\) failed: indexes a tensor with a "
                             r"torch.int64 tensor; only boolean masks index by tensor"),
    "method on a shape": (graph(node("call_function", "shape", "getattr", ref("logprobs"), "shape"),
                                node("call_method", "n", "numel", ref("shape"))),
                          r"node 'n' \(call_method 'numel'\) failed: is called on a Size; only tensors"),
    "sequence arithmetic": (graph(node("call_function", "shape", "getattr", ref("logprobs"), "shape"),
                                  node("call_function", "many", "operator.mul", ref("shape"), 10**9)),
                            r"node 'many' \(call_function 'operator.mul'\) failed: takes tensors and numbers only"),
    "integer power": (graph(node("call_function", "p", "operator.pow", 10, 10**6)),
                      r"failed: 10 \*\* 1000000 exceeds 2\*\*53"),
    "where(condition)": (graph(node("call_function", "w", "torch.where", ref("weights"))),
                         r"failed: torch.where\(condition\) \(one index tensor per dimension\) is not allowed"),
    "math on a tensor": (graph(node("call_function", "m", "math.exp", ref("logprobs"))),
                         "failed: math functions take Python numbers only"),
    # [N, N] (16M elements) is allowed; [N, N, N] (2**36) is refused from the shapes, before it is allocated
    "memory blow-up": (graph(node("call_function", "col", "operator.getitem", ref("logprobs"),
                                  {"tuple": [{"slice": [None, None, None]}, None]}),
                             node("call_function", "square", "operator.mul", ref("col"), ref("logprobs")),
                             node("call_function", "sq3", "operator.getitem", ref("square"),
                                  {"tuple": [{"ellipsis": True}, None]}),
                             node("call_function", "cube", "operator.mul", ref("sq3"), ref("logprobs"))),
                       r"node 'cube' \(call_function 'operator.mul'\) failed: could produce \(bound from its "
                       rf"arguments' shapes, before running\) up to {2 * N**3} tensor elements"),
}


@pytest.mark.parametrize("case", list(RUN_REFUSALS))
def test_hostile_graph_is_refused_before_the_pass(case):
    hostile, message = RUN_REFUSALS[case]
    loss = compile_custom_loss("evil", INPUTS, hostile)
    weights = torch.linspace(0, 3, N)
    before = weights.clone()
    with pytest.raises(ValueError, match=message):
        loss.check_datum(N, {"weights": weights})
    assert torch.equal(weights, before)


def test_the_element_budget_counts_every_node():
    """Each exp of [N] produces N elements and is bounded by 2N before it runs: in a budget of 4N
    three run (N left), the fourth is refused before running."""
    hostile = graph(*(node("call_function", f"e{i}", "torch.exp", ref("logprobs")) for i in range(4)))
    loss = compile_custom_loss("evil", INPUTS, hostile, max_value_elements=4 * N)
    with pytest.raises(ValueError, match=rf"node 'e3' .* failed: could produce .* up to {2 * N} tensor elements, "
                                         rf"more than the {N} left of the {4 * N}"):
        loss.check_datum(N, {"weights": torch.ones(N)})


def _call_patterns():
    """Arguments for a sweep of the allowed callables: broadcasting shapes, masks, dims, lists."""
    a, b, v = torch.randn(3, 1), torch.randn(1, 4), torch.randn(5)
    m = a > 0
    return [((a,), {}), ((v,), {}), ((a, b), {}), ((b, a), {}), ((a, 2), {}), ((a, 0.5), {}), ((a, 0), {}),
            ((a, 1), {}), ((a, -1), {}), ((v, 0), {}), ((a, 1), {"keepdim": True}), ((a,), {"dim": 1}),
            ((m, a, b), {}), ((a, m, 0.0), {}), ((a, 0.1, 0.9), {}), ((a, b, b), {}), (([a, a],), {}),
            (([a, a], 1), {}), ((a, (slice(None), None)), {}), ((v, v > 0), {}), ((a, (Ellipsis, 0)), {}),
            ((a, torch.float64), {}), ((a, 3, 1), {}), ((a, (-1,)), {}), ((a, b), {"rounding_mode": "floor"}),
            ((m, b), {}), ((v, v), {}), ((m,), {}), ((m, b > 0), {}), ((torch.ones(2, 2, 2, 2) > 0,), {})]


@pytest.mark.filterwarnings("ignore::UserWarning")  # deprecated overloads and dims the sweep calls
def test_the_element_bound_holds_for_every_allowed_callable():
    """custom_ops.elements_bound: no allowed function or method, called with any of the sweep's
    arguments that its run-time rules (check_arguments) let through, produces more elements than the
    bound says; each is called successfully at least once."""
    called = set()
    callables = [(name, fn, False) for name, fn in custom_ops.FUNCTIONS.items() if name not in custom_ops.MATH]
    callables += [(name, fn, True) for name, fn in custom_ops.METHODS.items()]
    for name, fn, is_method in callables:
        for args, kwargs in _call_patterns():
            try:
                custom_ops.check_arguments("call_method" if is_method else "call_function", name, args)
                out = fn(*args, **kwargs)
            except (RuntimeError, TypeError, ValueError, IndexError, AttributeError, NotImplementedError):
                continue
            called.add(name)
            bound = custom_ops.elements_bound("method" if is_method else name, args, kwargs)
            assert custom_ops.elements(out) <= bound, (name, [getattr(x, "shape", x) for x in args], kwargs)
    never_called = {name for name, _, _ in callables} - called
    assert not never_called, sorted(never_called)


def test_the_product_modules_evaluate_and_import_nothing_by_name():
    """No eval/exec/compile/__import__/getattr builtin and no import_module call in the two modules
    (the allow-list maps names to callables in dicts; Tensor attributes are read by lambdas)."""
    builtins = {"eval", "exec", "compile", "__import__", "getattr", "globals", "vars", "locals"}
    for module in ("trainer/losses/custom_graph.py", "trainer/losses/custom_ops.py"):
        tree = ast.parse((REPO / module).read_text())
        calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
        named = {f.id for f in calls if isinstance(f, ast.Name)} & builtins
        methods = {f.attr for f in calls if isinstance(f, ast.Attribute)} & {"import_module", "__import__"}
        assert not named and not methods, (module, named, methods)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert "importlib" not in imported and "builtins" not in imported
