"""The placement planner on realistic cluster shapes (1x8, 2x8, 4x8 GPUs; CPU clusters of several nodes),
refusals included, and the node choice of the module doc (engines off the trainer's nodes first)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from pydantic import ValidationError

from service.config.placement import PlacementConfig

from service.errors import PlacementError

from service.fleet.placement import ClusterShape, PlacementPlan, placement_group_specs, plan_placement

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
    (2, 8, 3, 2, 2, 2, [4, 6]),  # the trainer on node 0, the engines on the node it leaves free
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


def test_placement_group_specs_for_gpu_plan_pin_nodes_by_id():
    ids = ("a" * 56, "b" * 56)
    cluster = ClusterShape(node_gpus=(8, 8), node_ids=ids, node_addresses=("10.0.0.1", "10.0.0.2"))
    plan = plan_placement(gpu_plan(4, 2, 2, 4), cluster)
    specs = placement_group_specs(plan, name_prefix="job1")
    assert [s.name for s in specs] == [f"job1-trainer-dp{d}" for d in range(4)] + [f"job1-engine{i}" for i in range(4)]
    assert all(s.strategy == "STRICT_PACK" for s in specs)
    assert specs[0].bundles == ({"CPU": 1.0, "GPU": 1.0},) * 2 and specs[0].node_id == ids[0]
    assert specs[0].label_selectors() == [{"ray.io/node-id": ids[0]}] * 2
    assert specs[-1].bundles == ({"CPU": 1.0, "GPU": 2.0},) and specs[-1].label_selectors() == [{"ray.io/node-id": ids[1]}]
    assert sum(b["GPU"] for s in specs for b in s.bundles) == 16
    # a plan made without node ids pins nothing: Ray chooses (STRICT_PACK still keeps a group on one node)
    assert all(s.label_selectors() is None for s in placement_group_specs(plan_placement(gpu_plan(4, 2, 2, 4), ClusterShape.uniform(2, 8))))


def test_engines_spread_over_several_nodes_when_one_cannot_hold_them():
    # 2 x 8: trainer TP 4 on node 0; 12 one-GPU engines: 8 on the trainer-free node 1, the other 4 beside the trainer
    plan = plan_placement(gpu_plan(12, 1, 4, 1), ClusterShape.uniform(2, 8))
    check_invariants(plan)
    assert {r.node for r in plan.trainer} == {0}
    assert Counter(e.node for e in plan.engines) == {1: 8, 0: 4}


def test_a_gpu_plan_is_refused_when_its_cpus_do_not_fit():
    cluster = ClusterShape(node_gpus=(8,), node_cpus=(4.0,))
    cfg = PlacementConfig.model_validate({"accelerator": "gpu", "engines": {"count": 2, "cpus": 2},
                                          "trainer": {"data_parallel": 2, "cpus_per_rank": 2}})
    with pytest.raises(PlacementError, match=r"engines need 2 x 2 = 4 CPUs, trainer needs TP 1 x DP 2 x 2 = 4 CPUs, "
                                             r"total 8 > cluster 1 node x 4 CPUs = 4"):
        plan_placement(cfg, cluster)


# --- CPU plans over nodes (the loopback test cluster's shape: a head with no CPUs, worker nodes) --------------


def cpu_plan(engines: int = 1, trainer_dp: int = 1, engine_cpus: float = 1.0, rank_cpus: float = 1.0, trainer_tp: int = 1) -> PlacementConfig:
    return PlacementConfig.model_validate({"accelerator": "cpu", "engines": {"count": engines, "cpus": engine_cpus},
                                           "trainer": {"tensor_parallel": trainer_tp, "data_parallel": trainer_dp,
                                                       "cpus_per_rank": rank_cpus}})


def cpu_cluster(*cpus: float) -> ClusterShape:
    return ClusterShape(node_gpus=(0,) * len(cpus), node_cpus=tuple(float(c) for c in cpus),
                        node_ids=tuple(str(i) * 56 for i in range(len(cpus))), node_addresses=("127.0.0.1",) * len(cpus))


def test_cpu_plan_puts_trainer_and_engine_on_different_nodes_when_it_can():
    plan = plan_placement(PlacementConfig(), cpu_cluster(0, 2, 2))  # head without CPUs, two worker nodes
    assert [r.node for r in plan.trainer] == [1] and [e.node for e in plan.engines] == [2]
    specs = placement_group_specs(plan)
    assert [(s.name, s.node_id) for s in specs] == [("lorafleet-trainer-dp0", "1" * 56), ("lorafleet-engine0", "2" * 56)]
    lines = plan.lines()
    assert lines[0] == "CPU plan: 1 engine(s), trainer TP 1 x DP 1; no GPUs; 2 CPUs of cluster 3 nodes with [0, 2, 2] CPUs = 4"
    assert lines[1:] == ["trainer dp0 (ranks 0-0): node 1 (127.0.0.1, 111111111111)", "engine 0: node 2 (127.0.0.1, 222222222222)"]


def test_cpu_plan_on_one_node_shares_it():
    plan = plan_placement(PlacementConfig(), cpu_cluster(2))
    assert [r.node for r in plan.trainer] == [0] and [e.node for e in plan.engines] == [0]


def test_cpu_engines_spread_over_the_trainer_free_nodes_then_share_the_trainers():
    plan = plan_placement(cpu_plan(engines=5), cpu_cluster(4, 2, 2))
    assert [r.node for r in plan.trainer] == [0]
    # nodes 1 and 2 first (no trainer), most room first, then the trainer's node 0 (3 CPUs left)
    assert [e.node for e in plan.engines] == [1, 2, 1, 2, 0]


def test_cpu_trainer_tp_group_stays_on_one_node():
    plan = plan_placement(cpu_plan(trainer_tp=2, trainer_dp=2), cpu_cluster(2, 2, 1))
    assert [(r.rank, r.node) for r in plan.trainer] == [(0, 0), (1, 0), (2, 1), (3, 1)] and plan.engines[0].node == 2


@pytest.mark.parametrize("cfg,cpus,message", [
    (cpu_plan(engines=4), (2, 2), "engines need 4 x 1 = 4 CPUs, trainer needs TP 1 x DP 1 x 1 = 1 CPUs, total 5 > "
                                  "cluster 2 nodes x 2 CPUs = 4"),
    (cpu_plan(rank_cpus=2, trainer_tp=2), (3, 3), "a trainer TP group needs 4 CPUs on one node, more than the largest node's 3"),
    (cpu_plan(engine_cpus=1.5, engines=2), (2, 2), "but trainer dp0 (1 CPUs on one node) found no node with room: CPUs free per node [0.5, 0.5]"),
])
def test_cpu_plans_that_do_not_fit_are_refused_with_the_arithmetic(cfg, cpus, message):
    with pytest.raises(PlacementError, match=re.escape(message)):
        plan_placement(cfg, cpu_cluster(*cpus))


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


def test_loopback_engines_on_another_host_are_refused_at_start():
    from service.fleet.cluster_checks import check_engines_reachable

    cluster = ClusterShape(node_gpus=(0, 0), node_cpus=(2.0, 2.0), node_ids=("a" * 56, "b" * 56),
                           node_addresses=("10.0.0.4", "10.0.0.5"))
    plan = plan_placement(cpu_plan(), cluster)  # trainer on node 0, the engine on node 1 (another host)
    with pytest.raises(PlacementError, match=r"engine 0 on node 1 \(10.0.0.5, bbbbbbbbbbbb\): engines.host is '127.0.0.1', "
                                             r"which the rollout worker on the coordinator's host \(10.0.0.4\) cannot reach"):
        check_engines_reachable(plan, "127.0.0.1", "10.0.0.4")
    check_engines_reachable(plan, "node", "10.0.0.4")  # each engine binds its node's address: reachable
    same_host = ClusterShape(node_gpus=(0, 0), node_cpus=(2.0, 2.0), node_addresses=("127.0.0.1", "127.0.0.1"))
    check_engines_reachable(plan_placement(cpu_plan(), same_host), "127.0.0.1", "127.0.0.1")  # two raylets, one host
