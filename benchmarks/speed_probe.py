"""How fast the machine's cores are during a window: a fixed unit of work timed in CPU time.

The 2-core development machine is a VM on a shared host. The same CPU-bound loop costs it from
10.7 to 17.4 ms of CPU time within one idle minute, and a benchmark's two windows of the same load a
quarter of an hour apart differed by 63% (issue 41, eleventh session: K = 64 at 296 and then 483
tenant-steps per minute). Such drift passes for the cost of whatever changed between the windows.

The probe is a child process that runs one fixed unit of pure-Python arithmetic every `period_s` and
prints the unit's CPU time (``time.thread_time``: the time the thread ran, so neither the other
processes' turns on the core nor the host's steal count in it; a core shared with a busy neighbour, a
lower clock or a cold cache do). It costs about 4% of one core (all three units). Its median over a window is that
window's `probe_ms`; a throughput times `probe_ms` is the throughput per unit of core speed, which
compares windows of different speed (`speed_adjusted`). It is a proxy: the service's own work
(torch kernels, the engines) need not slow exactly as a Python loop does, so the raw rates stay the
measurement and the adjusted ones their reading.

The service's own work is mostly small torch operations (the tiny world's trainer and engines: the
dispatcher, allocator and kernels over a few hundred KiB), and a window can be slower for it than for
the Python loop (issue 41, twenty-first session: a K = 64 window cost 38% more CPU a tenant-step while
the probe was 10% slower). So each sample also times a second fixed unit, `torch_unit` (a small MLP's
forward and backward, one thread): `torch_probe_ms`, and a third, `mem_unit` (random reads over a
buffer twice the host's L3, so most miss it: the memory's speed under the neighbours' load):
`mem_probe_ms`; readings beside `probe_ms`, not folded into `speed_adjusted`.

Also here: the host's steal time over a window (/proc/stat), the share of the cores' time the
hypervisor ran something else.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.proc_stats import steal_jiffies

UNIT_ITERATIONS = 200_000  # ~11 ms of CPU on the development machine's cores
TORCH_PASSES = 40  # forward + backward passes of the torch unit (~6 ms of CPU on the same cores)
MEM_WORDS = 8 << 20  # the memory unit's buffer: 64 MiB of int64, twice the development machine's 32 MiB L3
MEM_READS = 1 << 19  # random reads a memory unit (the same fixed indices every time; ~4 ms)
REPO = Path(__file__).resolve().parents[1]


def unit() -> int:
    """The fixed unit of work."""
    s = 0
    for i in range(UNIT_ITERATIONS):
        s += i * i
    return s


def torch_model(seed: int = 0) -> tuple:
    """The torch unit's model and batch (built once per probe): 64 -> 256 -> 64, a batch of 16, fp32."""
    import torch

    torch.set_num_threads(1)  # the unit's work on one core, as the probe's other unit
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, torch.randn(16, 64, generator=gen)


def torch_unit(parts: tuple) -> float:
    """The fixed unit of torch work: `TORCH_PASSES` forward and backward passes (gradients cleared each)."""
    model, x = parts
    loss = 0.0
    for _ in range(TORCH_PASSES):
        model.zero_grad(set_to_none=True)
        out = model(x).square().mean()
        out.backward()
        loss = float(out.detach())
    return loss


def mem_buffers(seed: int = 0) -> tuple:
    """The memory unit's buffer (0..n-1) and its fixed random read indices (built once per probe)."""
    import numpy as np

    return np.arange(MEM_WORDS, dtype=np.int64), np.random.default_rng(seed).integers(0, MEM_WORDS, MEM_READS)


def mem_unit(buffers: tuple) -> int:
    """The fixed unit of memory-bound work: `MEM_READS` random reads of the buffer, summed."""
    buf, idx = buffers
    return int(buf[idx].sum())


class SpeedProbe:
    """The probe child for one window: `start()`, then `stop()` gives its reading."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.samples: list[float] = []  # the Python unit's CPU ms
        self.torch_samples: list[float] = []  # the torch unit's
        self.mem_samples: list[float] = []  # the memory unit's
        self.sampled = threading.Condition()  # notified at each sample (a waiter needs no polling)
        self.proc: subprocess.Popen | None = None

    def start(self) -> SpeedProbe:
        self.steal0 = steal_jiffies()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.speed_probe", str(self.period_s)],
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)  # found from any working folder
        self.reader = threading.Thread(target=self._read, name="speed-probe", daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            python_ms, torch_ms, mem_ms = (float(x) for x in line.split())
            with self.sampled:
                self.samples.append(python_ms)
                self.torch_samples.append(torch_ms)
                self.mem_samples.append(mem_ms)
                self.sampled.notify_all()

    def stop(self) -> dict:
        """{probe_ms: the median unit's CPU ms, torch_probe_ms and mem_probe_ms: the other units', probe_n:
        units timed, steal_frac: the hypervisor's share}."""
        self.proc.terminate()
        self.proc.wait(10)
        self.reader.join(10)
        (s0, t0), (s1, t1) = self.steal0, steal_jiffies()
        return {"probe_ms": _median(self.samples), "torch_probe_ms": _median(self.torch_samples),
                "mem_probe_ms": _median(self.mem_samples),
                "probe_n": len(self.samples),
                "steal_frac": round((s1 - s0) / (t1 - t0), 4) if t1 > t0 else None}


def _median(samples: list[float]) -> float | None:
    """A unit's reading over a window: the median of its samples' CPU ms (None: none came)."""
    return round(statistics.median(samples), 2) if samples else None


def _child(period_s: float) -> None:
    parts, buffers = torch_model(), mem_buffers()
    torch_unit(parts)  # warm: the first pass allocates and picks kernels
    while True:
        t = time.thread_time()
        unit()
        t_torch = time.thread_time()
        torch_unit(parts)
        t_mem = time.thread_time()
        mem_unit(buffers)
        t_end = time.thread_time()
        print(f"{1e3 * (t_torch - t):.3f} {1e3 * (t_mem - t_torch):.3f} {1e3 * (t_end - t_mem):.3f}", flush=True)
        time.sleep(period_s)


if __name__ == "__main__":
    _child(float(sys.argv[1]))
