"""`lorafleet adapters ...` and `lorafleet smoke` against the real app on loopback
(in-process CLI runner for speed, plus the installed console script once)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli.main import app
from api.cli.smoke import SmokeFailure, check_metrics
from tests.integration.api_world import TOKEN, served_world

pytestmark = pytest.mark.integration


@pytest.fixture
def service(tmp_path):
    with served_world(tmp_path) as (world, server):
        yield world, server.url


def cli(*args: str, url: str, token: str | None = TOKEN):
    env = {"LORAFLEET_API_URL": url}
    if token is not None:
        env["LORAFLEET_API_TOKEN"] = token
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_adapters_commands(service, tmp_path):
    world, url = service
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"data: {{path: {world.root / 'rl.jsonl'}}}\nreward: {{name: target_share}}\nrank: 4\n")

    code, out, err = cli("adapters", "add", "alpha", "--config", str(cfg), "--set", "num_step=7", "--set", "sampling.temperature=0.5", "--json", url=url)
    assert code == 0, err
    ref = json.loads(out)
    assert (ref["state"], ref["total_steps"], ref["config"]["rank"], ref["config"]["sampling"]["temperature"]) == ("PENDING", 7, 4, 0.5)

    code, out, _ = cli("adapters", "ls", url=url)
    assert code == 0 and "alpha" in out and "PENDING" in out and "0/7" in out
    code, out, _ = cli("adapters", "ls", "--state", "active", "--json", url=url)
    assert code == 0 and json.loads(out) == []
    code, out, _ = cli("adapters", "show", "alpha", "--metrics", "--json", url=url)
    assert code == 0 and json.loads(out)["metrics"]["steps"] == []
    code, out, _ = cli("adapters", "abort", "alpha", url=url)
    assert code == 0 and "alpha: aborted 0 in-flight request(s)" in out
    code, out, _ = cli("adapters", "rm", "alpha", "--json", url=url)
    assert code == 0 and json.loads(out)["state"] == "RETIRING"

    refusals = [
        (("adapters", "rm", "alpha"), TOKEN, "error 409 conflict: adapter 'alpha' is already retiring"),
        (("adapters", "add", "beta", "--config", str(cfg), "--set", "rank=64"), TOKEN, "error 400 bad_value: rank 64 is above the service's max rank 16"),
        (("adapters", "add", "beta", "--set", "rank=4"), TOKEN, "error 422 schema: config.data: Field required"),
        (("adapters", "show", "nobody"), TOKEN, "error 404 not_found: no adapter named 'nobody'"),
        (("adapters", "ls"), "wrong", "error 401 unauthorized: invalid bearer token"),
        (("adapters", "ls"), None, "error 401 unauthorized: missing bearer token"),
    ]
    for args, token, message in refusals:
        code, out, err = cli(*args, url=url, token=token)
        assert code == 1, (args, out, err)
        assert message in " ".join(err.split()), (args, err)


def test_adapters_watch_once_prints_the_table_and_a_bad_token_fails_cleanly(service, tmp_path):
    world, url = service
    cfg = tmp_path / "w.yaml"
    cfg.write_text(f"data: {{path: {world.root / 'rl.jsonl'}}}\nreward: {{name: target_share}}\nrank: 4\n")
    assert cli("adapters", "add", "watched", "--config", str(cfg), url=url)[0] == 0
    code, out, err = cli("adapters", "watch", "--once", url=url)
    assert code == 0, err
    assert "watched" in out and "PENDING" in out
    code, _, err = cli("adapters", "watch", "--once", url=url, token="wrong-token-of-16-chars")
    assert code == 1 and "error 401" in err, err


def test_fleet_lists_the_processes(service):
    _, url = service
    code, out, err = cli("fleet", "--json", url=url)
    assert code == 0, err
    # no runtime attached in this world: the coordinator (this process, serving the app) alone
    assert json.loads(out) == [{"name": "coordinator", "role": "coordinator", "pid": os.getpid(), "detail": "no runtime attached",
                                "node_id": "", "node_ip": ""}]  # no Ray here: the node is not known
    code, out, _ = cli("fleet", url=url)
    assert code == 0 and "coordinator" in out and str(os.getpid()) in out
    code, _, err = cli("fleet", url=url, token="wrong")
    assert code == 1 and "error 401 unauthorized" in " ".join(err.split())


def test_cli_unreachable_service_fails_cleanly():
    code, _, err = cli("adapters", "ls", "--timeout", "2", url="http://127.0.0.1:9")
    assert code == 1 and "cannot reach http://127.0.0.1:9" in err


def test_smoke_fails_clearly_when_trainer_is_not_running(service):
    world, url = service
    code, out, err = cli("smoke", "--ready-timeout", "1", "--poll", "0.2", "--data", str(world.root / "rl.jsonl"), url=url)
    text = " ".join(err.split())
    assert code == 1, out + err
    assert "smoke FAILED at ready: service not ready after 1 s: runtime: no runtime attached" in text
    code, out, err = cli("adapters", "ls", "--json", url=url)
    assert json.loads(out) == []  # it failed before registering anything


def test_console_script_version_and_ls(service):
    _, url = service
    exe = Path(sys.executable).with_name("lorafleet")
    env = {**os.environ, "LORAFLEET_API_URL": url, "LORAFLEET_API_TOKEN": TOKEN}
    version = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=60, env=env)
    assert version.returncode == 0 and version.stdout.startswith("lorafleet 0.")
    ls = subprocess.run([exe, "adapters", "ls", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert ls.returncode == 0 and json.loads(ls.stdout) == [], ls.stderr


def step(n, samples=8, loss=1.0, reward=0.1):
    return {"step": n, "samples": samples, "loss": loss, "reward_mean": reward}


@pytest.mark.parametrize(
    "rows, samples_trained, error",
    [
        ([step(1, loss=1.0), step(2, loss=0.8), step(3, loss=0.7)], 24, None),
        ([step(1), step(2)], 16, "metrics series has 2 rows, expected >= 3"),
        ([step(1), step(3), step(2)], 24, "not strictly increasing"),
        ([step(1), step(2, samples=0, loss=0.5), step(3)], 16, "a step trained on 0 samples"),
        ([step(1, loss=1.0), step(2, loss=0.8), step(3, loss=0.7)], 30, "samples_trained 30 != sum of per-step samples 24"),
        ([step(1), step(2), step(3)], 24, "metrics do not move"),
        ([step(1, loss=1.0), step(2, loss=math.nan), step(3, loss=0.7)], 24, "non-finite loss"),
    ],
)
def test_smoke_metric_checks(rows, samples_trained, error):
    ref = {"step": 3, "samples_trained": samples_trained}
    if error is None:
        assert check_metrics({"steps": rows}, ref, 3) == "loss 1 -> 0.7"
    else:
        with pytest.raises(SmokeFailure, match=error):
            check_metrics({"steps": rows}, ref, 3)
