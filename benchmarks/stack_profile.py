"""Where a process spends its CPU over a benchmark's window: py-spy (it comes with
deploy/requirements.lock) samples the Python stacks of named processes without pausing them
(`--nonblocking`), idle threads left out, into py-spy's raw format (one line a distinct stack:
`frame;frame;... count`).

  profiles = StackProfiles(folder, "k1024", {"client": os.getpid(), "coordinator": pid}, seconds=60)
  ...                                  # the window runs
  profiles.wait(); top_self(profiles.paths["client"])

`top_self` reads a raw file back: each leaf function's share of the busy samples (its self time)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

PY_SPY = Path(sys.executable).with_name("py-spy")


class StackProfiles:
    def __init__(self, folder: Path, label: str, pids: dict[str, int], seconds: float, rate: int = 50) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = {name: folder / f"{label}-{name}.txt" for name in pids}
        self._procs = [subprocess.Popen([str(PY_SPY), "record", "--nonblocking", "--format", "raw", "--rate", str(rate),
                                         "--duration", str(max(1, round(seconds))), "--pid", str(pid), "--output", str(self.paths[name])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for name, pid in pids.items()]

    def wait(self, timeout_s: float = 120.0) -> None:
        for p in self._procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()


def _stacks(path: Path):  # noqa: ANN202 - yields (frames, samples)
    """Each line of a raw file: its frames, root first, and its sample count."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def top_self(path: Path, n: int = 25) -> list[tuple[str, float]]:
    """The `n` leaf frames with the most samples, each with its share of all samples in the file."""
    leaves: Counter = Counter()
    for frames, count in _stacks(path):
        leaves[frames[-1]] += count
    total = sum(leaves.values()) or 1
    return [(frame, round(c / total, 4)) for frame, c in leaves.most_common(n)]


def top_inclusive(path: Path, needle: str, n: int = 25) -> list[tuple[str, float]]:
    """The frames under which the samples fall, counting each stack once a frame (inclusive time),
    those whose text contains `needle` (a module path, say), with their share of all samples."""
    hits: Counter = Counter()
    total = 0
    for frames, count in _stacks(path):
        total += count
        for frame in set(frames):
            if needle in frame:
                hits[frame] += count
    return [(frame, round(c / max(total, 1), 4)) for frame, c in hits.most_common(n)]


if __name__ == "__main__":  # python -m benchmarks.stack_profile FILE [NEEDLE]
    for frame, share in (top_inclusive(Path(sys.argv[1]), sys.argv[2]) if len(sys.argv) > 2 else top_self(Path(sys.argv[1]))):
        print(f"{share:7.2%}  {frame}")
