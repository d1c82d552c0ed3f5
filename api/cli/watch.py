"""`lorafleet adapters watch`: a live terminal table of the adapters, with sparklines of
their reward and loss, polling the REST API (api/cli/client.py) every `interval_s` seconds.

`render(adapters, series)` builds the table from the API's JSON (GET /v1/adapters and
GET /v1/adapters/{name}/metrics) and is all the drawing there is; `watch(...)` polls and
redraws it with rich's Live until Ctrl-C (or once, with `once=True`, for scripts and
pipes). A poll that fails (service restarting) shows its error under the table and
the next poll tries again; an unknown adapter or a refused token ends the watch.

Sparklines: the newest `SPARK_WIDTH` steps, one block character per step, scaled
between the minimum and maximum of the values shown (a flat series draws mid-height
blocks); a step without the metric is a space.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from api.cli.client import ApiError, ApiUnreachable, LorafleetClient

BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24


def sparkline(values: Sequence[float | None], width: int = SPARK_WIDTH) -> str:
    """The last `width` values as block characters (see the module doc)."""
    shown = list(values)[-width:] if width > 0 else []
    finite = [v for v in shown if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(shown)
    lo, hi = min(finite), max(finite)
    out = []
    for v in shown:
        if v is None or not math.isfinite(v):
            out.append(" ")
        elif hi == lo:
            out.append(BLOCKS[len(BLOCKS) // 2 - 1])
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / (hi - lo) * len(BLOCKS)))])
    return "".join(out)


def _fmt(x: Any, digits: int = 3) -> str:
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}g}" if 0 < abs(x) < 1e-3 else f"{x:.{digits}f}"


def _fmt_sig(x: Any, digits: int = 2) -> str:
    """Significant digits (a learning rate: 0.003, 3e-05)."""
    return f"{x:.{digits}g}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def render(adapters: Sequence[Mapping[str, Any]], series: Mapping[str, Sequence[Mapping[str, Any]]],
           *, width: int = SPARK_WIDTH, title: str = "lorafleet adapters") -> Table:
    """One row per adapter: the API's adapter fields and sparklines of its metrics series."""
    table = Table(Column("ADAPTER", no_wrap=True), Column("STATE", no_wrap=True), Column("STEP", justify="right"),
                  Column("SAMPLES", justify="right"), Column("REWARD", justify="right"), Column("reward", no_wrap=True),
                  Column("LOSS", justify="right"), Column("loss", no_wrap=True), Column("LR", justify="right"),
                  Column("STALE", justify="right"), Column("SLOT", justify="right"), title=title)
    for a in adapters:
        steps = series.get(a["name"], [])
        metrics = a.get("last_metrics") or {}
        total = f"/{a['total_steps']}" if a.get("total_steps") is not None else ""
        slot = f"{a['slot']}" if a.get("slot") is not None else (f"q{a['queue_position']}" if a.get("queue_position") is not None else "-")
        style = {"FAILED": "red", "COMPLETED": "green"}.get(a["state"], "")
        table.add_row(
            a["name"], Text(a["state"], style=style), f"{a['step']}{total}", str(a.get("samples_trained", 0)),
            _fmt(a.get("last_reward")), Text(sparkline([s.get("reward_mean") for s in steps], width), style="cyan"),
            _fmt(a.get("last_loss"), 4), Text(sparkline([s.get("loss") for s in steps], width), style="magenta"),
            _fmt_sig(metrics.get("learning_rate")), _fmt(metrics.get("staleness_mean"), 2), slot,
        )
    return table


def poll(client: LorafleetClient) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The adapters and each one's metrics series, as the API serves them."""
    adapters = client.list()
    return adapters, {a["name"]: client.metrics(a["name"])["steps"] for a in adapters}


def watch(client: LorafleetClient, *, interval_s: float = 2.0, once: bool = False, console: Console | None = None,
          width: int = SPARK_WIDTH, sleep: Callable[[float], None] = time.sleep) -> None:
    """Redraw the table every `interval_s` until Ctrl-C; `once`: print it one time and return.
    Raises ApiError for a refused token or request (4xx), so the CLI prints the server's message."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0 (got {interval_s})")
    console = console or Console()
    if once:
        console.print(render(*poll(client), width=width))
        return
    with Live(Text("connecting..."), console=console, refresh_per_second=4) as live:
        last: Table | None = None
        try:
            while True:
                try:
                    last = render(*poll(client), width=width, title=f"lorafleet adapters · {time.strftime('%H:%M:%S')}")
                    live.update(last)
                except ApiUnreachable as e:  # restarting service: keep the last table, say why it is old
                    note = Text(f"{e}; retrying every {interval_s:g} s", style="yellow")
                    live.update(Group(last, note) if last is not None else note)
                except ApiError as e:
                    if e.status >= 500:
                        note = Text(f"{e}; retrying", style="yellow")
                        live.update(Group(last, note) if last is not None else note)
                    else:
                        raise
                sleep(interval_s)
        except KeyboardInterrupt:
            pass
