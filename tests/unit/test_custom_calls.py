"""trainer/step/custom_calls.py: a server-side custom loss in the trainer's round, the parts a CPU unit
test reaches without a model: the compiled-loss cache, the datum check before the pass, and the DP
gather of every datum's metrics (two gloo processes) against the metrics one rank computes.
The whole path (the SDK, the routes, the round on the tiny trainer): tests/integration/test_tinker_calls.py.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from trainer.batch import RiderSequence, rider_share
from trainer.losses.custom_graph import combine_metrics
from trainer.platform.distributed import ParallelLayout
from trainer.step.custom_calls import CompiledLosses, check_custom_datum, datum_floats, gather_datum_metrics

pytestmark = pytest.mark.unit


def weighted(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/w:mean": weights.mean()}


def spec_of(fn, ranks) -> dict:
    """What create_custom_loss received, as plain data (trainer/rounds.py Call.custom_loss)."""
    from tinker import types  # here, not at the top: the DP test's spawned ranks import this module
    from tinker._compat import model_dump
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, session_id="s")
    body = model_dump(types.CreateCustomLossRequest(session_id="s", custom_loss_seq_id=0, name=handle.name,
                                                    inputs=list(handle.inputs), graph=encode_graph(handle)), mode="json")
    return json.loads(json.dumps({k: body[k] for k in ("name", "inputs", "graph")}))


def test_a_loss_is_compiled_once_and_a_bad_spec_says_what_to_send():
    losses = CompiledLosses(size=2)
    spec = spec_of(weighted, {"logprobs": 1, "weights": 1})
    first = losses.get(spec)
    assert losses.get(json.loads(json.dumps(spec))) is first  # the same spec, another copy: the cached loss
    for bad in (None, {"name": "x"}, {**spec, "extra": 1}):
        with pytest.raises(ValueError, match="loss_fn 'custom' names a loss created with create_custom_loss"):
            losses.get(bad)
    other = {**spec, "name": "other"}
    second = losses.get(other)
    assert losses.get(spec) is first  # used last: other is now the least recently used
    losses.get({**spec, "name": "third"})  # a third in a cache of two: other goes, spec stays
    assert losses.get(spec) is first and losses.get(other) is not second


def test_a_datum_is_checked_before_the_pass():
    loss = CompiledLosses().get(spec_of(weighted, {"logprobs": 1, "weights": 1}))
    ok = {"target_tokens": torch.tensor([1, 2, 3]), "weights": torch.ones(3)}
    check_custom_datum(loss, 3, ok)
    cases = [
        ({"weights": torch.ones(3)}, r"target_tokens'\] must have shape \(3,\) .* got none"),
        ({**ok, "target_tokens": torch.tensor([1, 2])}, r"must have shape \(3,\) .* got shape \(2,\)"),
        ({**ok, "weights": torch.tensor([1.0, float("nan"), 1.0])}, r"loss_fn_inputs\['weights'\] has non-finite values"),
        ({"target_tokens": ok["target_tokens"]}, r"lacks 'weights', which custom loss 'weighted' takes"),
        ({**ok, "weights": torch.ones(4)}, r"node .* failed: The size of tensor a \(3\) must match"),
    ]
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            check_custom_datum(loss, 3, inputs)


def test_datum_floats_are_the_metrics_values():
    got = datum_floats({"custom/a:sum": torch.tensor(1.25, dtype=torch.float64), "custom/b:mean": 3, "custom/c:sum": torch.tensor([0.5])})
    assert got == {"custom/a:sum": 1.25, "custom/b:mean": 3.0, "custom/c:sum": 0.5}


# -- data parallelism: every datum's metrics on every rank ------------------------------------------------

SLOTS = [2, 0, 2, 1, 0, 2, 1]  # riders of three calls' slots, in round order
KEYS = [("custom/x:sum", "custom/y:mean"), (), ("custom/x:sum", "custom/y:mean"), ("custom/z:sum",), (),
        ("custom/x:sum", "custom/y:mean"), ("custom/z:sum",)]


def _metrics(k: int) -> dict[str, float]:
    return {name: 1.0 / (3 + k + j) + 1e-13 * k for j, name in enumerate(KEYS[k])}  # digits float32 would lose


def _dp_worker(rank, port, result_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        riders = [RiderSequence(slot, [1, 2], [2, 3], lambda lp: lp.sum()) for slot in SLOTS]
        layout = ParallelLayout(rank=rank, world_size=2, tp_rank=0, tp_size=1, dp_rank=rank, dp_size=2)
        mine = {k: _metrics(k) for k in rider_share(SLOTS, rank, 2) if KEYS[k]}
        got = gather_datum_metrics(mine, KEYS, riders, layout, torch.device("cpu"), group=dist.group.WORLD)
        torch.save(got, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_every_datums_metrics_exactly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    mp.start_processes(_dp_worker, args=(port, str(tmp_path / "r")), nprocs=2, start_method="spawn", join=True)
    want = {k: _metrics(k) for k in range(len(SLOTS)) if KEYS[k]}
    for rank in range(2):
        got = torch.load(tmp_path / f"r.{rank}")
        assert got == want  # bit for bit: float64 on the wire
        call = [0, 2, 5]  # one call's riders: combined as one rank combines them
        assert combine_metrics([0.0] * 3, [got[k] for k in call]) == combine_metrics([0.0] * 3, [want[k] for k in call])


# -- a replay after a restart runs the same loss (api/tinker/custom_losses.py C2) ---------------------------


def test_a_replayed_custom_call_carries_its_loss(tmp_path):
    """Under tinker_durability step a forward_backward after the last snapshot is replayed into the restored
    slot from its recorded request: the request holds the custom loss, so the replay's Call carries the same
    spec (the scheduler over the FAKE recording trainer of tests/unit/test_scheduler.py)."""
    from tests.unit.test_scheduler import World, _one_step
    from trainer.rounds import AdamStep, Datum

    w = World(tmp_path, durability="step")
    model, _ = w.create("a")
    _one_step(w, model, "a1")
    seen: list = []
    recorded = w.trainer.run_round
    w.trainer.run_round = lambda work: (seen.append([(c.loss_fn, c.custom_loss) for c in work.calls]), recorded(work))[1]
    spec = spec_of(weighted, {"logprobs": 1, "weights": 1})
    w.records.add_future("a2.fb", "alice", "a", "call")  # as World.call submits, with the loss as a keyword

    def answered(value, error) -> None:  # noqa: ANN001 - the operation's done
        w.answers["a2.fb"] = (value, error)
        w.records.resolve("a2.fb", "json", b"{}", keep_request=True)

    model.forward_backward([Datum([1, 2], {})], "custom", None, answered, custom_loss=spec, request_id="a2.fb")
    w.round()
    assert seen[-1] == [("custom", spec)]
    w.records.flush()
    w.scheduler.clear()  # the trainer lost: the model comes back from its snapshot and replays what came after
    w.call(model, "a3.optim", "optim_step", AdamStep(learning_rate=0.1))
    w.rounds_until(lambda: "a3.optim" in w.answers)
    assert ("custom", spec) in [call for calls in seen[1:] for call in calls]  # the replay's call: the same loss
