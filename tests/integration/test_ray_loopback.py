"""A local Ray started for a service on loopback listens on 127.0.0.1 only (service/fleet/ray_connect.py
`ray_on_loopback`; docs/operations.md, Ports). Measured on the real processes with psutil, in a
subprocess of its own (the switch changes process-wide Ray state). Without the switch Ray's GCS,
raylet and workers listen on every interface: that is the planted-bug check of this test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.net_probe import is_loopback
from tests.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = REPO

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import psutil, ray
    from service.fleet.ray_connect import ray_on_loopback
    if sys.argv[1] == "loopback":
        ray_on_loopback()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 1024**2)

    @ray.remote
    def pid():
        return os.getpid()

    ray.get(pid.remote())  # a worker process is up too
    me = psutil.Process()
    found = []
    for p in [me] + me.children(recursive=True):
        try:
            found += [[p.name(), c.laddr.ip, c.laddr.port] for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    ray.shutdown()
    print(json.dumps(found))
""")


def listeners(mode: str) -> list[tuple[str, str, int]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=240, check=True)
    return [tuple(x) for x in json.loads(out.stdout.strip().splitlines()[-1])]




def test_local_ray_for_a_loopback_service_listens_on_loopback_only():
    found = listeners("loopback")
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, found  # the listeners were seen at all
    assert all(is_loopback(ip) for _, ip, _ in found), [f for f in found if not is_loopback(f[1])]


@pytest.mark.slow  # the planted-bug control (about 30 s): run it on a Ray upgrade
def test_without_the_switch_ray_listens_on_every_interface():
    """The control: shows the measurement can see a non-loopback listener."""
    found = listeners("default")
    assert any(not is_loopback(ip) for _, ip, _ in found), found
