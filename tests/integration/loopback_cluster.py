"""A real multi-node Ray cluster on loopback for tests: `LoopbackCluster`, Ray's own
ray.cluster_utils.Cluster (a head with the GCS and one raylet per node, all on 127.0.0.1) kept
by a child process of its own, which the test drives over a pipe (add a node, SIGKILL a node's Ray
processes, list the raylets).

Why a child process: the Cluster's nodes must keep 127.0.0.1 as their address, which takes Ray's
single-host switch (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, FINDINGS.md) in the process that starts
them; and the Cluster records its address in <ray temp dir>/ray_current_cluster, where any plain
ray.init() on the machine would find and join it. The child runs with both the switch and a private
Ray temp dir (RAY_TMPDIR), so neither reaches the test process or anybody else on the machine; the
record is removed when the cluster shuts down.

Protocol (one JSON object per line): the child prints {"address": ..., "head": node_id} once up, then
answers each command: {"op": "add", "num_cpus": N, "env": {...}} -> {"node_id": ...} (env: variables of
that node's own environment, which its Ray processes and workers inherit, as a node's `ray start` would); {"op": "kill", "node_id": ...}
(every Ray process of that node SIGKILLed, as a lost machine) -> {"killed": node_id};
{"op": "raylets"} -> {node_id: raylet pid}; {"op": "shutdown"} -> {"bye": true}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.paths import REPO

ROOT = REPO
# Fast failure detection (Ray's defaults take ~30 s to call a node dead); the service copes with either.
SYSTEM_CONFIG = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                 "health_check_failure_threshold": 5}


class LoopbackCluster:
    """A head (no CPUs: it hosts only the driver and what is pinned to it) plus worker nodes."""

    def __init__(self, worker_cpus: list[int], *, object_store_mb: int = 100) -> None:
        self.tmp = tempfile.mkdtemp(prefix="lfc-", dir="/tmp")  # short: Ray's socket paths live below it
        self.env = {**os.environ, "RAY_TMPDIR": self.tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.env.pop("RAY_ADDRESS", None)
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.integration.loopback_cluster", str(object_store_mb)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(Path(self.tmp) / "keeper.log", "w"),
                                      text=True, env=self.env, cwd=ROOT)
        hello = self._read()
        self.address, self.head = hello["address"], hello["head"]
        self.workers: list[str] = []  # the worker nodes alive, in the order they joined
        for cpus in worker_cpus:
            self.add(cpus)

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the cluster keeper exited ({self._proc.poll()}); its log: {self.log_tail()}")
        return json.loads(line)

    def _ask(self, **cmd) -> dict:
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise ValueError(f"cluster keeper: {answer['error']}")
        return answer

    def add(self, num_cpus: int, env: dict[str, str] | None = None) -> str:
        """A worker node joins, with `env` added to its environment; its Ray node id (in `workers` from now on)."""
        node = self._ask(op="add", num_cpus=num_cpus, env=env or {})["node_id"]
        self.workers.append(node)
        return node

    def kill(self, node_id: str) -> None:
        """SIGKILL every Ray process of the node (raylet, object store, agents); its workers then exit."""
        self._ask(op="kill", node_id=node_id)
        self.workers = [n for n in self.workers if n != node_id]

    def raylets(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._ask(op="raylets").items()}

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((Path(self.tmp) / "keeper.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def shutdown(self) -> None:
        if self._proc.poll() is None:
            try:
                self._ask(op="shutdown")
                self._proc.wait(120)
            except Exception:  # noqa: BLE001 - a keeper that does not answer is killed
                self._proc.kill()
                self._proc.wait(30)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def back_on_a_node_left(self, client, name: str, before: dict, deadline_s: float) -> dict:  # noqa: ANN001
        """Wait until the service's process `name` (``client``: its LorafleetClient) runs again, a new pid,
        on a worker node still in this cluster; its /v1/fleet record."""
        from tests.waiting import wait_until

        def back():
            p = {x["name"]: x for x in client.fleet()}.get(name)  # a trainer being restarted is not listed
            return p is not None and p["pid"] and p["pid"] != before["pid"] and p["node_id"] in self.workers and p

        return wait_until(back, f"{name} running again on a node that is left", deadline_s, interval_s=0.5)

    @staticmethod
    def running(client, names: tuple[str, ...], deadline_s: float) -> dict[str, dict]:  # noqa: ANN001
        """Wait until each of the service's processes `names` is listed with a pid; every /v1/fleet record
        by name. A process not listed yet is waited for (the engines are listed only once the rollout
        worker is up, and the trainer serves before that)."""
        from tests.waiting import wait_until

        def up():
            p = {x["name"]: x for x in client.fleet()}
            return all(p.get(n, {}).get("pid") for n in names) and p

        return wait_until(up, f"{' and '.join(names)} running", deadline_s, interval_s=0.5)


def _serve(object_store_mb: int) -> None:
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # as RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read at import: set the copy)
    from ray.cluster_utils import Cluster

    store = object_store_mb * 1024**2
    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 0, "include_dashboard": False, "object_store_memory": store,
        "_system_config": SYSTEM_CONFIG})
    nodes = {cluster.head_node.node_id: cluster.head_node}
    print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "add":
                before = dict(os.environ)
                os.environ.update(cmd.get("env") or {})  # the raylet and its workers inherit it
                try:
                    node = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=cmd["num_cpus"], object_store_memory=store)
                finally:
                    os.environ.clear()
                    os.environ.update(before)
                nodes[node.node_id] = node
                out = {"node_id": node.node_id}
            elif cmd["op"] == "kill":
                node = nodes.pop(cmd["node_id"], None)
                if node is None:
                    out = {"error": f"no live node {cmd['node_id']}"}
                else:
                    cluster.remove_node(node, allow_graceful=False)
                    out = {"killed": cmd["node_id"]}
            elif cmd["op"] == "raylets":
                out = {nid: n.all_processes["raylet"][0].process.pid for nid, n in nodes.items()}
            else:
                out = {"bye": True}
            print(json.dumps(out), flush=True)
            if cmd["op"] == "shutdown":
                break
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
