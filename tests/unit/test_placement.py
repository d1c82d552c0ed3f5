"""The placement planner on realistic cluster shapes (1x8, 2x8, 4x8 GPUs), refusals included."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from service.placement import (
    ClusterShape,
    PlacementConfig,
    PlacementError,
    PlacementPlan,
    placement_group_specs,
    plan_placement,
)

pytestmark = pytest.mark.unit


def gpu_plan(engines: int, engine_tp: int, trainer_tp: int, trainer_dp: int) -> PlacementConfig:
    return PlacementConfig.model_validate(
        {
            "accelerator": "gpu",
            "engines": {"count": engines, "tensor_parallel": engine_tp},
            "trainer": {"tensor_parallel": trainer_tp, "data_parallel": trainer_dp},
        }
    )


def check_invariants(plan: PlacementPlan) -> None:
    """No GPU slot twice; each TP group on one node; Megatron rank order; slots within the node."""
    cluster = plan.cluster
    assert cluster is not None
    slots = [(e.node, g) for e in plan.engines for g in e.gpus] + [(r.node, r.gpu) for r in plan.trainer]
    assert len(slots) == len(set(slots)) == plan.config.total_gpus
    for node, gpu in slots:
        assert 0 <= gpu < cluster.node_gpus[node]
    for e in plan.engines:
        assert len(e.gpus) == plan.config.engines.tensor_parallel
    tp = plan.config.trainer.tensor_parallel
    for r in plan.trainer:
        assert r.rank == r.dp_rank * tp + r.tp_rank
    for dp in range(plan.config.trainer.data_parallel):
        nodes = {r.node for r in plan.trainer if r.dp_rank == dp}
        assert len(nodes) == 1, f"trainer TP group {dp} straddles nodes {nodes}"


# (nodes, gpus/node, engines, engine TP, trainer TP, trainer DP, GPUs used per node)
FITTING = [
    (1, 8, 4, 1, 2, 2, [8]),
    (1, 8, 2, 2, 4, 1, [8]),
    (1, 8, 1, 1, 1, 1, [2]),
    (2, 8, 4, 2, 2, 4, [8, 8]),
    (2, 8, 2, 4, 8, 1, [8, 8]),
    (2, 8, 3, 2, 2, 2, [8, 2]),
    (4, 8, 8, 2, 4, 4, [8, 8, 8, 8]),
    (4, 8, 4, 4, 8, 2, [8, 8, 8, 8]),
    (4, 8, 16, 1, 2, 8, [8, 8, 8, 8]),
]


@pytest.mark.parametrize("nodes,per_node,n_eng,eng_tp,tr_tp,tr_dp,used", FITTING)
def test_plan_fits_and_keeps_invariants(nodes, per_node, n_eng, eng_tp, tr_tp, tr_dp, used):
    plan = plan_placement(gpu_plan(n_eng, eng_tp, tr_tp, tr_dp), ClusterShape.uniform(nodes, per_node))
    check_invariants(plan)
    per_node_used = Counter([e.node for e in plan.engines for _ in e.gpus] + [r.node for r in plan.trainer])
    assert [per_node_used.get(n, 0) for n in range(nodes)] == used


def test_two_by_eight_assignment_is_exact():
    # 2x8: trainer TP 2 x DP 4 (8 ranks) fills node 0, four TP-2 engines fill node 1.
    plan = plan_placement(gpu_plan(4, 2, 2, 4), ClusterShape.uniform(2, 8))
    assert [(r.rank, r.node, r.gpu) for r in plan.trainer] == [(i, 0, i) for i in range(8)]
    assert [(e.engine, e.node, e.gpus) for e in plan.engines] == [(0, 1, (0, 1)), (1, 1, (2, 3)), (2, 1, (4, 5)), (3, 1, (6, 7))]
    assert "16 of cluster 2 nodes x 8 GPUs = 16" in plan.summary()


REFUSALS = [
    # total over the cluster: the message carries the whole sum
    (
        1, 8, (4, 2, 2, 4),
        "engines need 4 x TP 2 = 8 GPUs, trainer needs TP 2 x DP 4 = 8 GPUs, total 16 > cluster 1 node x 8 GPUs = 8",
    ),
    (
        2, 8, (8, 2, 4, 2),
        "engines need 8 x TP 2 = 16 GPUs, trainer needs TP 4 x DP 2 = 8 GPUs, total 24 > cluster 2 nodes x 8 GPUs = 16",
    ),
    (
        4, 8, (16, 1, 4, 5),
        "engines need 16 x TP 1 = 16 GPUs, trainer needs TP 4 x DP 5 = 20 GPUs, total 36 > cluster 4 nodes x 8 GPUs = 32",
    ),
    # a TP group wider than a node
    (4, 8, (1, 16, 1, 1), "engine TP 16 > 8 GPUs on the largest node: a TP group must not straddle nodes"),
    (4, 8, (1, 1, 16, 1), "trainer TP 16 > 8 GPUs on the largest node: a TP group must not straddle nodes"),
    # fits by count, not without straddling: 3 x TP 6 on 3 x 8 leaves 2+2+2 free, engine TP 4 has nowhere
    (3, 8, (1, 4, 6, 3), "total 22 <= cluster 3 nodes x 8 GPUs = 24, but the TP groups"),
]


@pytest.mark.parametrize("nodes,per_node,shape,message", REFUSALS)
def test_plan_refused_with_arithmetic(nodes, per_node, shape, message):
    with pytest.raises(PlacementError) as err:
        plan_placement(gpu_plan(*shape), ClusterShape.uniform(nodes, per_node))
    assert message in str(err.value)


def test_straddle_refusal_shows_free_gpus_per_node():
    with pytest.raises(PlacementError, match=r"engine 0 \(4 GPUs\) found no room: \[2, 2, 2\]"):
        plan_placement(gpu_plan(1, 4, 6, 3), ClusterShape.uniform(3, 8))


def test_heterogeneous_cluster_is_described_per_node():
    with pytest.raises(PlacementError, match=r"total 14 > cluster 2 nodes with \[8, 4\] GPUs = 12"):
        plan_placement(gpu_plan(3, 2, 2, 4), ClusterShape(node_gpus=(8, 4)))
    plan = plan_placement(gpu_plan(2, 2, 2, 4), ClusterShape(node_gpus=(8, 4)))
    check_invariants(plan)


def test_gpu_plan_without_cluster_is_refused():
    with pytest.raises(PlacementError, match="needs the cluster shape"):
        plan_placement(gpu_plan(1, 1, 1, 1), None)


def test_cpu_default_plan_is_valid_without_gpus():
    cfg = PlacementConfig()  # the embedded tiny default
    assert (cfg.accelerator, cfg.total_gpus) == ("cpu", 0)
    plan = plan_placement(cfg, ClusterShape.uniform(1, 0))
    assert [(e.engine, e.gpus) for e in plan.engines] == [(0, ())]
    assert [(r.rank, r.gpu) for r in plan.trainer] == [(0, None)]
    specs = placement_group_specs(plan)
    assert [(s.name, s.bundles) for s in specs] == [
        ("lorafleet-trainer-dp0", ({"CPU": 1.0},)),
        ("lorafleet-engine0", ({"CPU": 1.0},)),
    ]
    assert plan_placement(cfg).summary().startswith("CPU plan: 1 engine(s)")


def test_placement_group_specs_for_gpu_plan_pin_nodes():
    cluster = ClusterShape(node_gpus=(8, 8), node_addresses=("10.0.0.1", "10.0.0.2"))
    plan = plan_placement(gpu_plan(4, 2, 2, 4), cluster)
    specs = placement_group_specs(plan, name_prefix="job1")
    assert [s.name for s in specs] == [f"job1-trainer-dp{d}" for d in range(4)] + [f"job1-engine{i}" for i in range(4)]
    assert all(s.strategy == "STRICT_PACK" for s in specs)
    assert specs[0].bundles == ({"CPU": 1.0, "GPU": 1.0, "node:10.0.0.1": 0.001},) * 2
    assert specs[-1].bundles == ({"CPU": 1.0, "GPU": 2.0, "node:10.0.0.2": 0.001},)
    assert sum(b["GPU"] for s in specs for b in s.bundles) == 16


@pytest.mark.parametrize(
    "section,allowed",
    [
        ({"accelerator": "tpu"}, "'cpu' or 'gpu'"),
        ({"engines": {"count": 0}}, "greater than or equal to 1"),
        ({"trainer": {"tensor_parallel": 0}}, "greater than or equal to 1"),
        ({"trainer": {"pipeline_parallel": 2}}, "Extra inputs are not permitted"),
    ],
)
def test_bad_placement_section_names_what_is_allowed(section, allowed):
    with pytest.raises(ValidationError, match=allowed):
        PlacementConfig.model_validate(section)
