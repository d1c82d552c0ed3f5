"""An SGLang server whose port is taken before it binds it (real server, CPU, tiny model).

CI saw it: the engine picked a free port, another process took it during the ~15 s SGLang spends
loading, uvicorn logged "address already in use" and the server then hung in "application
shutdown" until the 300 s startup deadline. A picked port is now replaced by a fresh one; a
configured port in use is refused at once with a message naming engines.ports.

The race itself cannot be caused on demand, so the second test makes `pick_free_port` return a
port this test holds (a named fault injection); the server, the bind failure and the retry are real.
The engine it ends with is also measured (psutil, as tests/integration/test_ray_loopback.py does
for Ray): every port its processes listen on is on loopback (rollout/engines/sglang_server.py gives a
one-rank engine's torch.distributed group a FileStore; before, torch's TCPStore listened on `::`).
The first test also checks the engine's scratch folder: SGLang's socket files and FileStore go there,
the folder names its server's process group, the start swept a planted folder of an ended group (what
a killed coordinator's reaped engine leaves), and the stop removes it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollout.engines.engine as engine_mod
from rollout.config import EngineConfig
from rollout.engines.engine import SCRATCH_OWNER, SCRATCH_PREFIX, EngineProcess, EngineStartError
from tests.integration.net_probe import is_loopback, listeners
from tests.integration.sglang_fixtures import DEFAULT_ENGINE
from tests.proc_probes import group_pids, thread_niceness
from tests.waiting import wait_until


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port this test listens on for its whole life."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_configured_port_in_use_is_refused_with_the_setting_named(tiny_world, tmp_path, held_port):
    cfg = EngineConfig(**{**DEFAULT_ENGINE, "ports": [held_port]})
    engine = EngineProcess(0, cfg, tiny_world / "model", log_dir=tmp_path)
    # what a killed coordinator's reaped engine leaves: its scratch folder, its process group gone
    ended = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ended.wait()
    left = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}0-"))
    (left / SCRATCH_OWNER).write_text(str(ended.pid))
    try:
        engine.start()
        scratch = engine.scratch
        assert not left.exists()  # the start swept it
        assert (scratch / SCRATCH_OWNER).read_text() == str(engine.pid)  # and names its own server's group
        # the one-rank process group's FileStore (made before the bind) goes into this start's scratch folder
        wait_until(lambda: list(scratch.glob("lorafleet-sglang-store-*/store")),
                   "the scheduler's FileStore in the engine's scratch folder", timeout_s=300, interval_s=0.2)
        # every thread of every process of the server (its scheduler included) runs at the CPU engines'
        # niceness, and so does its session's autogroup where the kernel has one (engines.cpu_nice)
        niceness = {(pid, tid): nice for pid in group_pids(engine.pid) for tid, nice in thread_niceness(pid).items()}
        assert cfg.cpu_nice == 10  # the default
        assert len({pid for pid, _ in niceness}) >= 2 and set(niceness.values()) == {10}, niceness
        autogroup = Path(f"/proc/{engine.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "10", autogroup.read_text()
        # and so do SGLang's ZeroMQ socket files (NamedTemporaryFile(delete=False): it never removes them)
        assert len([p for p in scratch.iterdir() if p.name.startswith("tmp")]) >= 3, sorted(scratch.iterdir())
        with pytest.raises(EngineStartError, match=rf"could not bind 127\.0\.0\.1:{held_port}.*engines\.ports"):
            engine.wait_ready()
        assert not engine.is_alive()
    finally:
        engine.stop()
        shutil.rmtree(left, ignore_errors=True)
    assert not scratch.exists() and engine.scratch is None  # the stop removed them (they used to stay in /tmp)


# Opt-in (-m slow, CI budget: about 100 s on 2 cores for two engine starts); the refusal case above
# stays in the default tier.
@pytest.mark.slow
def test_picked_port_taken_before_bind_is_replaced(tiny_world, tmp_path, held_port, monkeypatch):
    picks = iter([held_port])
    real_pick = engine_mod.pick_free_port
    # Fault injection: the first pick returns a port that is already taken; later picks are real.
    monkeypatch.setattr(engine_mod, "pick_free_port", lambda host="127.0.0.1": next(picks, None) or real_pick(host))
    engine = EngineProcess(0, EngineConfig(**DEFAULT_ENGINE), tiny_world / "model", log_dir=tmp_path)
    try:
        engine.start()
        assert engine.port == held_port
        engine.wait_ready()
        assert engine.port != held_port
        assert engine.starts == 2
        assert engine_mod.PORT_IN_USE_MARK in engine.log_path.read_text(errors="replace")
        found = listeners(engine.pid)
        assert any(port == engine.port for _, _, port in found), found  # the measurement sees the server
        assert all(is_loopback(ip) for _, ip, _ in found), f"an engine process listens off loopback: {found}"
    finally:
        engine.stop()

