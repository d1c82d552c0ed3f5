"""Graceful stop on Ctrl-C / SIGTERM: `StopSignal`; and Ray's processes kept out of the
service's process group (`ray_processes_in_their_own_groups`).

The first SIGINT or SIGTERM only sets the flag: the loop finishes (or abandons) its
current round, drains (stops generation, saves every live run's checkpoint) and
returns, so the process exits with every adapter resumable. A second signal
raises KeyboardInterrupt at once (the operator insists; the `finally` blocks still
stop the engines and Ray). Handlers are installed only in the main thread and
restored on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class StopSignal:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`, waking early on a stop request; True if stopping."""
        return self._event.wait(timeout_s)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set():
            raise KeyboardInterrupt(f"second {name}: stopping without draining")
        self.request(f"{name} received: draining (a second signal stops at once)")

    def install(self) -> None:
        """(Re)install the handlers. Call again after `ray.init`: it replaces the SIGTERM
        handler (and the core worker's C++ one aborts the process on SIGTERM)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)

    def __enter__(self) -> StopSignal:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@contextmanager
def ray_processes_in_their_own_groups() -> Iterator[None]:
    """While a local Ray starts here (ray.init): its processes (GCS, raylet, agents) each lead a process
    group of their own, so a SIGTERM to the service's process group (what systemd and shell job
    control send) reaches only the coordinator, which drains through a Ray that is still up and then
    stops Ray itself (ray.shutdown ends those processes, and they die with the coordinator anyway:
    Ray starts them with kernel fate-sharing). Without it, the group signal kills the GCS at once and
    the drain waits a minute for "Failed to connect to GCS" (issue 24 item 6). Ray's workers are
    started by the raylet, in groups of their own already.

    Ray starts its processes through ``ray._private.services.ConsolePopen`` (a subprocess.Popen): a
    private name of Ray, replaced only while this block runs; re-check on a Ray upgrade
    (tests/integration/test_service_stop.py fails if it stops working)."""
    import ray._private.services as services

    base = services.ConsolePopen

    class OwnGroupPopen(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003 - Popen's
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = base
