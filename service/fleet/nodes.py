"""Every process of the fleet with its id and its node (GET /v1/fleet): `fleet_processes`.

Nodes are Ray node ids with their addresses, taken from where Ray put each process: the coordinator's
own node, each trainer rank's placement-group bundle (TrainerGroup.rank_nodes), the rollout worker's
and each engine launcher's own report (rollout/worker_actor.py processes). An id is "" where it is not
known (outside Ray, an external engine, a process not running).
"""

from __future__ import annotations

import logging
import os

from rollout.engines.engine_handles import local_node
from service.control.runtime_protocol import ProcessInfo
from service.fleet.rollout_client import RolloutClient
from service.fleet.trainer_group import TrainerGroup

log = logging.getLogger(__name__)


def node_addresses() -> dict[str, str]:
    """Ray node id -> its address, for the nodes Ray knows (alive or not); {} outside Ray."""
    import ray

    if not ray.is_initialized():
        return {}
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def fleet_processes(trainer: TrainerGroup, rollout: RolloutClient | None) -> list[ProcessInfo]:
    """The coordinator, each trainer rank, the rollout worker and each engine (no rollout worker:
    a Tinker-only fleet). pid None: not running / unknown."""
    here_id, here_ip = local_node()
    out = [ProcessInfo("coordinator", "coordinator", os.getpid(), node_id=here_id, node_ip=here_ip)]
    try:
        pids = trainer.pids() if trainer.running else []
        nodes = trainer.rank_nodes() if pids else []
    except Exception as e:  # noqa: BLE001 - a listing: show what is known
        log.info("trainer pids: %s: %s", type(e).__name__, e)
        pids, nodes = [], []
    ips = node_addresses() if any(nodes) else {}
    out += [ProcessInfo(f"trainer-rank-{r}", "trainer", pid, node_id=node, node_ip=ips.get(node, ""))
            for r, (pid, node) in enumerate(zip(pids, nodes or [""] * len(pids)))]
    if rollout is not None:
        try:
            procs = rollout.processes()
            out.append(ProcessInfo("rollout-worker", "rollout", procs["worker"], node_id=procs["node_id"], node_ip=procs["node_ip"]))
            out += [ProcessInfo(f"engine-{i}", "engine", e.pid, node_id=e.node_id, node_ip=e.node_ip) if e is not None
                    else ProcessInfo(f"engine-{i}", "engine", None, "external") for i, e in enumerate(procs["engines"])]
        except Exception as e:  # noqa: BLE001
            out.append(ProcessInfo("rollout-worker", "rollout", None, f"unreachable: {type(e).__name__}"))
    return out
