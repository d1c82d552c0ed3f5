"""Where the device sits idle in a profiled round: gaps between kernels, and what the host was doing.

Reads a torch.profiler Chrome trace (``prof.export_chrome_trace``; .json or .json.gz). Every gap
between one device activity's end and the next one's start is idle device time. Each gap is
charged to the host op that launched the next activity (its launch call, matched by correlation
id, inside the innermost CPU op around it on that thread), and classed:

* ``late launch``: the launch call began after the device had gone idle: the host was behind
  (launch latency, Python, a sync before it);
* ``queued``: the launch came before the gap began, so the device waited for something else (a
  stream wait, a copy) or the gap is the launch-to-run latency of an empty queue.

  python -m benchmarks.trace_gaps trace.json.gz      # prints the idle time by class and by host op
"""

from __future__ import annotations

import bisect
import gzip
import json
import sys
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def gaps(events: list[dict], min_us: float = 5.0) -> dict:
    """Idle device time of the trace: total, by class, by launching host op, and the largest gaps."""
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            ops_by_tid[e["tid"]].append(e)
    starts_by_tid = {}
    for tid, ops in ops_by_tid.items():
        ops.sort(key=lambda e: e["ts"])
        starts_by_tid[tid] = [e["ts"] for e in ops]

    def host_op(launch: dict | None) -> str:
        """``outermost > innermost`` of the CPU ops around the launch on its thread."""
        if launch is None:
            return "(no launch found)"
        ops, starts = ops_by_tid.get(launch["tid"], []), starts_by_tid.get(launch["tid"], [])
        i = bisect.bisect_right(starts, launch["ts"])
        around = [ops[j] for j in range(i - 1, max(i - 2000, -1), -1) if ops[j]["ts"] + ops[j].get("dur", 0) >= launch["ts"]]
        if not around:
            return "(outside any op)"
        inner, outer = around[0]["name"][:60], around[-1]["name"][:60]
        return inner if inner == outer else f"{outer} > {inner}"

    total, by_class, by_op, largest = 0.0, defaultdict(float), defaultdict(float), []
    end = dev[0]["ts"] + dev[0].get("dur", 0) if dev else 0.0
    for e in dev[1:]:
        gap = e["ts"] - end
        if gap >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            cls = "late launch" if launch is not None and launch["ts"] >= end else "queued"
            op = host_op(launch)
            total += gap
            by_class[cls] += gap
            by_op[f"{cls}: {op}"] += gap
            largest.append((gap, cls, op, e["name"][:60]))
        end = max(end, e["ts"] + e.get("dur", 0))
    span = (end - dev[0]["ts"]) if dev else 0.0
    largest.sort(reverse=True)
    top_ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    return {"span_ms": span / 1e3, "idle_ms": total / 1e3, "by_class_ms": {k: v / 1e3 for k, v in by_class.items()},
            "by_host_op_ms": {k: round(v / 1e3, 2) for k, v in top_ops},
            "largest_us": [(round(g), c, op, k) for g, c, op, k in largest[:12]]}


def report(summary: dict) -> str:
    lines = [f"device span {summary['span_ms']:.1f} ms, idle {summary['idle_ms']:.1f} ms "
             + ", ".join(f"{k} {v:.1f}" for k, v in summary["by_class_ms"].items())]
    lines += [f"  {v:6.2f} ms  {k}" for k, v in summary["by_host_op_ms"].items()]
    lines += [f"  gap {g} us ({c}) before {k!r}, launched in {op!r}" for g, c, op, k in summary["largest_us"]]
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p)
        print(report(gaps(load(p))))
