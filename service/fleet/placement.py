"""Placement: which devices the rollout engines and the trainer get.

Three parts, one role each:
  * `PlacementConfig` (service/config/placement.py): the job file's `placement:` section.
    How many SGLang engines and their tensor parallelism (TP); the trainer's TP and data
    parallelism (DP); whether the plan runs on GPUs or on CPU (the embedded tiny
    default).
  * `plan_placement(config, cluster)`: checks the plan against a cluster shape
    (its nodes: GPUs and CPUs of each, and their Ray node ids) and returns the
    assignment: the node and node-local GPU slots of every engine and of every
    trainer rank, on GPU and on CPU alike. A plan that does not fit is refused
    with `PlacementError` BEFORE anything starts, and the message shows the
    arithmetic.
  * `placement_group_specs(plan)` / `reserve_placement_groups(plan)`: the plan as
    Ray placement groups (bundles + strategy + the planned node's id), and their
    reservation, for the coordinator.

Which node each group gets (the planner's choice, the same on GPU and CPU): groups
are packed widest first (GPUs, then CPUs), trainer before engines among equals;
a trainer TP group takes the first node with room (so DP replicas sit together and
the all-reduce stays local); an engine takes, among the nodes with room, one that
holds no trainer rank, then the one with the most room left, then the lowest. So
engines spread over the nodes the trainer leaves free (rollout traffic does not
share the trainer's node, and losing an engine node does not take the trainer),
and fall back to the trainer's nodes when nothing else has room.

Invariants the planner guarantees (and tests check):
  * a TP group (one engine, or one trainer TP group) never straddles nodes: its
    GPUs all sit on one node, because NVLink-speed collectives are what TP needs;
  * no GPU slot is given twice; engines and trainer never share a GPU; a node's
    CPUs (when the shape knows them) are never given out beyond its count;
  * a group is pinned to its node by the node's Ray id (bundle label selector
    `ray.io/node-id`), never by IP: two raylets on one host are two nodes;
  * trainer ranks follow Megatron's rank order: global rank = dp_rank * TP + tp_rank
    (TP varies fastest, so ranks of one TP group are consecutive).

This module imports only pydantic (and the strict base of trainer/config.py) at
module level; Ray is imported inside the functions that need it, so the planner runs anywhere.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.config.placement import PlacementConfig
from service.errors import NoPlacement, NoRoomYet, PlacementError  # noqa: F401 - raised here; their home is service/errors.py
from trainer.strict_model import StrictModel

class ClusterShape(StrictModel):
    """The nodes a plan must fit, in node order: GPUs of each, and optionally their CPUs
    (None: not checked), Ray node ids (the groups are pinned to them) and IP addresses (shown).

    Node i of a plan is entry i of every tuple."""

    node_gpus: tuple[int, ...] = Field(..., min_length=1)
    node_cpus: tuple[float, ...] | None = None
    node_ids: tuple[str, ...] | None = None
    node_addresses: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _check(self) -> ClusterShape:
        if any(g < 0 for g in self.node_gpus):
            raise ValueError(f"node_gpus must be >= 0 per node, got {list(self.node_gpus)}")
        if self.node_cpus is not None and any(c < 0 for c in self.node_cpus):
            raise ValueError(f"node_cpus must be >= 0 per node, got {list(self.node_cpus)}")
        for name, value in (("node_cpus", self.node_cpus), ("node_ids", self.node_ids), ("node_addresses", self.node_addresses)):
            if value is not None and len(value) != len(self.node_gpus):
                raise ValueError(f"{name} has {len(value)} entries but node_gpus has {len(self.node_gpus)}")
        return self

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int, cpus_per_node: float | None = None) -> ClusterShape:
        if nodes < 1 or gpus_per_node < 0:
            raise ValueError(f"a cluster needs nodes >= 1 and gpus_per_node >= 0, got {nodes} x {gpus_per_node}")
        cpus = None if cpus_per_node is None else (float(cpus_per_node),) * nodes
        return cls(node_gpus=(gpus_per_node,) * nodes, node_cpus=cpus)

    @property
    def nodes(self) -> int:
        return len(self.node_gpus)

    @property
    def total_gpus(self) -> int:
        return sum(self.node_gpus)

    def describe(self, what: Literal["GPUs", "CPUs"] = "GPUs") -> str:
        """'1 node x 8 GPUs = 8' or '2 nodes with [8, 4] GPUs = 12' (CPUs alike)."""
        n = len(self.node_gpus)
        nodes = f"{n} node{'s' if n != 1 else ''}"
        per = self.node_gpus if what == "GPUs" else tuple(_num(c) for c in (self.node_cpus or ()))
        total = _num(sum(per))
        if len(set(per)) == 1:
            return f"{nodes} x {per[0]} {what} = {total}"
        return f"{nodes} with {list(per)} {what} = {total}"

    def node_label(self, node: int) -> str:
        """'node 1 (10.0.0.5, 5f3a9c01e2d4)': its index, address and the start of its Ray id, as known."""
        known = [x for x in ((self.node_addresses or (None,) * self.nodes)[node], (self.node_ids or (None,) * self.nodes)[node]) if x]
        return f"node {node}" + (f" ({', '.join(k if len(k) < 20 else k[:12] for k in known)})" if known else "")


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


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
            text = f"CPU plan: {c.engines.count} engine(s), trainer TP {c.trainer.tensor_parallel} x DP {c.trainer.data_parallel}; no GPUs"
            if self.cluster is not None and self.cluster.node_cpus is not None:
                text += f"; {_num(_cpu_demand(c)[0])} CPUs of cluster {self.cluster.describe('CPUs')}"
            return text
        assert self.cluster is not None
        used = c.total_gpus
        return (
            f"engines {c.engines.count} x TP {c.engines.tensor_parallel} = {c.engine_gpus} GPUs, "
            f"trainer TP {c.trainer.tensor_parallel} x DP {c.trainer.data_parallel} = {c.trainer_gpus} GPUs; "
            f"{used} of cluster {self.cluster.describe()}"
        )

    def node_id(self, node: int) -> str | None:
        """The Ray id of the plan's node `node` (None: the shape has no ids, e.g. a plan made offline)."""
        ids = self.cluster.node_ids if self.cluster is not None else None
        return ids[node] if ids is not None else None

    def lines(self) -> list[str]:
        """The plan, one line per group: what runs where (printed at start)."""
        def where(node: int) -> str:
            return self.cluster.node_label(node) if self.cluster is not None else f"node {node}"

        tp = self.config.trainer.tensor_parallel
        out = [self.summary()]
        for d in range(self.config.trainer.data_parallel):
            ranks = [r for r in self.trainer if r.dp_rank == d]
            gpus = f", GPUs {[r.gpu for r in ranks]}" if ranks[0].gpu is not None else ""
            out.append(f"trainer dp{d} (ranks {d * tp}-{d * tp + tp - 1}): {where(ranks[0].node)}{gpus}")
        for e in self.engines:
            out.append(f"engine {e.engine}: {where(e.node)}" + (f", GPUs {list(e.gpus)}" if e.gpus else ""))
        return out


