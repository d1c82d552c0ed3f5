"""Placement: which devices the rollout engines and the trainer get.

Three parts, one role each:
  * `PlacementConfig`: the job file's `placement:` section (pydantic). How many
    SGLang engines and their tensor parallelism (TP); the trainer's TP and data
    parallelism (DP); whether the plan runs on GPUs or on CPU (the embedded tiny
    default).
  * `plan_placement(config, cluster)`: checks the plan against a cluster shape
    (nodes x GPUs per node) and returns the assignment: the node and node-local
    GPU slots of every engine and of every trainer rank. A plan that does not fit
    is refused with `PlacementError` BEFORE anything starts, and the message
    shows the arithmetic.
  * `placement_group_specs(plan)` / `reserve_placement_groups(plan)`: the plan as
    Ray placement groups (bundles + strategy), and their reservation, for the
    controller.

Invariants the planner guarantees (and tests check):
  * a TP group (one engine, or one trainer TP group) never straddles nodes: its
    GPUs all sit on one node, because NVLink-speed collectives are what TP needs;
  * no GPU slot is given twice; engines and trainer never share a GPU;
  * trainer ranks follow Megatron's rank order: global rank = dp_rank * TP + tp_rank
    (TP varies fastest, so ranks of one TP group are consecutive).

Embedding: the job-file model embeds `placement: PlacementConfig = PlacementConfig()`.
This module imports only pydantic (and the strict base of trainer/config.py) at
module level; Ray is imported inside the functions that need it, so the planner runs anywhere.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.config import StrictModel

_MAX_PARALLEL = 1024  # sanity bound: a typo such as 80 instead of 8 still plans; 10**6 does not


class EnginePlacement(StrictModel):
    """SGLang rollout engines: `count` servers, each spanning `tensor_parallel` GPUs of one node."""

    count: int = Field(1, ge=1, le=_MAX_PARALLEL, description="number of SGLang engines (servers)")
    tensor_parallel: int = Field(
        1, ge=1, le=_MAX_PARALLEL, description="GPUs per engine (SGLang --tp); all on one node"
    )
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for each engine (Ray bundle)")


class TrainerPlacement(StrictModel):
    """Megatron trainer: tensor_parallel x data_parallel ranks, one GPU each."""

    tensor_parallel: int = Field(
        1, ge=1, le=_MAX_PARALLEL, description="Megatron tensor parallel size; a TP group sits on one node"
    )
    data_parallel: int = Field(1, ge=1, le=_MAX_PARALLEL, description="Megatron data parallel size")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs reserved for each trainer rank (Ray bundle)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel


class PlacementConfig(StrictModel):
    """The job file's `placement:` section. The default is the embedded tiny CPU plan."""

    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu",
        description="'gpu': every engine TP rank and every trainer rank gets one GPU; "
        "'cpu': no GPU at all (the embedded tiny default)",
    )
    engines: EnginePlacement = Field(default_factory=EnginePlacement)
    trainer: TrainerPlacement = Field(default_factory=TrainerPlacement)

    @property
    def engine_gpus(self) -> int:
        return self.engines.count * self.engines.tensor_parallel if self.accelerator == "gpu" else 0

    @property
    def trainer_gpus(self) -> int:
        return self.trainer.world_size if self.accelerator == "gpu" else 0

    @property
    def total_gpus(self) -> int:
        return self.engine_gpus + self.trainer_gpus


