"""Stopping like a service (issue 24 item 6): a SIGTERM to the service's whole process group (what
systemd and shell job control send) and a SIGTERM to its main process both drain and exit 0, and
leave no process behind.

Real `lorafleet serve` (Ray, trainer actor, one SGLang CPU engine) in a session of its own; an SFT
run trains; then the signal. Checked: exit code 0; the run's checkpoint recorded at the drain is its
last step (read from the registry the service left); every process the service had (the
coordinator's descendants, Ray's and the engine's among them) is gone. The time from the signal to
the exit is printed (measured, not asserted: timings go to docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.integration.service_world import Service, registry_left_in, serve_job, sft, wait_for
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def _cmd(p: psutil.Process) -> str:
    """Its command line; "" once it has ended (a zombie's command line cannot be read)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has ended; only its parent's wait is missing)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# "main process" (what a supervisor such as Kubernetes or systemd signals) in the default tier; the
# whole process group, the same drain with every child signalled too, opt-in (-m slow: CI budget).
@pytest.mark.parametrize("how", [pytest.param("process group", marks=pytest.mark.slow), "main process"])
def test_sigterm_drains_exits_0_and_leaves_no_process(how, tiny_world, tmp_path):
    svc = Service(serve_job(tmp_path, tiny_world), tmp_path / "state", tmp_path / "serve.log")
    svc.start(new_session=True)
    try:
        with svc.client() as client:
            client.register("s", sft(tiny_world, checkpoint_interval=0))
            wait_for(client, "s", lambda r: r["step"] >= 2, "two steps")
        # what must be gone after; the engine may still be starting (the trainer serves before it is up)
        procs = wait_until(lambda: (ps := _tree(svc.proc.pid)) and all(r in " ".join(_cmd(p) for p in ps) for r in
                                                                       ("raylet", "gcs_server", "sglang_server")) and ps,
                           "Ray and the SGLang engine running", 300, interval_s=0.5)
        t0 = time.monotonic()
        if how == "process group":
            os.killpg(os.getpgid(svc.proc.pid), signal.SIGTERM)
        else:
            svc.proc.send_signal(signal.SIGTERM)
        rc = svc.proc.wait(300)
        took = time.monotonic() - t0
        print(f"SIGTERM to the {how}: exit {rc} after {took:.1f} s")
        assert rc == 0, svc.log_tail()
        wait_until(lambda: not any(_alive(p) for p in procs),
                   "every process of the service gone", timeout_s=120)
    finally:
        if svc.proc.poll() is None:
            os.killpg(os.getpgid(svc.proc.pid), signal.SIGKILL)
        for p in [p for p in psutil.process_iter() if "sglang_server" in _cmd(p) and str(tmp_path) in _cmd(p)]:
            p.kill()
    with registry_left_in(tmp_path / "state", 4) as registry:
        ref = registry.get("s")
    assert ref.state.value == "ACTIVE" and ref.checkpoint_step == ref.step >= 2, ref  # drained at its last step
