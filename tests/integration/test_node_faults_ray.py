"""Re-placement of a lost node's groups (service/fleet/node_faults.py) on a real loopback Ray cluster
(tests/integration/loopback_cluster.py), with real placement groups and real engine launchers, but no
SGLang server and no trainer (the whole service with both: tests/integration/test_multinode.py). In order:

  1. the planner's start: trainer on worker node A, engine on worker node B (head: no CPUs); the state dir
     check of the start reads a probe file back on both;
  2. node C joins, node B is SIGKILLed: the engine's launcher is seen lost, and its group is reserved on C
     (the node without trainer ranks) before A; the new launcher really runs on C;
  3. node A (the trainer's) is SIGKILLed: the trainer group is placed anew on C, the node left with room,
     and a node that still runs is never given up;
  4. node C is SIGKILLed too: no node has room; the trainer's re-placement ends in NoPlacement after
     placement.node_loss_wait_s with the arithmetic, and so does the engine's once none is in service.
"""

from __future__ import annotations

import time

import pytest
import yaml

from tests.integration.loopback_cluster import LoopbackCluster
from tests.integration.service_world import REPO
from tests.local_ray import start_ray, stop_ray
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    """The cluster, this process joined to it as a driver (on loopback, as the cluster), and the tiny job's
    plan reserved on it: (cluster, job, plan, specs, trainer groups, EngineHosts, NodeFaults)."""
    import ray._private.ray_constants as ray_constants

    from service.config.job import JobConfig
    from service.config.settings import load_settings
    from service.fleet.engine_hosts import EngineHosts
    from service.fleet.node_faults import NodeFaults
    from service.fleet.placement import cluster_shape_from_ray, placement_group_specs, plan_placement, reserve_placement_groups

    cluster = LoopbackCluster([2, 2])
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # this driver's node IP is 127.0.0.1, as the cluster's
    try:
        assert not ray.is_initialized(), "another test left Ray running"
        start_ray(address=cluster.address, log_to_driver=False)
        raw = yaml.safe_load((REPO / "examples" / "tiny" / "job.yaml").read_text())
        raw["base_model"]["path"] = str(tiny_world / "model")
        raw["adapters"] = []
        raw["placement"]["node_loss_wait_s"] = 3
        job = JobConfig.model_validate(raw)
        settings = load_settings(state_dir=tmp_path_factory.mktemp("faults"))
        plan = plan_placement(job.placement, cluster_shape_from_ray())
        specs = placement_group_specs(plan)
        groups = reserve_placement_groups(plan, timeout_s=120)
        hosts = EngineHosts(job, settings, groups[1:], [specs[1].node_id])
        faults = NodeFaults(job, specs[1:], hosts, specs[:1])
        yield cluster, job, plan, specs, groups[:1], hosts, faults
        faults.close()
        hosts.close()
    finally:
        stop_ray()
        mp.undo()
        cluster.shutdown()


def test_the_plan_puts_trainer_and_engine_on_different_worker_nodes(world):
    cluster, _, plan, specs, groups, hosts, _ = world
    from service.fleet.placement import group_node_ids

    trainer_node, engine_node = specs[0].node_id, specs[1].node_id
    assert {trainer_node, engine_node} == set(cluster.workers)
    assert group_node_ids(groups[0]) == [trainer_node] and group_node_ids(hosts.groups[0]) == [engine_node]  # Ray placed them there
    assert ray.get(hosts.launchers[0].info.remote(), timeout=120).node_id == engine_node  # the launcher runs in its group


def test_the_state_dir_is_seen_by_the_nodes_that_need_it(world, tmp_path):
    """The start-up check of a shared state dir (service/fleet/cluster_checks.py), run for real on both worker nodes
    (one host here: they share the filesystem; a node that does not see the folder cannot be made on one host)."""
    from service.fleet.cluster_checks import check_shared_state_dir, state_dir_users

    cluster, _, plan, _, _, _, _ = world
    assert state_dir_users(plan, "disk", "127.0.0.1") == {}  # the coordinator's host needs no probe
    users = state_dir_users(plan, "disk", "10.0.0.99")  # as if the coordinator ran on another host
    assert set(users) == set(cluster.workers) and any("handoff" in why for why in users.values())
    check_shared_state_dir(tmp_path, users, {})
    assert not list(tmp_path.iterdir())  # the probe file is removed again


def test_a_lost_engine_node_is_left_for_the_node_without_trainer_ranks(world):
    cluster, _, _, specs, _, hosts, faults = world
    lost = hosts.nodes[0]
    joined = cluster.add(2)
    cluster.kill(lost)
    wait_until(lambda: faults.launcher_lost(0), "the launcher seen lost", 120, interval_s=0.5)
    t0 = time.monotonic()
    assert faults.node_lost(lost)
    verdict_s = time.monotonic() - t0
    hosts.release(0)
    placed = faults._reserve(specs[1], {lost})
    assert placed is not None and placed[1] == joined, placed  # C (no trainer) before A (the trainer's node)
    launcher = hosts.install(0, *placed)
    assert ray.get(launcher.info.remote(), timeout=120).node_id == joined
    print(f"\nengine node: lost verdict {verdict_s:.1f} s after the launcher was seen lost")


def test_the_trainer_group_of_a_lost_node_is_placed_on_the_node_left(world):
    cluster, _, _, _, groups, hosts, faults = world
    from service.fleet.placement import group_node_ids

    trainer_node = faults.trainer_nodes[0]
    assert not faults.node_lost(hosts.nodes[0])  # a node that runs tasks is never given up
    cluster.kill(trainer_node)
    t0 = time.monotonic()
    new = faults.ensure_trainer_groups(groups)
    took = time.monotonic() - t0
    assert faults.trainer_nodes == [hosts.nodes[0]] and group_node_ids(new[0]) == [hosts.nodes[0]]
    groups[:] = new
    print(f"\ntrainer node: placed anew in {took:.1f} s after the kill")


def test_with_no_room_left_both_end_in_no_placement_with_the_arithmetic(world):
    cluster, _, _, _, groups, hosts, faults = world
    from service.errors import NoPlacement, NoRoomYet

    last = hosts.nodes[0]
    cluster.kill(last)
    with pytest.raises(NoPlacement) as err:
        faults.ensure_trainer_groups(groups)
    msg = str(err.value)
    assert msg.startswith("the trainer cannot be restarted: no alive node has room for lorafleet-trainer-dp0 "
                          "(bundles [{'CPU': 1.0}]); alive nodes: node 0 (127.0.0.1, "), msg
    assert "0 GPUs, 0 CPUs free" in msg and msg.endswith("for 3 s (placement.node_loss_wait_s)")
    wait_until(lambda: faults.launcher_lost(0), "the engine's launcher seen lost", 120, interval_s=0.5)
    move = faults.begin_engine_restart(0, rollout_handle=None)  # no room: the move fails, the next check tries again
    with pytest.raises(NoRoomYet, match="no alive node has room for lorafleet-engine0"):
        move.result(timeout=300)
    wait_until(lambda: time.monotonic() - faults._unplaced_since[0] > faults.wait_s, "node_loss_wait_s to pass", 30, interval_s=0.2)
    with pytest.raises(NoPlacement, match=r"no engine has been in service for \d+ s \(placement.node_loss_wait_s 3 s\)"):
        faults.begin_engine_restart(0, rollout_handle=None)
