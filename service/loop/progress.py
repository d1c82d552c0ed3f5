"""Terminal output of batch mode: the live progress view and the final summary table.

`ProgressView` redraws (rich Live) one row per adapter run: state, step / total,
last reward, last loss, samples/s (over the last ~10 s). It is fed snapshots
(`update(refs)`) by whoever polls the registry, and is silent when the console
is not a terminal (CI logs, pipes): batch mode then prints only the summary.

`summarize(...)` builds the summary rows: steps, reward at the start and at the
end of training (mean over the first / last `window` steps that have a reward),
export path; `summary_table` renders them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.table import Column, Table

from service.registry.registry import AdapterRef, StepRecord

RATE_WINDOW_S = 10.0
REWARD_WINDOW = 5


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


class ProgressView:
    def __init__(self, console: Console | None = None, *, enabled: bool | None = None, title: str = "lorafleet") -> None:
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.title = title
        self._live: Live | None = None
        # registration id -> recent (time, samples_trained) points for samples/s
        self._history: dict[str, deque[tuple[float, int]]] = {}

    def __enter__(self) -> ProgressView:
        if self.enabled:
            self._live = Live(Table(title=self.title), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def samples_per_second(self, ref: AdapterRef, now: float) -> float | None:
        points = self._history.setdefault(ref.registration_id, deque())
        points.append((now, ref.samples_trained))
        while len(points) > 2 and now - points[0][0] > RATE_WINDOW_S:
            points.popleft()
        (t0, s0), (t1, s1) = points[0], points[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 1.0 else None

    def render(self, refs: Sequence[AdapterRef], now: float | None = None) -> Table:
        now = time.monotonic() if now is None else now
        table = Table("ADAPTER", "STATE", "STEP", "REWARD", "LOSS", "SAMPLES/S", title=self.title)
        for ref in refs:
            total = f"/{ref.total_steps}" if ref.total_steps is not None else ""
            rate = self.samples_per_second(ref, now)
            table.add_row(
                ref.name,
                ref.state.value + (f" ({ref.residency} #{ref.queue_position})" if ref.queue_position is not None else ""),
                f"{ref.step}{total}",
                _fmt(ref.last_metrics.get("reward_mean")),
                _fmt(ref.last_metrics.get("loss"), 4),
                _fmt(rate, 1),
            )
        return table

    def update(self, refs: Sequence[AdapterRef]) -> None:
        table = self.render(refs)
        if self._live is not None:
            self._live.update(table)


@dataclass(frozen=True)
class AdapterSummary:
    name: str
    state: str
    objective: str
    steps: int
    total_steps: int | None
    samples: int
    reward_start: float | None  # mean reward_mean of the first `window` steps that report one
    reward_end: float | None  # ... of the last `window` steps
    loss_start: float | None
    loss_end: float | None
    export_path: str | None
    failure_reason: str | None


def _window_mean(values: list[float], window: int, last: bool) -> float | None:
    if not values:
        return None
    part = values[-window:] if last else values[:window]
    return sum(part) / len(part)


def summarize(ref: AdapterRef, steps: list[StepRecord], window: int = REWARD_WINDOW) -> AdapterSummary:
    rewards = [s.metrics["reward_mean"] for s in steps if "reward_mean" in s.metrics]
    losses = [s.metrics["loss"] for s in steps if "loss" in s.metrics]
    return AdapterSummary(
        name=ref.name,
        state=ref.state.value,
        objective=ref.config.objective,
        steps=ref.step,
        total_steps=ref.total_steps,
        samples=ref.samples_trained,
        reward_start=_window_mean(rewards, window, last=False),
        reward_end=_window_mean(rewards, window, last=True),
        loss_start=_window_mean(losses, window, last=False),
        loss_end=_window_mean(losses, window, last=True),
        export_path=ref.export_path,
        failure_reason=ref.failure_reason,
    )


def summary_table(rows: Sequence[AdapterSummary], title: str = "lorafleet run: summary") -> Table:
    """Compact (fits 80 columns). start / end = mean over the first / last REWARD_WINDOW
    steps; export paths are printed below by `summary_lines`."""
    table = Table(Column("ADAPTER", no_wrap=True), Column("STATE", no_wrap=True), "STEPS", "SAMPLES",
                  "REWARD start", "REWARD end", "LOSS start", "LOSS end", title=title, caption=f"start / end: mean of the first / last {REWARD_WINDOW} steps")
    for r in rows:
        total = f"/{r.total_steps}" if r.total_steps is not None else ""
        table.add_row(r.name, r.state, f"{r.steps}{total}", str(r.samples), _fmt(r.reward_start),
                      _fmt(r.reward_end), _fmt(r.loss_start), _fmt(r.loss_end))
    return table


def summary_lines(rows: Sequence[AdapterSummary]) -> list[str]:
    """One line per adapter: its PEFT export folder, or why it has none."""
    out = []
    for r in rows:
        if r.failure_reason:
            out.append(f"{r.name}: FAILED: {r.failure_reason}")
        else:
            out.append(f"{r.name}: export {r.export_path or '- (not exported yet)'}")
    return out