class ClusterShape(StrictModel):
    """GPUs per node of the cluster a plan must fit, in node order.

    `node_addresses` (optional, same length) are the Ray node IPs; when present,
    the placement groups are pinned to the planned nodes.
    """

    node_gpus: tuple[int, ...] = Field(..., min_length=1)
    node_addresses: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> ClusterShape:
        if any(g < 0 for g in self.node_gpus):
            raise ValueError(f"node_gpus must be >= 0 per node, got {list(self.node_gpus)}")
        if self.node_addresses is not None and len(self.node_addresses) != len(self.node_gpus):
            raise ValueError(
                f"node_addresses has {len(self.node_addresses)} entries but node_gpus has {len(self.node_gpus)}"
            )
        return self

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int) -> ClusterShape:
        if nodes < 1 or gpus_per_node < 0:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus_per_node >= 0, got {nodes} x {gpus_per_node}")
        return cls(node_gpus=(gpus_per_node,) * nodes)

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus)

    def describe(self) -> str:
        """'1 node x 8 GPUs = 8' or '2 nodes with [8, 4] GPUs = 12'."""
        n = len(self.node_gpus)
        nodes = f"{n} node{'s' if n != 1 else ''}"
        if len(set(self.node_gpus)) == 1:
            return f"{nodes} x {self.node_gpus[0]} GPUs = {self.total_gpus}"
        return f"{nodes} with {list(self.node_gpus)} GPUs = {self.total_gpus}"


class EngineAssignment(BaseModel):
    model_config = ConfigDict(frozen=True)

    engine: int
    node: int
    gpus: tuple[int, ...]  # node-local GPU slots; empty on CPU


