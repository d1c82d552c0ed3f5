"""Checks of a plan against the cluster it runs on, made at start before anything is launched, each
refusing with PlacementError that says what to change (service/fleet/startup.py calls them):

  * `check_engines_reachable`: the rollout worker (on the coordinator's node) must reach every engine
    at the address its server binds: engines on another host need `engines.host: node`;
  * `check_shared_state_dir`: nodes that write or read the state dir must see the same folder there:
    every trainer node (trainer ranks write checkpoints and exports the coordinator records), and with
    `engines.weight_transfer: disk` every engine node (the engines read the handoff folders trainer
    rank 0 writes). Checked for real: the coordinator writes a file with a random token, a task on
    each such node reads it back.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from service.config.settings import is_loopback_host
from service.errors import PlacementError
from service.fleet.placement import PlacementPlan

PROBE_TIMEOUT_S = 60.0


def check_engines_reachable(plan: PlacementPlan, engines_host: str, coordinator_ip: str) -> None:
    """Engines bound to loopback must all be on the coordinator's host (where the rollout worker runs)."""
    cluster = plan.cluster
    if cluster is None or cluster.node_addresses is None or not is_loopback_host(engines_host):
        return
    away = [e for e in plan.engines if cluster.node_addresses[e.node] != coordinator_ip]
    if away:
        where = ", ".join(f"engine {e.engine} on {cluster.node_label(e.node)}" for e in away)
        raise PlacementError(
            f"{where}: engines.host is {engines_host!r}, which the rollout worker on the coordinator's host "
            f"({coordinator_ip}) cannot reach on another host; set engines.host: node (each engine binds its node's "
            "address; with the service's API bound off loopback and a token), or give the engines room on the "
            "coordinator's node"
        )


def _read_probe(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def check_shared_state_dir(state_dir: Path, nodes: dict[str, str], labels: dict[str, str]) -> None:
    """Every node in `nodes` (Ray node id -> why it needs the state dir) sees `state_dir` as the coordinator
    does; `labels`: node id -> how to name it in the error. Give only nodes of other hosts (`state_dir_users`
    leaves out the coordinator's address: one host, one filesystem, and a one-node start costs no probe)."""
    if not nodes:
        return
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    probe = Path(state_dir) / f".lorafleet-shared-probe-{token[:12]}"
    probe.write_text(token)
    try:
        reader = ray.remote(num_cpus=0, max_retries=0)(_read_probe)
        refs = {node: reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(str(probe))
                for node in nodes}
        try:
            seen = dict(zip(refs, ray.get(list(refs.values()), timeout=PROBE_TIMEOUT_S)))
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"checking that the state dir {state_dir} is shared: no answer from the nodes within "
                                 f"{PROBE_TIMEOUT_S:.0f} s") from None
    finally:
        probe.unlink(missing_ok=True)
    blind = [node for node, text in seen.items() if text != token]
    if blind:
        raise PlacementError(
            "the state dir " + str(state_dir) + " is not the same folder on "
            + "; ".join(f"{labels.get(n, n)} ({nodes[n]})" for n in blind)
            + ": mount one shared filesystem at that path on every node (ReadWriteMany on Kubernetes, NFS on VMs)"
            + (", or set engines.weight_transfer: tensors (no file handoff)" if any("weight_transfer" in nodes[n] for n in blind) else "")
        )


def state_dir_users(plan: PlacementPlan, weight_transfer: str, coordinator_ip: str) -> dict[str, str]:
    """Ray node id -> why it needs the state dir, for the nodes of `plan` on hosts other than the
    coordinator's (module doc)."""
    cluster = plan.cluster
    addresses = cluster.node_addresses if cluster is not None else None
    users: list[tuple[int, str]] = [(r.node, "trainer ranks write checkpoints there") for r in plan.trainer]
    if weight_transfer == "disk":
        users += [(e.node, "engines read weight_transfer 'disk' handoff folders there") for e in plan.engines]
    out: dict[str, str] = {}
    for node, why in users:
        node_id = plan.node_id(node)
        if node_id is None or (addresses is not None and addresses[node] == coordinator_ip):
            continue
        if why not in out.get(node_id, ""):
            out[node_id] = f"{out[node_id]}; {why}" if node_id in out else why
    return out
