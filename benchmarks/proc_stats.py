"""What the benchmarks read from /proc (Linux): a process's resident memory and CPU time, and the
machine's CPU time by process role over a window (who took the 2 cores of the CPU machine)."""

from __future__ import annotations

import os
import re
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """VmRSS of `pid` in MiB (NaN once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used (its threads included, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def role(pid: int) -> str:
    """A short name for what `pid` is: Ray's process title up to the method (``ray::TrainerActor``),
    a Python process's module or script (``service.main``, ``pytest``), else its program's name."""
    argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    if not argv:
        return "[" + Path(f"/proc/{pid}/comm").read_text().strip().split("/")[0] + "]"  # a kernel thread
    head = argv[0]
    if head.startswith("ray::"):
        return re.split(r"[.\s]", head, maxsplit=1)[0]
    name = os.path.basename(head.split()[0])
    if name.startswith("python"):
        rest = argv[1:]
        if "-m" in rest and rest.index("-m") + 1 < len(rest):
            return rest[rest.index("-m") + 1]
        scripts = [a for a in rest if not a.startswith("-")]
        return os.path.basename(scripts[0]) if scripts else name
    return name


def autogroup_enabled() -> bool | None:
    """Whether Linux's autogroup scheduler is on (/proc/sys/kernel/sched_autogroup_enabled): it shares the
    cores between sessions (setsid) first, then between the processes of each; None where the kernel has none."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def steal_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of all cores so far (/proc/stat's first line: user, nice, system, idle,
    iowait, irq, softirq, steal; the guest times are inside user)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def cpu_by_pid() -> dict[int, tuple[str, float]]:
    """Every process of the machine: its role and CPU seconds so far (those that vanish while read are left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = (role(int(entry)), cpu_s(int(entry)))
            except (OSError, IndexError, ValueError):
                continue
    return out


def cores_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
                  floor: float = 0.01) -> dict[str, float]:
    """Cores each role used between two `cpu_by_pid` readings `seconds` apart, busiest first; roles under
    `floor` cores are summed as "other". A process born in the window counts from zero; one that died in it
    is missed (its time is not in /proc any more)."""
    used: dict[str, float] = {}
    for pid, (name, t1) in after.items():
        t0 = before[pid][1] if pid in before else 0.0  # a process may retitle itself (Ray's workers do)
        used[name] = used.get(name, 0.0) + max(t1 - t0, 0.0) / seconds
    return busiest_first(used, floor)


def busiest_first(per_role: dict[str, float], floor: float) -> dict[str, float]:
    """`per_role` rounded, largest first; roles under `floor` summed as "other" (always present, last)."""
    out, other = {}, 0.0
    for name, value in sorted(per_role.items(), key=lambda kv: -kv[1]):
        if value >= floor:
            out[name] = round(value, 3)
        else:
            other += value
    out["other"] = round(other, 3)
    return out


def waits_by_pid() -> dict[int, tuple[str, float, dict[str, tuple[float, float]]]]:
    """Every process: its role, the seconds its threads have waited on a run queue for a core so far
    (/proc/<pid>/task/<tid>/schedstat: on-CPU ns, run-queue wait ns, timeslices), and per thread name
    (comm; same-named threads summed) its (CPU s, wait s). A process whose threads wait is one the
    cores were too few for: where a window's contention fell."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid, threads, total = int(entry), {}, 0.0
        try:
            name = role(pid)
            for tid in os.listdir(f"/proc/{pid}/task"):
                run_ns, wait_ns, _ = (int(x) for x in Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                cpu, wait = threads.get(comm, (0.0, 0.0))
                threads[comm] = (cpu + run_ns / 1e9, wait + wait_ns / 1e9)
                total += wait_ns / 1e9
        except (OSError, IndexError, ValueError):
            continue
        out[pid] = (name, total, threads)
    return out


def waits_by_role(before: dict, after: dict, seconds: float, roles: tuple[str, ...] = (), floor: float = 0.01) -> dict:
    """Between two `waits_by_pid` readings `seconds` apart: each role's run-queue wait in thread-seconds a
    second (0.5: on average half a thread was ready to run but had no core), busiest first, small ones
    summed as "other"; and for `roles`, their threads' (cores used, waits) by thread name, the three
    that used and waited most (a process's serial path is one of its threads: the training loop, a rank;
    a client's CPU may be its Python loop's or its HTTP library's own threads)."""
    waits: dict[str, float] = {}
    threads: dict[str, dict[str, list[float]]] = {}
    for pid, (name, w1, th1) in after.items():
        w0, th0 = (before[pid][1], before[pid][2]) if pid in before else (0.0, {})
        waits[name] = waits.get(name, 0.0) + max(w1 - w0, 0.0) / seconds
        if name in roles:
            mine = threads.setdefault(name, {})
            for comm, (c1, x1) in th1.items():
                c0, x0 = th0.get(comm, (0.0, 0.0))
                acc = mine.setdefault(comm, [0.0, 0.0])
                acc[0] += max(c1 - c0, 0.0) / seconds
                acc[1] += max(x1 - x0, 0.0) / seconds
    top = {name: {comm: {"cores": round(c, 3), "waiting": round(x, 3)}
                  for comm, (c, x) in sorted(mine.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:3]}
           for name, mine in threads.items()}
    return {"by_process": busiest_first(waits, floor), "threads": top}
