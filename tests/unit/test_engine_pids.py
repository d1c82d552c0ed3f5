"""Leftover engines recorded per node and reaped on their own host (service/fleet/engine_pids.py), on real processes.

STAND-INS for leftover SGLang servers: `python -c <sleep> rollout.engines.sglang_server --port P` processes in a
session of their own, whose command line carries what the reaper looks for (a real server takes 3.5 GB
and a minute to start; what is tested here is which processes the record makes the reaper kill). Their
ports are privileged ones no engine on this machine uses (the reaper kills any server with a recorded
port). An engine left on another host cannot be made on one host: its entry is told apart by its node
address.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from service.fleet.engine_pids import ENGINE_PIDS_FILE, reap_engines, record_engines
from tests.waiting import wait_until

pytestmark = pytest.mark.unit


@dataclass
class Recorded:  # what rollout.messages.EngineHealth carries of an engine
    url: str
    pid: int | None
    node_id: str
    node_ip: str


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.fixture
def stand_ins():
    procs = []

    def start(port: int) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "rollout.engines.sglang_server", "--port", str(port)],
                             start_new_session=True)
        procs.append(p)
        # the reaper finds it by its command line, which is the parent's until the child has exec'd
        wait_until(lambda: b"rollout.engines.sglang_server" in _cmdline(p.pid), "the stand-in's command line", 30, interval_s=0.01)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(30)


def test_engines_are_reaped_on_their_own_host_only(tmp_path, stand_ins):
    here, there, by_port = stand_ins(11), stand_ins(13), stand_ins(17)
    record_engines(tmp_path, [
        Recorded(f"http://127.0.0.1:{11}", here.pid, "a" * 56, "10.0.0.4"),
        Recorded(f"http://10.0.0.5:{13}", there.pid, "b" * 56, "10.0.0.5"),  # another host's (same pid space here)
        Recorded(f"http://127.0.0.1:{17}", None, "a" * 56, "10.0.0.4"),  # pid unknown: found by its port
        Recorded("", None, "c" * 56, "10.0.0.6"),  # not started: nothing to record
    ])
    entries = json.loads((tmp_path / ENGINE_PIDS_FILE).read_text())["engines"]
    assert [(e["node_ip"], e["port"]) for e in entries] == [("10.0.0.4", 11), ("10.0.0.5", 13), ("10.0.0.4", 17)]
    killed = reap_engines(tmp_path, local_ips={"10.0.0.4"})
    assert sorted(killed) == sorted([here.pid, by_port.pid])
    wait_until(lambda: here.poll() is not None and by_port.poll() is not None, "the reaped stand-ins to exit", 30, interval_s=0.05)
    assert there.poll() is None  # recorded for another host: left for a task on that host
    assert not (tmp_path / ENGINE_PIDS_FILE).exists()


def test_a_record_of_the_previous_format_is_this_hosts(tmp_path, stand_ins):
    old = stand_ins(19)
    (tmp_path / ENGINE_PIDS_FILE).write_text(json.dumps({"ports": [19], "pids": []}))
    assert reap_engines(tmp_path, local_ips={"10.0.0.4"}) == [old.pid]
