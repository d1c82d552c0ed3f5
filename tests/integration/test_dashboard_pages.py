"""The dashboard with a thousand adapters, in a real browser (headless Chromium, as in
test_dashboard_browser.py): the real app on loopback over a real controller and registry holding
1,024 runs (no runtime: the rows are what the registry says). The page fetches one page of 50
rows, not the fleet; its pager says where it is; a search (`#q=`, what the search box sends)
narrows the rows; `#offset=` turns to a later page."""

from __future__ import annotations

import pytest

from service.config.job import SlotCapacity
from tests.integration.api_world import TOKEN, make_world, serve
from tests.integration.test_dashboard_browser import CHROMIUM, DashboardDom, chromium

pytestmark = pytest.mark.integration

RUNS = 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from service.control.controller import Controller

    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run deploy/setup.sh as root (it installs Debian's chromium) "
                    "or apt-get install -y chromium")
    w = make_world(tmp_path_factory.mktemp("dash_pages"))
    controller = Controller(w.settings, SlotCapacity(num_slots=4, max_rank=16))
    cfg = w.rl_config(num_step=2)
    for i in range(RUNS):
        controller.register(f"run{i:04d}", cfg)
    try:
        with serve(controller, w.settings) as server:
            yield server
    finally:
        controller.close()


class PagerDom(DashboardDom):
    def handle_starttag(self, tag, attrs):
        super().handle_starttag(tag, attrs)
        a = {k: v or "" for k, v in attrs}
        if a.get("id") == "page":
            self.pager = a


def load(url: str) -> PagerDom:
    dom = PagerDom(chromium("--virtual-time-budget=5000", "--dump-dom", url))
    assert int(dom.status.get("data-polls", "0")) >= 1, f"the page never finished a poll: status {dom.status}"
    return dom


def test_a_page_of_rows_a_search_and_a_later_page(served):
    first = load(f"{served.url}/ui#token={TOKEN}")
    assert list(first.rows) == [f"run{i:04d}" for i in range(50)]
    assert first.pager["data-total"] == str(RUNS) and first.pager["data-offset"] == "0"
    assert len(first.charts["loss"]["data-series"].split(",")) == 10  # curves for the page's first 10
    found = load(f"{served.url}/ui#token={TOKEN}&q=RUN10")  # case-insensitive, like the search box
    assert list(found.rows) == [f"run10{i:02d}" for i in range(24)] and found.pager["data-total"] == "24"
    last = load(f"{served.url}/ui#token={TOKEN}&offset=1000")
    assert list(last.rows) == [f"run{i:04d}" for i in range(1000, RUNS)] and last.pager["data-offset"] == "1000"
