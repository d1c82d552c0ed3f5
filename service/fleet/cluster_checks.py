"""Checks of a plan against the cluster it runs on, made at start before anything is launched, each
refusing with PlacementError that says what to change (service/fleet/startup.py calls them):

  * `check_engines_reachable`: the rollout worker (on the coordinator's node) must reach every engine
    at the address its server binds: engines on another host need `engines.host: node`;
  * `check_storage` (before Ray starts) and `check_storage_on_nodes`: the storage (`service.storage`)
    works from the coordinator and from every trainer node on its own environment (the AWS variables
    of an object store are each node's own: docs/ray-cluster.md): a folder written, read back and
    deleted there (trainer/storage/locations.py check_location), the store's reason in the refusal;
  * `check_shared_state_dir`: nodes that write or read the state dir must see the same folder there:
    with a local storage every trainer node (trainer ranks write checkpoints and exports the
    coordinator records; with `s3://` storage they write to the object store and need no state dir),
    and with `engines.weight_transfer: disk` trainer rank 0's node and every engine node (the engines
    read the handoff folders trainer rank 0 writes: these stay files of the state dir whatever the
    storage, docs/ray-cluster.md says why). Checked for real: the coordinator writes a file with a
    random token, a task on each such node reads it back.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from service.config.settings import ServiceSettings, is_loopback_host
from service.errors import PlacementError
from service.fleet.placement import PlacementPlan
from trainer.storage.locations import check_location
from trainer.storage.store import CheckpointStore, StoreError

log = logging.getLogger(__name__)

STORAGE_CACHE_VARIABLE = "LORAFLEET_STORAGE_CACHE"  # what trainer/storage/s3_store.py reads

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


def _on_each_node(fn: Callable[[str], Any], arg: str, nodes: Iterable[str], what: str) -> dict[str, Any]:
    """`fn(arg)` in a task pinned to each of `nodes` (Ray node ids): node id -> its answer."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(arg)
            for node in nodes}
    try:
        return dict(zip(refs, ray.get(list(refs.values()), timeout=PROBE_TIMEOUT_S)))
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(f"{what}: no answer from the nodes within {PROBE_TIMEOUT_S:.0f} s") from None


def check_shared_state_dir(state_dir: Path, nodes: dict[str, str], labels: dict[str, str]) -> None:
    """Every node in `nodes` (Ray node id -> why it needs the state dir) sees `state_dir` as the coordinator
    does; `labels`: node id -> how to name it in the error. Give only nodes of other hosts (`state_dir_users`
    leaves out the coordinator's address: one host, one filesystem, and a one-node start costs no probe)."""
    if not nodes:
        return
    token = uuid.uuid4().hex
    probe = Path(state_dir) / f".lorafleet-shared-probe-{token[:12]}"
    probe.write_text(token)
    try:
        seen = _on_each_node(_read_probe, str(probe), nodes, f"checking that the state dir {state_dir} is shared")
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


def state_dir_users(plan: PlacementPlan, weight_transfer: str, coordinator_ip: str, storage: str | None = None) -> dict[str, str]:
    """Ray node id -> why it needs the state dir, for the nodes of `plan` on hosts other than the
    coordinator's (module doc). `storage`: ServiceSettings.storage (an s3:// one takes the trainer's
    writes off the state dir)."""
    cluster = plan.cluster
    addresses = cluster.node_addresses if cluster is not None else None
    users: list[tuple[int, str]] = []
    if not is_object_storage(storage):
        users += [(r.node, "trainer ranks write checkpoints there") for r in plan.trainer]
    if weight_transfer == "disk":  # hand-off folders are files of the state dir whatever the storage (publishing.py U5)
        users += [(r.node, "trainer rank 0 writes weight_transfer 'disk' handoff folders there") for r in plan.trainer if r.rank == 0]
        users += [(e.node, "engines read weight_transfer 'disk' handoff folders there") for e in plan.engines]
    out: dict[str, str] = {}
    for node, why in users:
        node_id = plan.node_id(node)
        if node_id is None or (addresses is not None and addresses[node] == coordinator_ip):
            continue
        if why not in out.get(node_id, ""):
            out[node_id] = f"{out[node_id]}; {why}" if node_id in out else why
    return out


def is_object_storage(storage: str | None) -> bool:
    return storage is not None and str(storage).startswith("s3://")


def check_storage(settings: ServiceSettings) -> CheckpointStore:
    """The service's store, usable from this process (module doc), before anything starts: a wrong
    URL, endpoint or credential refuses the start at once with the store's reason. `storage_cache`,
    when set, becomes this process's LORAFLEET_STORAGE_CACHE first, so every store opened here and
    every process started on this node (a private Ray's trainer ranks) keeps its copies there."""
    if settings.storage_cache is not None:
        os.environ[STORAGE_CACHE_VARIABLE] = str(settings.storage_cache.absolute())
    try:
        return check_location(settings.storage_location)
    except StoreError as e:
        raise PlacementError(f"service.storage: {e}; check the location and, for s3://, the AWS variables "
                             "(AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY) of the service's environment") from None


def storage_users(plan: PlacementPlan, coordinator_node_id: str) -> dict[str, str]:
    """Ray node id -> why it opens the store, for the nodes of `plan` other than the coordinator's own
    (whose processes share the environment `check_storage` checked, or its node's)."""
    out: dict[str, str] = {}
    for r in plan.trainer:
        node_id = plan.node_id(r.node)
        if node_id is not None and node_id != coordinator_node_id:
            out[node_id] = "trainer ranks write checkpoints and exports there"
    return out


def _probe_store(location: str) -> str | None:
    try:
        check_location(location)
        return None
    except StoreError as e:
        return str(e)


def check_storage_on_nodes(location: str, nodes: dict[str, str], labels: dict[str, str]) -> None:
    """Every node in `nodes` (Ray node id -> why it needs the store; `storage_users`) can use the
    store at `location` with its own environment: a task pinned to each runs the probe there. Object
    storage only: a local storage's nodes are checked by `check_shared_state_dir` (the state dir) or
    share the folder by the operator's mount."""
    if not nodes or not is_object_storage(location):
        return
    seen = _on_each_node(_probe_store, location, nodes, f"checking the storage {location} from the trainer nodes")
    failed = {node: why for node, why in seen.items() if why is not None}
    if failed:
        raise PlacementError(
            "the storage is not usable from " + "; ".join(f"{labels.get(n, n)} ({nodes[n]}): {failed[n]}" for n in failed)
            + ". Give each node the AWS variables in the environment its Ray node runs in (the environment of "
            "`ray start`, docs/ray-cluster.md), not only the service's")
    log.info("storage %s: usable from %s", location, "; ".join(labels.get(n, n) for n in nodes))
