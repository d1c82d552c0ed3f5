"""What a test reads of other processes through /proc (Linux): the processes of a process group and
each thread's niceness. One home for both, so tests that check where a process runs read it alike."""

from __future__ import annotations

import contextlib
import os


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # gone between the listing and the lookup
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
    return out


def thread_niceness(pid: int) -> dict[int, int]:
    """The niceness of every thread of process `pid`, by thread id (on Linux niceness is per thread:
    getpriority on a thread id reads that thread's own)."""
    return {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
