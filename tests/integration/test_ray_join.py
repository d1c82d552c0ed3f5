"""Joining a Ray cluster only on purpose (service/fleet/ray_connect.py; issue 27 item 1), on real Rays in a
subprocess whose Ray temp dir is private (RAY_TMPDIR), so the cluster it records is seen by nobody else
on the machine:

  * a cluster recorded on the host (ray_current_cluster, as `ray start` or ray.cluster_utils.Cluster
    write it) is NOT joined without an address: the service starts a private local Ray with the
    logical CPUs it asked for (plain ray.init() would join it and refuse num_cpus);
  * `ray.address: auto` joins exactly that recorded cluster, and a host:port address joins it too;
  * the `lorafleet run` command ends at once with exit 2 and the reason when the job's head does not
    answer within ray.connect_timeout_s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = REPO

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from service.config.ray import RayConfig
    from service.fleet.ray_connect import connect_ray, ray_on_loopback, recorded_cluster_address
    ray_on_loopback()
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"node_ip_address": "127.0.0.1", "num_cpus": 1,
                                                          "include_dashboard": False, "object_store_memory": 80 * 1024**2})
    out = {"cluster": cluster.address, "recorded": recorded_cluster_address()}
    try:
        for name, cfg in (("default", RayConfig()), ("local", RayConfig(address="local")),
                          ("auto", RayConfig(address="auto")), ("explicit", RayConfig(address=cluster.address))):
            line = connect_ray(cfg, local_cpus=3, loopback_service=True)
            out[name] = {"gcs": ray.get_runtime_context().gcs_address, "cpus": ray.cluster_resources().get("CPU"), "line": line}
            ray.shutdown()
    finally:
        cluster.shutdown()
    print(json.dumps(out))
""")


def test_a_recorded_cluster_is_joined_only_when_an_address_says_so():
    with tempfile.TemporaryDirectory(prefix="lfj-", dir="/tmp") as tmp:  # short: Ray's socket paths live below it
        env = {**os.environ, "RAY_TMPDIR": tmp, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert not (Path(tmp) / "ray" / "ray_current_cluster").exists()  # the cluster removed its record on shutdown
    assert out["recorded"] == out["cluster"]  # the planted condition: a cluster is recorded on this host
    for private in ("default", "local"):
        assert out[private]["gcs"] != out["cluster"], out  # a Ray of its own, not the recorded cluster
        assert out[private]["cpus"] == 3.0 and "a private local Ray" in out[private]["line"]
    for joined in ("auto", "explicit"):
        assert out[joined]["gcs"] == out["cluster"] and out[joined]["cpus"] == 1.0, out
        assert "joined the cluster at" in out[joined]["line"]


def test_lorafleet_run_exits_with_the_reason_when_the_head_does_not_answer(tmp_path, tiny_world):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nobody listens there
    job = yaml.safe_load((ROOT / "examples" / "tiny" / "job.yaml").read_text())
    job["base_model"]["path"] = str(tiny_world / "model")
    job["adapters"] = []
    job["service"] = {"state_dir": str(tmp_path / "state")}
    job["ray"] = {"address": f"127.0.0.1:{port}", "connect_timeout_s": 2}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "api.cli.main", "run", str(path)], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"error: RayConnectError: cannot reach the Ray cluster at 127.0.0.1:{port} (from the job file's "
            "ray.address) within 2 s") in proc.stderr
