"""A lost node survived: its engines and trainer TP groups placed anew (`NodeFaults`).

What a lost node costs and what happens (docs/ray-cluster.md, "What each fault does"):
  * an engine's launcher is gone (its node died; rollout/engines/engine_handles.py EngineLost): when the
    runtime's engine check restarts the engine, `begin_engine_restart` moves it instead: its old
    group is released, a group is reserved on a node with room (the planner's policy:
    service/fleet/placement.py pick_node; the nodes left, or one that joined), a new launcher starts the
    engine there and the rollout worker adopts it (every adapter's current version loaded on it:
    republished). The move runs on a thread of its own, so the loop goes on: SFT runs train, RL runs
    train on what is buffered and then wait for an engine. No room yet: the move fails and the next
    check (every engines check) tries again;
  * a trainer rank's node is gone: when the trainer group restarts (the loop restarts it after a
    TrainerLost, and re-prepares every live run from its last checkpoint), `ensure_trainer_groups`
    keeps each trainer placement group whose node still runs tasks and places the others anew
    (first node with room), waiting for room up to placement.node_loss_wait_s;
  * no room within placement.node_loss_wait_s (for the trainer; for the engines: with none left in
    service): NoPlacement, which the loop turns into a stop with that reason: it drains
    (checkpoints every live run it can) and the service exits saying why, every run resumable.

Invariants:
  * a node is given up only on evidence: Ray marked it dead, or a task pinned to it did not run
    within VERDICT_S (a raylet killed a moment ago still looks alive to the GCS for a few seconds);
  * room is counted from this fleet's own groups (their bundles on their nodes) against the alive
    nodes' totals, the group being replaced left out; Ray has the last word (a reservation not ready
    within RESERVE_TRY_S is released and the next node tried);
  * a replaced group is released before its replacement is reserved (its node may be alive: then
    its room counts again).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import ray

from service.config.job import JobConfig
from service.fleet.engine_hosts import EngineHosts
from service.errors import NoPlacement, NoRoomYet
from service.fleet.placement import ClusterShape, PlacementGroupSpec, cluster_shape_from_ray, create_placement_group, pick_node, release_placement_groups
from service.fleet.remote import call

log = logging.getLogger(__name__)

VERDICT_S = 30.0  # a node that cannot run a tiny task in this long is treated as lost
RESERVE_TRY_S = 30.0  # per node tried
POLL_S = 0.5


def _ping() -> str:
    return ray.get_runtime_context().get_node_id()


class NodeFaults:
    """Re-placement of a lost node's groups for one fleet (module doc)."""

    def __init__(self, job: JobConfig, engine_specs: list[PlacementGroupSpec], engine_hosts: EngineHosts,
                 trainer_specs: list[PlacementGroupSpec]) -> None:
        self.job = job
        self.wait_s = job.placement.node_loss_wait_s
        self.engine_specs = engine_specs  # bundles of each engine's group (the node changes on a move)
        self.engine_hosts = engine_hosts
        self.trainer_specs = trainer_specs
        self.trainer_nodes: list[str | None] = [s.node_id for s in trainer_specs]
        self._moves = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(engine_specs)), thread_name_prefix="engine-move")
        self._lock = threading.Lock()  # room accounting and group changes, one at a time
        self._unplaced_since: dict[int, float] = {}  # engine -> when its move first failed for lack of room
        self._generation = 0

    # --- evidence about nodes --------------------------------------------------------------------

    def node_lost(self, node_id: str | None, *, verdict_s: float = VERDICT_S) -> bool:
        """Whether `node_id` is gone: Ray marked it dead, or a task pinned to it did not run in `verdict_s`."""
        if node_id is None:
            return False
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not _alive_nodes().get(node_id, False):
            return True
        ref = ray.remote(num_cpus=0, max_retries=0)(_ping).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)).remote()
        deadline = time.monotonic() + verdict_s
        while time.monotonic() < deadline:
            done, _ = ray.wait([ref], timeout=POLL_S)
            if done:
                try:
                    ray.get(ref)
                    return False
                except Exception:  # noqa: BLE001 - the task failed: its node died under it
                    return True
            if not _alive_nodes().get(node_id, False):
                ray.cancel(ref, force=True)
                return True
        ray.cancel(ref, force=True)
        return True

    # --- room ------------------------------------------------------------------------------------

    def _used(self) -> tuple[dict[str, float], dict[str, float], set[str]]:
        """GPUs and CPUs this fleet's groups hold per node, and the nodes holding trainer ranks."""
        gpus: dict[str, float] = {}
        cpus: dict[str, float] = {}
        trainer: set[str] = set()
        held = [(spec, node) for spec, node in zip(self.trainer_specs, self.trainer_nodes)]
        held += [(spec, node) for spec, node in zip(self.engine_specs, self.engine_hosts.nodes)]
        for spec, node in held:
            if node is None:
                continue
            for b in spec.bundles:
                gpus[node] = gpus.get(node, 0.0) + b.get("GPU", 0.0)
                cpus[node] = cpus.get(node, 0.0) + b.get("CPU", 0.0)
            if spec.role == "trainer":
                trainer.add(node)
        return gpus, cpus, trainer

    def _candidates(self, spec: PlacementGroupSpec, exclude: set[str]) -> tuple[list[str], ClusterShape]:
        """Alive nodes with room for `spec`, in the planner's order of preference."""
        shape = cluster_shape_from_ray()
        assert shape.node_ids is not None and shape.node_cpus is not None
        used_g, used_c, trainer = self._used()
        need_g = sum(b.get("GPU", 0.0) for b in spec.bundles)
        need_c = sum(b.get("CPU", 0.0) for b in spec.bundles)
        free_g = [g - used_g.get(n, 0.0) for g, n in zip(shape.node_gpus, shape.node_ids)]
        free_c = [c - used_c.get(n, 0.0) for c, n in zip(shape.node_cpus, shape.node_ids)]
        fits = [i for i, n in enumerate(shape.node_ids)
                if n not in exclude and free_g[i] + 1e-9 >= need_g and free_c[i] + 1e-9 >= need_c]
        order: list[str] = []
        has_trainer = [n in trainer for n in shape.node_ids]
        room = free_g if self.job.placement.accelerator == "gpu" else free_c
        while fits:
            pick = pick_node(spec.role, fits, has_trainer, room)
            order.append(shape.node_ids[pick])
            fits.remove(pick)
        return order, shape

    def _reserve(self, spec: PlacementGroupSpec, exclude: set[str]) -> tuple[Any, str] | None:
        """A ready group for `spec` on the first candidate node Ray honours; None: no room now."""
        order, _ = self._candidates(spec, exclude)
        for node in order:
            self._generation += 1
            placed = spec.model_copy(update={"node_id": node, "name": f"{spec.name}-r{self._generation}"})
            group = create_placement_group(placed)
            done, _ = ray.wait([group.ready()], timeout=RESERVE_TRY_S)
            if done:
                return group, node
            release_placement_groups([group])
            log.info("%s: node %s did not honour the reservation within %.0f s; trying the next", spec.name, node[:12], RESERVE_TRY_S)
        return None

    def _no_room(self, spec: PlacementGroupSpec, exclude: set[str]) -> str:
        shape = cluster_shape_from_ray()
        used_g, used_c, _ = self._used()
        nodes = "; ".join(
            f"{shape.node_label(i)}: {g - used_g.get(n, 0.0):g} GPUs, {c - used_c.get(n, 0.0):g} CPUs free"
            + (" (lost)" if n in exclude else "")
            for i, (n, g, c) in enumerate(zip(shape.node_ids or (), shape.node_gpus, shape.node_cpus or ())))
        return f"no alive node has room for {spec.name} (bundles {list(spec.bundles)}); alive nodes: {nodes or 'none'}"

    # --- engines -----------------------------------------------------------------------------------

    def launcher_lost(self, index: int) -> bool:
        """Whether engine `index` has no host, or its launcher's process is gone (a busy one is not)."""
        launcher = self.engine_hosts.launchers[index]
        if launcher is None:
            return True
        try:
            ray.get(launcher.launcher_pid.remote(), timeout=5.0)
            return False
        except ray.exceptions.GetTimeoutError:
            return False
        except ray.exceptions.RayActorError:
            return True

    def begin_engine_restart(self, index: int, rollout_handle: Any) -> Any:
        """Restart engine `index` where it is (an ObjectRef), or, its launcher lost, move it to a node with
        room (a Future of its EngineHealth). NoPlacement when no engine has been in service for
        node_loss_wait_s and this one still finds no room."""
        if not self.launcher_lost(index):
            return rollout_handle.restart_engine.remote(index)
        since = self._unplaced_since.get(index)
        if since is not None and time.monotonic() - since > self.wait_s and self._no_engine_hosted():
            raise NoPlacement(
                f"no engine has been in service for {time.monotonic() - since:.0f} s (placement.node_loss_wait_s "
                f"{self.wait_s:g} s) and engine {index} still finds no room: {self._no_room(self.engine_specs[index], set())}"
            )
        return self._moves.submit(self._move_engine, index, rollout_handle)

    def _no_engine_hosted(self) -> bool:
        return all(node is None for node in self.engine_hosts.nodes)

    def _move_engine(self, index: int, rollout_handle: Any) -> Any:
        t0 = time.monotonic()
        spec = self.engine_specs[index]
        with self._lock:
            old = self.engine_hosts.nodes[index]
            lost = {old} if old is not None and self.node_lost(old) else set()
            self.engine_hosts.release(index)
            placed = self._reserve(spec, lost)
            if placed is None:
                self._unplaced_since.setdefault(index, t0)
                raise NoRoomYet(self._no_room(spec, lost) + "; the next engine check tries again (a node may join)")
            group, node = placed
            launcher = self.engine_hosts.install(index, group, node)
        self._unplaced_since.pop(index, None)
        log.warning("engine %d: its launcher was lost%s; placed anew on node %s in %.1f s, starting it there",
                    index, f" with node {old[:12]}" if lost else "", node[:12], time.monotonic() - t0)
        timeout = self.job.engines.startup_deadline_s + 120
        health = call(rollout_handle.adopt_engine.remote(index, launcher), timeout, f"rollout adopt_engine({index})")
        log.warning("engine %d: serving again on node %s (%s), %.1f s after the move began; every adapter's "
                    "current version loaded", index, node[:12], health.url, time.monotonic() - t0)
        return health

    # --- trainer -----------------------------------------------------------------------------------

    def ensure_trainer_groups(self, groups: list[Any]) -> list[Any]:
        """The trainer's placement groups for a restart: each whose node is alive kept, each on a lost node
        placed anew (the first node with room), waiting for room up to node_loss_wait_s (NoPlacement)."""
        deadline = time.monotonic() + self.wait_s
        out = list(groups)
        with self._lock:
            for d, node in enumerate(self.trainer_nodes):
                if node is not None and not self.node_lost(node):
                    continue
                t0 = time.monotonic()
                if out[d] is not None:
                    try:
                        release_placement_groups([out[d]])
                    except Exception as e:  # noqa: BLE001 - a group on a dead node may linger
                        log.info("releasing trainer dp%d's placement group: %s", d, e)
                    out[d] = None
                self.trainer_nodes[d] = None
                while True:
                    lost = {node} if node is not None and self.node_lost(node) else set()
                    placed = self._reserve(self.trainer_specs[d], lost)
                    if placed is not None:
                        break
                    if time.monotonic() > deadline:
                        raise NoPlacement(f"the trainer cannot be restarted: {self._no_room(self.trainer_specs[d], lost)} "
                                          f"for {self.wait_s:g} s (placement.node_loss_wait_s)")
                    log.warning("trainer dp%d: %s; waiting for room (a node may join) until placement.node_loss_wait_s", d,
                                self._no_room(self.trainer_specs[d], lost))
                    time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
                out[d], self.trainer_nodes[d] = placed
                log.warning("trainer dp%d: its node %s was lost; placed anew on node %s in %.1f s", d,
                            (node or "?")[:12], self.trainer_nodes[d][:12], time.monotonic() - t0)
        return out

    def close(self) -> None:
        self._moves.shutdown(wait=False, cancel_futures=True)


def _alive_nodes() -> dict[str, bool]:
    return {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
