"""Waiting on a condition in unit tests: poll it until it holds, failing at a generous deadline
(never a sleep standing in for synchronization)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str = "the condition", timeout_s: float = 60.0,
               interval_s: float = 0.005) -> object:
    """The condition's first true value (asked every `interval_s`: longer for a condition that costs an HTTP call)."""
    deadline = time.monotonic() + timeout_s
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)  # the poll interval
    return got
