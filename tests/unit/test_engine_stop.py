"""How `EngineProcess.stop` ends a server's process group (rollout/engines/engine.py).

A CUDA server gets SIGTERM and its grace (SGLang's own exit lets each scheduler free its GPU memory);
a CPU server has nothing to free and is killed at once (SGLang's exit costs about 6 s, paid at every
service stop). Either way no process of the group is left.

The server here is a stand-in: a Python process leading its own group with one child, as SGLang's
server leads its scheduler and detokenizer, that notes a SIGTERM in a file before it exits. What is
checked is which signals reach the group, not SGLang.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.config import EngineConfig
from rollout.engines.engine import EngineProcess, _group_alive
from rollout.engines.sglang_cpu import ServerLaunch
from tests.waiting import wait_until

pytestmark = pytest.mark.unit

# The group leader: starts a child that waits for a signal in the same group, writes its pid, notes
# SIGTERM, waits for a signal.
LEADER = """
import signal, subprocess, sys
from pathlib import Path
out = Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
def on_term(*_):
    (out / "sigterm").write_text("seen")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
(out / "ready").write_text(str(child.pid))
signal.pause()
"""


def started_engine(tmp_path: Path, device: str) -> tuple[EngineProcess, int]:
    engine = EngineProcess(0, EngineConfig(), tmp_path / "model", log_dir=tmp_path / "logs")
    engine.launch = ServerLaunch(argv=[], env={}, device=device, sgl_kernel_stand_in=False)
    engine._proc = subprocess.Popen([sys.executable, "-c", LEADER, str(tmp_path)], start_new_session=True)
    wait_until(lambda: (tmp_path / "ready").is_file(), "the stand-in server and its child", timeout_s=60, interval_s=0.05)
    return engine, os.getpgid(engine._proc.pid)


def test_a_cpu_server_is_killed_at_once_and_leaves_no_process(tmp_path):
    engine, pgid = started_engine(tmp_path, "cpu")
    engine.stop()
    assert not (tmp_path / "sigterm").exists()  # no SIGTERM: SIGKILL to the whole group
    assert not _group_alive(pgid) and not engine.is_alive()


def test_a_cuda_server_gets_sigterm_and_its_grace_first(tmp_path):
    engine, pgid = started_engine(tmp_path, "cuda")
    engine.stop()
    assert (tmp_path / "sigterm").read_text() == "seen"  # its own exit ran
    assert not _group_alive(pgid)  # and its child, which outlives the leader, is gone too


def test_cpu_engines_run_at_the_configured_niceness_and_gpu_engines_at_the_services(tmp_path):
    from rollout.config import EngineConfig
    from rollout.engines.engine import EngineProcess
    from rollout.engines.sglang_cpu import ServerLaunch

    engine = EngineProcess(0, EngineConfig(cpu_nice=7), tmp_path / "model", log_dir=tmp_path)
    assert engine.cpu_nice == 0  # not started: nothing to lower
    engine.launch = ServerLaunch(argv=["x"], env={}, device="cpu", sgl_kernel_stand_in=False)
    assert engine.cpu_nice == 7
    engine.launch = ServerLaunch(argv=["x"], env={}, device="cuda", sgl_kernel_stand_in=False)
    assert engine.cpu_nice == 0
    with pytest.raises(ValueError, match="less than or equal to 19"):
        EngineConfig(cpu_nice=20)


def test_the_child_setup_lowers_the_childs_priority_and_its_autogroup(tmp_path):
    from rollout.engines.engine import _child_setup, share_autogroup_nice

    assert _child_setup(False, 0) is None
    child = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             start_new_session=True, preexec_fn=_child_setup(False, 5))
    try:
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 5
        group = Path(f"/proc/{child.pid}/autogroup")
        assert share_autogroup_nice(child.pid, 5) == group.exists()
        if group.exists():
            assert group.read_text().split()[-1] == "5"
    finally:
        child.communicate(b"", timeout=30)