class TrainerRankAssignment(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int  # global rank = dp_rank * tensor_parallel + tp_rank
    tp_rank: int
    dp_rank: int
    node: int
    gpu: int | None  # node-local GPU slot; None on CPU


class PlacementPlan(BaseModel):
    """A plan that fits: where each engine and each trainer rank runs."""

    model_config = ConfigDict(frozen=True)

    config: PlacementConfig
    cluster: ClusterShape | None  # None for a CPU plan: it needs no GPU shape
    engines: tuple[EngineAssignment, ...]
    trainer: tuple[TrainerRankAssignment, ...]

    def summary(self) -> str:
        c = self.config
        if c.accelerator == "cpu":
            return (
                f"CPU plan: {c.engines.count} engine(s), trainer TP {c.trainer.tensor_parallel} x "
                f"DP {c.trainer.data_parallel}; no GPUs"
            )
        assert self.cluster is not None
        used = c.total_gpus
        return (
            f"engines {c.engines.count} x TP {c.engines.tensor_parallel} = {c.engine_gpus} GPUs, "
            f"trainer TP {c.trainer.tensor_parallel} x DP {c.trainer.data_parallel} = {c.trainer_gpus} GPUs; "
            f"{used} of cluster {self.cluster.describe()}"
        )


class PlacementError(ValueError):
    """A plan that cannot run on the cluster; the message shows the arithmetic."""


def _demand(config: PlacementConfig) -> str:
    e, t = config.engines, config.trainer
    return (
        f"engines need {e.count} x TP {e.tensor_parallel} = {config.engine_gpus} GPUs, "
        f"trainer needs TP {t.tensor_parallel} x DP {t.data_parallel} = {config.trainer_gpus} GPUs"
    )


def plan_placement(config: PlacementConfig, cluster: ClusterShape | None = None) -> PlacementPlan:
    """Assign every engine and trainer rank to a node and GPU slots, or refuse.

    CPU plans always fit (no GPU arithmetic; `cluster` may be None). GPU plans
    are refused with the arithmetic when (1) the total exceeds the cluster, (2)
    a TP group is wider than the largest node, or (3) the groups cannot be packed
    without a TP group straddling nodes.
    """
    if config.accelerator == "cpu":
        engines = tuple(EngineAssignment(engine=i, node=0, gpus=()) for i in range(config.engines.count))
        tp = config.trainer.tensor_parallel
        trainer = tuple(
            TrainerRankAssignment(rank=r, tp_rank=r % tp, dp_rank=r // tp, node=0, gpu=None)
            for r in range(config.trainer.world_size)
        )
        return PlacementPlan(config=config, cluster=cluster, engines=engines, trainer=trainer)

    if cluster is None:
        raise PlacementError(f"a GPU plan needs the cluster shape to check it against ({_demand(config)})")
    total = config.total_gpus
    if total > cluster.total_gpus:
        raise PlacementError(f"{_demand(config)}, total {total} > cluster {cluster.describe()}")
    widest = max(cluster.node_gpus)
    for what, tp in (("engine", config.engines.tensor_parallel), ("trainer", config.trainer.tensor_parallel)):
        if tp > widest:
            raise PlacementError(
                f"{what} TP {tp} > {widest} GPUs on the largest node: a TP group must not straddle nodes "
                f"(cluster {cluster.describe()})"
            )

    # Groups to pack: each must land whole on one node. First-fit, widest group
    # first, trainer before engines among equals (so trainer replicas sit on the
    # lowest nodes together and DP all-reduce stays as local as possible). When
    # every TP size divides the node size (powers of two on 8-GPU nodes),
    # first-fit decreasing never fragments, so a refusal there is a real one.
    groups: list[tuple[str, int, int]] = [("trainer", dp, config.trainer.tensor_parallel) for dp in range(config.trainer.data_parallel)]
    groups += [("engine", i, config.engines.tensor_parallel) for i in range(config.engines.count)]
    groups.sort(key=lambda g: (-g[2], g[0] != "trainer", g[1]))
    free = list(cluster.node_gpus)
    placed: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
    for role, index, width in groups:
        node = next((n for n, f in enumerate(free) if f >= width), None)
        if node is None:
            raise PlacementError(
                f"{_demand(config)}, total {total} <= cluster {cluster.describe()}, but the TP groups "
                f"(trainer {config.trainer.data_parallel} x {config.trainer.tensor_parallel} GPUs, engines "
                f"{config.engines.count} x {config.engines.tensor_parallel} GPUs) could not be packed without one "
                f"straddling nodes; GPUs free per node when {role} {index} ({width} GPUs) found no room: {free}"
            )
        first = cluster.node_gpus[node] - free[node]
        placed[(role, index)] = (node, tuple(range(first, first + width)))
        free[node] -= width

    engines = tuple(
        EngineAssignment(engine=i, node=placed[("engine", i)][0], gpus=placed[("engine", i)][1])
        for i in range(config.engines.count)
    )
    tp = config.trainer.tensor_parallel
    trainer_ranks = []
    for r in range(config.trainer.world_size):
        dp_rank, tp_rank = divmod(r, tp)
        node, gpus = placed[("trainer", dp_rank)]
        trainer_ranks.append(TrainerRankAssignment(rank=r, tp_rank=tp_rank, dp_rank=dp_rank, node=node, gpu=gpus[tp_rank]))
    return PlacementPlan(config=config, cluster=cluster, engines=engines, trainer=tuple(trainer_ranks))


# ---------------------------------------------------------------- Ray realization


class PlacementGroupSpec(BaseModel):
    """One Ray placement group: `ray.util.placement_group(bundles, strategy, name)`.

    One group per TP group (an engine, or one trainer DP replica), STRICT_PACK so
    Ray keeps its bundles on one node: the no-straddle invariant holds even when
    Ray, not the plan, picks the node.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    role: Literal["engine", "trainer"]
    index: int  # engine index, or trainer dp_rank
    bundles: tuple[dict[str, float], ...]
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"


# A node's own resource "node:<ip>" has capacity 1.0; asking a sliver of it in a
# bundle pins the bundle to that node without using anything real.
_NODE_PIN = 0.001


def placement_group_specs(plan: PlacementPlan, name_prefix: str = "lorafleet") -> list[PlacementGroupSpec]:
    """The plan as Ray placement groups, trainer replicas first, then engines.

    Engine i: one bundle {GPU: TP, CPU: cpus} (one SGLang server process owns
    all its GPUs; a bundle never spans nodes). Trainer replica d: TP bundles
    {GPU: 1, CPU: cpus_per_rank}, bundle index = tp_rank. On CPU the GPU key is
    absent. If the cluster shape carries node addresses, every bundle is pinned
    to its planned node.
    """
    cfg = plan.config
    gpu = cfg.accelerator == "gpu"
    addresses = plan.cluster.node_addresses if (gpu and plan.cluster is not None) else None

    def bundle(gpus: int, cpus: float, node: int) -> dict[str, float]:
        b: dict[str, float] = {"CPU": float(cpus)}
        if gpu:
            b["GPU"] = float(gpus)
        if addresses is not None:
            b[f"node:{addresses[node]}"] = _NODE_PIN
        return b

    specs: list[PlacementGroupSpec] = []
    for d in range(cfg.trainer.data_parallel):
        ranks = [r for r in plan.trainer if r.dp_rank == d]
        specs.append(
            PlacementGroupSpec(
                name=f"{name_prefix}-trainer-dp{d}",
                role="trainer",
                index=d,
                bundles=tuple(bundle(1, cfg.trainer.cpus_per_rank, r.node) for r in sorted(ranks, key=lambda r: r.tp_rank)),
            )
        )
    for e in plan.engines:
        specs.append(
            PlacementGroupSpec(
                name=f"{name_prefix}-engine{e.engine}",
                role="engine",
                index=e.engine,
                bundles=(bundle(cfg.engines.tensor_parallel, cfg.engines.cpus, e.node),),
            )
        )
    return specs


def cluster_shape_from_ray() -> ClusterShape:
    """The live Ray cluster's shape: alive nodes in a stable order (by address), their GPUs."""
    import ray

    nodes = sorted(
        (n for n in ray.nodes() if n.get("Alive")),
        key=lambda n: n["NodeManagerAddress"],
    )
    if not nodes:
        raise PlacementError("the Ray cluster reports no alive node")
    return ClusterShape(
        node_gpus=tuple(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes),
        node_addresses=tuple(n["NodeManagerAddress"] for n in nodes),
    )


def reserve_placement_groups(plan: PlacementPlan, timeout_s: float = 60.0, name_prefix: str = "lorafleet") -> list[Any]:
    """Create every placement group of the plan and wait until all are ready.

    All or nothing: if any group is not ready within `timeout_s`, every group
    created here is removed again and PlacementError names the groups still
    pending. Returns the `ray.util.placement_group.PlacementGroup` objects in
    `placement_group_specs` order; schedule an actor into one with
    `PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)`.
    """
    import ray
    from ray.util.placement_group import placement_group

    specs = placement_group_specs(plan, name_prefix=name_prefix)
    groups = [placement_group(list(s.bundles), strategy=s.strategy, name=s.name) for s in specs]
    ready_refs = [g.ready() for g in groups]
    _, pending = ray.wait(ready_refs, num_returns=len(groups), timeout=timeout_s)
    if pending:
        still = set(pending)
        waiting = [s for s, ref in zip(specs, ready_refs) if ref in still]
        release_placement_groups(groups)
        raise PlacementError(
            f"Ray could not reserve {len(pending)} of {len(groups)} placement groups within {timeout_s:.0f} s "
            f"({plan.summary()}); pending: "
            + "; ".join(f"{s.name} bundles {list(s.bundles)}" for s in waiting)
            + f"; cluster resources now: {ray.available_resources()}"
        )
    return groups


def release_placement_groups(groups: list[Any], timeout_s: float = 10.0) -> None:
    """Remove the groups and wait (bounded) until Ray reports them REMOVED, so their
    resources are free again when this returns (removal itself is asynchronous)."""
    import time

    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    for g in groups:
        remove_placement_group(g)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(placement_group_table(g).get("state") == "REMOVED" for g in groups):
            return
        time.sleep(0.05)
    still = [placement_group_table(g).get("name") for g in groups if placement_group_table(g).get("state") != "REMOVED"]
    raise PlacementError(f"Ray did not release placement groups {still} within {timeout_s:.0f} s; cluster: {ray.available_resources()}")

