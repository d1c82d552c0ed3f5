"""The dashboard's serving side (api/ui.py): the page and its files, shipped in the package and
open; the fleet statistics route behind the REST API's token; nothing fetched from the network."""

from __future__ import annotations

import re
import tomllib

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.ui import STATIC_DIR
from service.config.settings import load_settings
from service.control.controller import Controller
from service.config.job import SlotCapacity
from service.loop.fleet_stats import FleetStats
from tests.paths import REPO

pytestmark = pytest.mark.unit

TOKEN = "ui-test-token-8a2b"
ROOT = REPO


@pytest.fixture
def served(tmp_path):
    """The real app over a real Controller (SQLite registry), with a recorder the test feeds."""
    # read_cache_s 0, read_stale_s 0: the test feeds the recorder and reads at once (the cache's own test: test_read_cache.py)
    settings = load_settings(state_dir=tmp_path / "state", data_roots=[tmp_path], api_token=TOKEN, read_cache_s=0, read_stale_s=0)
    controller = Controller(settings, SlotCapacity(num_slots=2, max_rank=8))
    stats = FleetStats()
    try:
        with TestClient(create_app(controller, settings, fleet_stats=stats)) as client:
            yield client, stats
    finally:
        controller.close()


def test_page_and_its_files_are_served_without_a_token(served):
    client, _ = served
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # every script and style sheet the page names is served, byte for byte the packaged file
    refs = re.findall(r'(?:src|href)="(ui/static/[^"]+)"', page.text)
    assert {"ui/static/app.js", "ui/static/style.css", "ui/static/vendor/uPlot.iife.min.js", "ui/static/vendor/uPlot.min.css"} <= set(refs)
    for ref in refs:
        r = client.get("/" + ref)
        assert r.status_code == 200, ref
        assert r.content == (STATIC_DIR / ref.removeprefix("ui/static/")).read_bytes(), ref
    assert client.get("/ui/static/nope.js").status_code == 404
    assert client.get("/ui/static/../app.py").status_code == 404  # no way out of the static folder


def test_fleet_stats_need_the_token(served):
    client, _ = served
    assert client.get("/v1/fleet/stats").status_code == 401
    wrong = client.get("/v1/fleet/stats", headers={"Authorization": "Bearer not-it"})
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    assert client.get("/v1/fleet/stats", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_fleet_stats_serve_the_recorder(served):
    client, stats = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    empty = client.get("/v1/fleet/stats", headers=auth).json()
    assert empty["rounds"] == 0 and empty["recent"] == []
    stats.record_round(collect_s=1.5, train_s=0.5, publish_s=0.25, checkpoint_s=0.0, steps=3, samples=24,
                       rollout_tokens=300, trained_tokens=340)
    body = client.get("/v1/fleet/stats", headers=auth).json()
    snap = stats.snapshot()
    assert body["rounds"] == 1 and body["steps"] == 3 and body["rollout_tokens"] == 300
    assert body["seconds"] == snap["seconds"] and body["fractions"] == pytest.approx(snap["fractions"])
    assert body["recent"][0]["collect_s"] == 1.5 and body["recent"][0]["trained_tokens"] == 340
    assert body["steps_per_min"] > 0 and body["rollout_tokens_per_s"] > 0


def test_the_route_is_in_the_api_schema_and_the_page_is_not(served):
    client, _ = served
    paths = client.get("/openapi.json").json()["paths"]
    assert "/v1/fleet/stats" in paths
    assert not any(p.startswith("/ui") for p in paths)


def test_the_page_fetches_nothing_from_the_network():
    for f in STATIC_DIR.rglob("*"):
        if f.suffix in (".html", ".js", ".css") and "vendor" not in f.parts:
            assert not re.search(r"https?://", f.read_text()), f"{f.name} refers to a network URL"
    page = (STATIC_DIR / "index.html").read_text()
    assert not re.search(r'(?:src|href)="(?!ui/static/)', page), "the page loads only its own packaged files"


def test_every_static_file_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["api"]
    files = [f.relative_to(STATIC_DIR.parent).as_posix() for f in STATIC_DIR.rglob("*") if f.is_file()]
    assert "static/vendor/uPlot.LICENSE" in files  # the vendored library ships with its licence
    shipped = {f.relative_to(STATIC_DIR.parent).as_posix() for p in patterns for f in STATIC_DIR.parent.glob(p)}  # as setuptools globs
    missing = sorted(set(files) - shipped)
    assert not missing, f"not in [tool.setuptools.package-data] api: {missing}"