def _demand(config: PlacementConfig) -> str:
    e, t = config.engines, config.trainer
    return (
        f"engines need {e.count} x TP {e.tensor_parallel} = {config.engine_gpus} GPUs, "
        f"trainer needs TP {t.tensor_parallel} x DP {t.data_parallel} = {config.trainer_gpus} GPUs"
    )


def _cpu_demand(config: PlacementConfig) -> tuple[float, str]:
    e, t = config.engines, config.trainer
    engines, trainer = e.count * e.cpus, t.world_size * t.cpus_per_rank
    return engines + trainer, (f"engines need {e.count} x {_num(e.cpus)} = {_num(engines)} CPUs, trainer needs TP "
                               f"{t.tensor_parallel} x DP {t.data_parallel} x {_num(t.cpus_per_rank)} = {_num(trainer)} CPUs")


_EPS = 1e-9  # CPU amounts are floats (fractions of a CPU are allowed): compare with a tolerance


def plan_placement(config: PlacementConfig, cluster: ClusterShape | None = None) -> PlacementPlan:
    """Assign every engine and trainer rank to a node (and GPU slots on GPU), or refuse.

    GPU plans are refused with the arithmetic when (1) the total exceeds the cluster, (2)
    a TP group is wider than the largest node, or (3) the groups cannot be packed
    without a TP group straddling nodes; where the shape knows each node's CPUs, the
    CPUs the bundles reserve are checked the same way (CPU plans: only they). A CPU plan
    without a cluster shape puts everything on node 0 unchecked (a plan made offline).
    Node choice: the module docstring.
    """
    gpu = config.accelerator == "gpu"
    tp = config.trainer.tensor_parallel
    if cluster is None:
        if gpu:
            raise PlacementError(f"a GPU plan needs the cluster shape to check it against ({_demand(config)})")
        engines = tuple(EngineAssignment(engine=i, node=0, gpus=()) for i in range(config.engines.count))
        trainer = tuple(TrainerRankAssignment(rank=r, tp_rank=r % tp, dp_rank=r // tp, node=0, gpu=None)
                        for r in range(config.trainer.world_size))
        return PlacementPlan(config=config, cluster=None, engines=engines, trainer=trainer)

    if gpu:
        total = config.total_gpus
        if total > cluster.total_gpus:
            raise PlacementError(f"{_demand(config)}, total {total} > cluster {cluster.describe()}")
        widest = max(cluster.node_gpus)
        for what, width in (("engine", config.engines.tensor_parallel), ("trainer", tp)):
            if width > widest:
                raise PlacementError(
                    f"{what} TP {width} > {widest} GPUs on the largest node: a TP group must not straddle nodes "
                    f"(cluster {cluster.describe()})"
                )
    cpus = cluster.node_cpus
    if cpus is not None:
        need, said = _cpu_demand(config)
        if need > sum(cpus) + _EPS:
            raise PlacementError(f"{said}, total {_num(need)} > cluster {cluster.describe('CPUs')}")
        for what, amount in (("engine", config.engines.cpus), ("trainer TP group", tp * config.trainer.cpus_per_rank)):
            if amount > max(cpus) + _EPS:
                raise PlacementError(f"a {what} needs {_num(amount)} CPUs on one node, more than the largest node's "
                                     f"{_num(max(cpus))} (cluster {cluster.describe('CPUs')})")

    # Groups to pack, each whole on one node: (role, index, GPUs, CPUs). Widest first, trainer before engines
    # among equals. When every TP size divides the node size (powers of two on 8-GPU nodes), packing widest
    # first never fragments, whichever fitting node each group takes, so a refusal there is a real one.
    e_gpus = config.engines.tensor_parallel if gpu else 0
    t_gpus = tp if gpu else 0
    groups = [("trainer", d, t_gpus, tp * config.trainer.cpus_per_rank) for d in range(config.trainer.data_parallel)]
    groups += [("engine", i, e_gpus, config.engines.cpus) for i in range(config.engines.count)]
    groups.sort(key=lambda g: (-g[2], -g[3], g[0] != "trainer", g[1]))
    free_gpus = list(cluster.node_gpus)
    free_cpus = list(cpus) if cpus is not None else None
    has_trainer = [False] * cluster.nodes
    placed: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
    for role, index, width, ncpu in groups:
        fits = [n for n in range(cluster.nodes)
                if free_gpus[n] >= width and (free_cpus is None or free_cpus[n] + _EPS >= ncpu)]
        if not fits:
            raise PlacementError(_no_room(config, cluster, role, index, width, ncpu, free_gpus, free_cpus))
        room = free_gpus if gpu else (free_cpus if free_cpus is not None else [0.0] * cluster.nodes)
        node = pick_node(role, fits, has_trainer, room)
        first = cluster.node_gpus[node] - free_gpus[node]
        placed[(role, index)] = (node, tuple(range(first, first + width)))
        free_gpus[node] -= width
        if free_cpus is not None:
            free_cpus[node] -= ncpu
        if role == "trainer":
            has_trainer[node] = True

    engines = tuple(
        EngineAssignment(engine=i, node=placed[("engine", i)][0], gpus=placed[("engine", i)][1])
        for i in range(config.engines.count)
    )
    trainer_ranks = []
    for r in range(config.trainer.world_size):
        dp_rank, tp_rank = divmod(r, tp)
        node, slots = placed[("trainer", dp_rank)]
        trainer_ranks.append(TrainerRankAssignment(rank=r, tp_rank=tp_rank, dp_rank=dp_rank, node=node,
                                                   gpu=slots[tp_rank] if gpu else None))
    return PlacementPlan(config=config, cluster=cluster, engines=engines, trainer=tuple(trainer_ranks))


def pick_node(role: str, fits: list[int], has_trainer: list[bool], room: list[float]) -> int:
    """The planner's choice among the nodes that have room (`fits`, ascending): a trainer TP group takes the
    first; an engine a node without trainer ranks, then the one with the most `room` (free GPUs on a GPU plan,
    free CPUs on a CPU plan), then the lowest. The one home of this policy: the planner and the re-placement
    of a lost node's groups (service/fleet/node_faults.py) both use it."""
    if role == "trainer":
        return fits[0]
    return min(fits, key=lambda n: (has_trainer[n], -room[n], n))


def _no_room(config: PlacementConfig, cluster: ClusterShape, role: str, index: int, width: int, ncpu: float,
             free_gpus: list[int], free_cpus: list[float] | None) -> str:
    name = f"{role} {index}" if role == "engine" else f"trainer dp{index}"
    if config.accelerator == "gpu" and all(f < width for f in free_gpus):
        return (
            f"{_demand(config)}, total {config.total_gpus} <= cluster {cluster.describe()}, but the TP groups "
            f"(trainer {config.trainer.data_parallel} x {config.trainer.tensor_parallel} GPUs, engines "
            f"{config.engines.count} x {config.engines.tensor_parallel} GPUs) could not be packed without one "
            f"straddling nodes; GPUs free per node when {role} {index} ({width} GPUs) found no room: {free_gpus}"
        )
    assert free_cpus is not None
    return (f"{_cpu_demand(config)[1]}, but {name} ({_num(ncpu)} CPUs on one node) found no node with room: CPUs "
            f"free per node {[_num(round(c, 6)) for c in free_cpus]} (cluster {cluster.describe('CPUs')})")


# ---------------------------------------------------------------- Ray realization


class PlacementGroupSpec(BaseModel):
    """One Ray placement group: `ray.util.placement_group(bundles, strategy, name, bundle_label_selector)`.

    One group per TP group (an engine, or one trainer DP replica), STRICT_PACK so
    Ray keeps its bundles on one node: the no-straddle invariant holds even when
    Ray, not the plan, picks the node. With `node_id` every bundle carries the label
    selector ray.io/node-id = node_id: Ray places the group on that node or nowhere.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    role: Literal["engine", "trainer"]
    index: int  # engine index, or trainer dp_rank
    bundles: tuple[dict[str, float], ...]
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    node: int | None = None  # the plan's node index
    node_id: str | None = None  # its Ray node id (None: Ray chooses the node)

    def label_selectors(self) -> list[dict[str, str]] | None:
        from ray.util.placement_group import NODE_ID_LABEL_KEY  # "ray.io/node-id": every node carries it

        return [{NODE_ID_LABEL_KEY: self.node_id}] * len(self.bundles) if self.node_id is not None else None


def placement_group_specs(plan: PlacementPlan, name_prefix: str = "lorafleet") -> list[PlacementGroupSpec]:
    """The plan as Ray placement groups, trainer replicas first, then engines.

    Engine i: one bundle {GPU: TP, CPU: cpus} (one SGLang server process owns
    all its GPUs; a bundle never spans nodes). Trainer replica d: TP bundles
    {GPU: 1, CPU: cpus_per_rank}, bundle index = tp_rank. On CPU the GPU key is
    absent. If the cluster shape carries node ids, every group is pinned to its
    planned node (by id: PlacementGroupSpec).
    """
    cfg = plan.config
    gpu = cfg.accelerator == "gpu"

    def bundle(gpus: int, cpus: float) -> dict[str, float]:
        return {"CPU": float(cpus), "GPU": float(gpus)} if gpu else {"CPU": float(cpus)}

    specs: list[PlacementGroupSpec] = []
    for d in range(cfg.trainer.data_parallel):
        ranks = sorted((r for r in plan.trainer if r.dp_rank == d), key=lambda r: r.tp_rank)
        specs.append(
            PlacementGroupSpec(
                name=f"{name_prefix}-trainer-dp{d}", role="trainer", index=d,
                bundles=tuple(bundle(1, cfg.trainer.cpus_per_rank) for _ in ranks),
                node=ranks[0].node, node_id=plan.node_id(ranks[0].node),
            )
        )
    for e in plan.engines:
        specs.append(
            PlacementGroupSpec(
                name=f"{name_prefix}-engine{e.engine}", role="engine", index=e.engine,
                bundles=(bundle(cfg.engines.tensor_parallel, cfg.engines.cpus),),
                node=e.node, node_id=plan.node_id(e.node),
            )
        )
    return specs


HEAD_NODE_RESOURCE = "node:__internal_head__"  # the resource only Ray's head node carries


def cluster_shape_from_ray() -> ClusterShape:
    """The live Ray cluster's shape: its alive nodes in a stable order (the head first, then by address
    and node id), with their GPUs, CPUs, Ray node ids and addresses."""
    import ray

    nodes = sorted(
        (n for n in ray.nodes() if n.get("Alive")),
        key=lambda n: (HEAD_NODE_RESOURCE not in n.get("Resources", {}), n["NodeManagerAddress"], n["NodeID"]),
    )
    if not nodes:
        raise PlacementError("the Ray cluster reports no alive node")
    return ClusterShape(
        node_gpus=tuple(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes),
        node_cpus=tuple(float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes),
        node_ids=tuple(n["NodeID"] for n in nodes),
        node_addresses=tuple(n["NodeManagerAddress"] for n in nodes),
    )


def create_placement_group(spec: PlacementGroupSpec) -> Any:
    """Ask Ray for the group (asynchronous: `group.ready()` resolves once it is placed)."""
    from ray.util.placement_group import placement_group

    return placement_group(list(spec.bundles), strategy=spec.strategy, name=spec.name,
                           bundle_label_selector=spec.label_selectors())


def reserve_placement_groups(plan: PlacementPlan, timeout_s: float = 60.0, name_prefix: str = "lorafleet") -> list[Any]:
    """Create every placement group of the plan and wait until all are ready.

    All or nothing: if any group is not ready within `timeout_s`, every group
    created here is removed again and PlacementError names the groups still
    pending. Returns the `ray.util.placement_group.PlacementGroup` objects in
    `placement_group_specs` order; schedule an actor into one with
    `PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)`.
    """
    import ray

    specs = placement_group_specs(plan, name_prefix=name_prefix)
    groups = [create_placement_group(s) for s in specs]
    ready_refs = [g.ready() for g in groups]
    _, pending = ray.wait(ready_refs, num_returns=len(groups), timeout=timeout_s)
    if pending:
        still = set(pending)
        waiting = [s for s, ref in zip(specs, ready_refs) if ref in still]
        release_placement_groups(groups)
        raise PlacementError(
            f"Ray could not reserve {len(pending)} of {len(groups)} placement groups within {timeout_s:.0f} s "
            f"({plan.summary()}); pending: "
            + "; ".join(f"{s.name} bundles {list(s.bundles)}" + (f" on node {s.node_id}" if s.node_id else "") for s in waiting)
            + f"; cluster resources now: {ray.available_resources()}"
        )
    return groups


def group_node_ids(group: Any) -> list[str]:
    """The Ray node id of each bundle of a placed group, bundle order (Ray's own record)."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(group).get("bundles_to_node_id", {})
    return [placed[i] for i in sorted(placed)]


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

