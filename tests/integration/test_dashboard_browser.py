"""The dashboard in a real browser: headless Chromium (Debian's `chromium`) loads /ui of a live
`lorafleet serve` (real CLI process: Ray, one SGLang CPU engine, the trainer, REST API with a
token) that trains three adapters (two RL, one SFT), and reads the page's DOM:

  * the table shows the three adapters, their state and step, and the curves have one series
    per adapter with points;
  * a later load shows more steps and more points (the page follows training);
  * a screenshot is saved (the test's tmp dir, copied to a path printed in the output).

The page takes the token from `#token=...`, as a script would pass it. The DOM carries
data-* attributes with what the page shows (api/static/app.js), which is what is compared.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.integration.service_world import TOKEN, UNTIL_RETIRED, rl, running_service, sft, wait_for

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NAMES = ("digits", "vowels", "kinds")
CURVES_OF_ALL = ("loss", "grad_norm", "learning_rate")  # every adapter reports these at every step
CURVES_OF_RL = ("reward", "staleness")


class DashboardDom(HTMLParser):
    """What the dumped DOM shows: table rows and chart containers, by their data-* attributes."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.charts: dict[str, dict[str, str]] = {}
        self.kpis: dict[str, str] = {}
        self.canvases = 0
        self.status: dict[str, str] = {}
        self._kpi: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-adapter" in a:
            self.rows[a["data-adapter"]] = a
        elif "data-chart" in a:
            self.charts[a["data-chart"]] = a
        elif "data-kpi" in a:
            self._kpi = a["data-kpi"]
        elif a.get("id") == "status":
            self.status = a
        if tag == "canvas":
            self.canvases += 1

    def handle_data(self, data: str) -> None:
        if self._kpi is not None:
            self.kpis[self._kpi] = data.strip()
            self._kpi = None

    def points(self, chart: str) -> int:
        return int(self.charts[chart]["data-points"])


def chromium(*args: str, timeout_s: float = 180) -> str:
    # A profile of its own per call; --no-sandbox because tests may run as root (CI containers).
    with tempfile.TemporaryDirectory(prefix="lorafleet-chromium-") as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1400,2000", *args],
            capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout


def load(url: str) -> DashboardDom:
    # Virtual time runs the page's 2 s polling (a few polls) without waiting for it in real
    # time; it pauses while requests are in flight, so every poll's answers arrive.
    dom = DashboardDom(chromium("--virtual-time-budget=7000", "--dump-dom", url))
    assert int(dom.status.get("data-polls", "0")) >= 1, f"the page never finished a poll: status {dom.status}"
    return dom


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run deploy/setup.sh as root (it installs Debian's chromium) "
                    "or apt-get install -y chromium")
    with running_service(tmp_path_factory.mktemp("dashboard"), tiny_world) as svc:
        with svc.client() as c:
            c.register("digits", rl(tiny_world))
            c.register("vowels", rl(tiny_world, name="vowels"))
            # the SFT adapter needs no engine: its 1,000 default steps ran out while the engine started on a busy
            # machine (58 s: the first test then saw it COMPLETED); it trains until the module's service stops
            c.register("kinds", {**sft(tiny_world, num_step=UNTIL_RETIRED),
                                 "data": {"path": str(tiny_world / "data" / "kinds_sft.jsonl")}})
        yield svc


def steps_now(service) -> dict[str, int]:
    with service.client() as c:
        return {a["name"]: a["step"] for a in c.list()}


def wait_steps(service, at_least: dict[str, int]) -> None:
    with service.client() as c:
        for name, n in at_least.items():
            wait_for(c, name, lambda r, n=n: r["step"] >= n, f"step {n}")


def test_dashboard_shows_three_training_adapters_and_follows_them(service, tmp_path):
    url = f"{service.url}/ui#token={TOKEN}"
    wait_steps(service, dict.fromkeys(NAMES, 2))
    t0 = time.monotonic()
    first = load(url)
    load_s = time.monotonic() - t0

    assert set(first.rows) == set(NAMES), f"table rows: {sorted(first.rows)}"
    assert {r["data-state"] for r in first.rows.values()} == {"ACTIVE"}
    assert all(int(r["data-step"]) >= 2 for r in first.rows.values()), first.rows
    for chart in (*CURVES_OF_ALL, *CURVES_OF_RL, "kl", "tokens_per_s"):
        assert first.charts[chart]["data-series"].split(",") == sorted(NAMES), (chart, first.charts[chart])
    for chart in CURVES_OF_ALL:
        assert first.points(chart) >= 2 * len(NAMES), (chart, first.charts[chart])
    for chart in CURVES_OF_RL:
        assert first.points(chart) >= 2 * 2, (chart, first.charts[chart])  # the two RL adapters
    assert first.canvases >= len(CURVES_OF_ALL) + len(CURVES_OF_RL), "uPlot drew no charts"

    # Training goes on; a later load shows it.
    wait_steps(service, {n: int(first.rows[n]["data-step"]) + 2 for n in NAMES})
    second = load(url)
    for name in NAMES:
        assert int(second.rows[name]["data-step"]) > int(first.rows[name]["data-step"]), name
    for chart in (*CURVES_OF_ALL, *CURVES_OF_RL):
        assert second.points(chart) > first.points(chart), chart

    shot = tmp_path / "dashboard.png"
    chromium("--virtual-time-budget=7000", f"--screenshot={shot}", url)
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    keep = Path(os.environ.get("LORAFLEET_SCREENSHOT_DIR", tempfile.gettempdir())) / "lorafleet-dashboard.png"
    shutil.copyfile(shot, keep)
    print(f"dashboard screenshot: {keep} (load with polling: {load_s:.1f} s)")


def test_wrong_token_gets_the_login_form_and_no_data(service):
    html = chromium("--virtual-time-budget=4000", "--dump-dom", f"{service.url}/ui#token=not-the-token")
    dom = DashboardDom(html)
    assert dom.status.get("data-state") == "login", dom.status
    assert not dom.rows
    assert re.search(r'<form id="login"(?![^>]*hidden)', html), "the login form is not shown"
    assert "the API token was refused" in html


def test_fleet_view_counts_the_loops_rounds(service):
    wait_steps(service, dict.fromkeys(NAMES, 1))
    dom = load(f"{service.url}/ui#token={TOKEN}")
    assert int(dom.kpis["rounds"]) > 0 and int(dom.kpis["steps"]) >= len(NAMES), dom.kpis
    assert dom.points("round_time") > 0


def test_kl_and_tokens_per_second_curves_have_points(service):
    wait_steps(service, dict.fromkeys(NAMES, 3))
    dom = load(f"{service.url}/ui#token={TOKEN}")
    assert dom.points("kl") >= 2 * 2 and dom.points("tokens_per_s") >= 2 * len(NAMES)
