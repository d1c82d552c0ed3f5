"""`lorafleet run` / `serve` refuse what cannot work before anything starts: exit 2 and a
message that names what was wrong (no Ray, no engine, no trainer is started here)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from api.cli.main import app
from service.cli import TINY_JOB

pytestmark = pytest.mark.unit


def _job(tmp_path, tiny_world, **adapter_over) -> str:
    job = yaml.safe_load(TINY_JOB.read_text())
    job["base_model"]["path"] = str(tiny_world / "model")
    for a in job["adapters"]:
        a["config"]["data"]["path"] = str(tiny_world / "data" / a["config"]["data"]["path"].rsplit("/", 1)[1])
    job["adapters"][0]["config"].update(adapter_over)
    job["service"] = {"state_dir": str(tmp_path / "state"), "data_roots": [str(tiny_world / "data")]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_bad_job_file_is_refused_with_the_field(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base_model: {path: /m}\nadapters:\n  - name: a\n    config: {rank: 0, data: {path: x.jsonl}}\n")
    result = CliRunner().invoke(app, [command, str(bad)])
    assert result.exit_code == 2
    assert "adapters.0.config.rank" in result.output and "greater than or equal to 1" in result.output


def test_adapter_data_outside_the_roots_is_refused_before_start(tmp_path, tiny_world):
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text((tiny_world / "data" / "digits.jsonl").read_text())
    result = CliRunner().invoke(app, ["run", _job(tmp_path, tiny_world, data={"path": str(outside)})])
    assert result.exit_code == 2, result.output
    assert "adapter 'digits' of the job: config.data.path" in result.output and "outside the allowed roots" in result.output


def test_state_dir_held_by_another_service_is_refused(tmp_path, tiny_world, monkeypatch):
    from service.fleet import startup as app_runtime
    from service.registry.registry import Registry

    monkeypatch.setattr(app_runtime, "STATE_DIR_WAIT_S", 0.5)

    held = Registry(tmp_path / "state" / "registry.sqlite3", 4)  # as a running service holds it
    try:
        result = CliRunner().invoke(app, ["run", _job(tmp_path, tiny_world)])
    finally:
        held.close()
    assert result.exit_code == 2, result.output
    assert "is in use by another running lorafleet service" in result.output
