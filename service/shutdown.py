"""Graceful stop on Ctrl-C / SIGTERM: `StopSignal`.

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
