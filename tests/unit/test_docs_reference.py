"""The generated reference pages match the code they are generated from (no drift)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


@pytest.mark.parametrize("page", sorted(gen.PAGES))
def test_reference_page_is_up_to_date(page):
    path = gen.DOCS / page
    stale = gen.stale_pages({path: gen.PAGES[page]()})
    assert not stale, (
        f"docs/{page} is out of date with the code it documents. Regenerate it with\n"
        f"    {gen.REGENERATE}\nand commit the result. Difference:\n{stale.get(path, '')}"
    )


def test_generator_check_mode_catches_an_edit(tmp_path, monkeypatch):
    # --check must fail on a hand edit and pass on a fresh rendering: the drift test can fail.
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    assert gen.main([]) == 0
    page = tmp_path / "reference" / "job-file.md"
    assert gen.main(["--check"]) == 0
    page.write_text(page.read_text().replace("| `base_model` |", "| `base_modell` |"))
    assert gen.main(["--check"]) == 1


def test_job_file_reference_documents_every_field():
    from service.config.job import JobConfig
    from service.config.settings import ServiceSettings

    text = (gen.DOCS / "reference" / "job-file.md").read_text()
    for name in JobConfig.model_fields:
        assert f"| `{name}` |" in text
    for name in ServiceSettings.model_fields:
        assert f"`LORAFLEET_{name.upper()}`" in text
    assert "## PlacementConfig" in text and "## AdapterConfig" in text


def test_rest_reference_lists_every_route_with_its_auth():
    text = (gen.DOCS / "reference" / "rest.md").read_text()
    app = gen._docs_app("probe")
    for path, item in app.openapi()["paths"].items():
        for method in item:
            assert f"### {method.upper()} {path}\n" in text
    # Auth as the app enforces it (probed, not remembered): tenant routes closed, liveness open.
    assert "| POST | [`/v1/adapters`](#post-v1adapters) | Register an adapter run (PENDING) | token |" in text
    assert "| GET | [`/health`](#get-health) | Process alive | open |" in text
