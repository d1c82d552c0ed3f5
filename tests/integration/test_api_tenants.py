"""Tenant ownership on the REST API (issue 14, F5), against the real app served by uvicorn on
loopback over a real controller and SQLite registry, with two tenant keys and the admin token.

No runtime is attached; the test plays the training loop's part through the registry's own
methods (prepare, record steps and a checkpoint, end a retired run), so each run has the
record, series and checkpoint folder a trained run has. One served world for the module;
each test uses its own adapter names.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from api.tenant_keys import TenantKeys
from service.config.job import SlotCapacity
from service.registry.registry import AdapterState as S
from service.control.runtime_protocol import run_dir
from tests.integration.api_world import TOKEN, make_world, serve

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-0123456789", "bob": "tml-bob-0123456789"}
CAPACITY = SlotCapacity(num_slots=8, max_rank=16, max_live_runs=16)


class Tenants:
    def __init__(self, world, controller, url: str) -> None:
        self.world, self.controller, self.url = world, controller, url
        self.http = {who: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {cred}"}, timeout=10.0)
                     for who, cred in [("admin", TOKEN), *KEYS.items()]}

    def __call__(self, who: str, method: str, path: str, body: dict | None = None, status: int = 200) -> dict:
        r = self.http[who].request(method, path, json=body)
        assert r.status_code == status, f"{who} {method} {path} -> {r.status_code} {r.text[:500]}"
        return r.json()

    def names(self, who: str) -> list[str]:
        return [a["name"] for a in self(who, "GET", "/v1/adapters")["adapters"]]

    def trained(self, registration_id: str, steps: int) -> Path:
        """The loop's part: the run goes ACTIVE, commits `steps` steps and a checkpoint of the last."""
        reg = self.controller.registry
        reg.mark_prepared(registration_id, weight_version=reg.next_version())
        for step in range(1, steps + 1):
            reg.record_step(registration_id, step=step, samples=4, metrics={"loss": 1.0 / step})
        ref = reg.get_run(registration_id)
        folder = run_dir(self.world.settings.state_dir, ref) / "checkpoints" / f"step_{steps:08d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": steps}))
        reg.record_checkpoint(registration_id, str(folder), steps)
        return folder

    def ended(self, registration_id: str) -> None:
        """The reconcile's part for a retired run: CLEANUP, then COMPLETED."""
        self.controller.registry.transition(registration_id, S.CLEANUP)
        self.controller.registry.transition(registration_id, S.COMPLETED)


@pytest.fixture(scope="module")
def t(tmp_path_factory):
    from service.control.controller import Controller

    world = make_world(tmp_path_factory.mktemp("tenants"))
    controller = Controller(world.settings, CAPACITY)
    try:
        with serve(controller, world.settings, tenant_keys=TenantKeys(KEYS)) as server:
            tenants = Tenants(world, controller, server.url)
            yield tenants
            for c in tenants.http.values():
                c.close()
    finally:
        controller.close()


def register(t: Tenants, who: str, name: str, status: int = 201, **config) -> dict:
    return t(who, "POST", "/v1/adapters", {"name": name, "config": t.world.rl_config(**config)}, status)


def test_a_tenant_reads_and_manages_only_its_own_runs(t):
    a = register(t, "alice", "al-1")
    b = register(t, "bob", "bo-1")
    adm = register(t, "admin", "ad-1")
    assert (a["owner"], b["owner"], adm["owner"]) == ("alice", "bob", None)
    assert "bo-1" not in t.names("alice") and "ad-1" not in t.names("alice") and "al-1" in t.names("alice")
    assert "al-1" not in t.names("bob") and "bo-1" in t.names("bob")
    assert {"al-1", "bo-1", "ad-1"} <= set(t.names("admin"))

    before = t("bob", "GET", "/v1/adapters/bo-1")
    missing = "never-" + uuid.uuid4().hex[:8]
    # Another tenant's name is answered exactly like a name that does not exist (no existence leak).
    for method, suffix in [("GET", ""), ("GET", "/metrics"), ("GET", "/runs"), ("DELETE", ""), ("POST", "/abort")]:
        theirs = t("alice", method, f"/v1/adapters/bo-1{suffix}", status=404)
        nothing = t("alice", method, f"/v1/adapters/{missing}{suffix}", status=404)
        assert theirs == json.loads(json.dumps(nothing).replace(missing, "bo-1")), (method, suffix)
        assert t("alice", method, f"/v1/adapters/ad-1{suffix}", status=404)["error"] == "not_found"
    for suffix in ("", "/metrics"):
        theirs = t("alice", "GET", f"/v1/runs/{b['registration_id']}{suffix}", status=404)
        nothing = t("alice", "GET", f"/v1/runs/{'0' * 32}{suffix}", status=404)
        assert theirs == json.loads(json.dumps(nothing).replace("0" * 32, b["registration_id"]))
    assert t("bob", "GET", "/v1/adapters/bo-1") == before  # bob's run untouched by all of the above

    # a live name of another tenant: taken, without whose or which state
    taken = register(t, "alice", "bo-1", status=409)
    assert "is taken by a live run" in taken["detail"] and "bob" not in taken["detail"] and "PENDING" not in taken["detail"]

    # its owner and the admin manage it
    assert t("bob", "POST", "/v1/adapters/bo-1/abort")["aborted"] == 0
    assert t("admin", "GET", "/v1/adapters/bo-1")["owner"] == "bob"
    assert t("admin", "DELETE", "/v1/adapters/bo-1", status=202)["state"] == "RETIRING"
    assert t("bob", "DELETE", "/v1/adapters/al-1", status=404)["error"] == "not_found"
    assert t("alice", "DELETE", "/v1/adapters/al-1", status=202)["state"] == "RETIRING"


def test_start_paths_only_from_data_roots_and_own_runs(t):
    b = register(t, "bob", "bo-ck")
    ckpt = t.trained(b["registration_id"], steps=2)
    shown = t("bob", "GET", "/v1/adapters/bo-ck")["checkpoint_path"]  # as the API shows it: relative to the state dir
    assert shown == str(ckpt.relative_to(t.world.settings.state_dir)), shown
    before = t("bob", "GET", "/v1/adapters/bo-ck")
    alice_before = t.names("alice")

    # alice names bob's checkpoint, as shown or absolute: refused with what is allowed; nothing changes
    for path in (shown, str(ckpt)):
        err = register(t, "alice", "al-steal", status=400, resume_from=path)
        assert err["field"] == "config.resume_from" and "is not yours to start from" in err["detail"], err
        assert "shared data roots or one of its own runs' checkpoints" in err["detail"]
        assert str(t.world.settings.state_dir) not in json.dumps(err)  # no server path shown
    peft = run_dir(t.world.settings.state_dir, t.controller.registry.get_run(b["registration_id"])) / "export"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (peft / "adapter_model.safetensors").write_bytes(b"\0")
    err = register(t, "alice", "al-steal", status=400, init_from=str(peft))
    assert err["field"] == "config.init_from" and "is not yours to start from" in err["detail"], err
    assert t.names("alice") == alice_before
    assert t("bob", "GET", "/v1/adapters/bo-ck") == before
    assert t("admin", "GET", "/v1/adapters/al-steal", status=404)["error"] == "not_found"

    # a data root folder is shared; bob's own checkpoint is his; the admin may use any
    shared = t.world.root / "shared-peft"
    shared.mkdir()
    (shared / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (shared / "adapter_model.safetensors").write_bytes(b"\0")
    assert register(t, "alice", "al-shared", init_from="shared-peft")["config"]["init_from"] == "shared-peft"
    # a tenant's own Tinker sampler weights (PEFT folders under <state_dir>/tinker/<tenant>/) are its own too
    for who in ("alice", "bob"):
        sampler = t.world.settings.tinker_dir / who / "model_1" / "sampler_weights" / "w"
        sampler.mkdir(parents=True)
        (sampler / "adapter_config.json").write_text(json.dumps({"r": 8}))
        (sampler / "adapter_model.safetensors").write_bytes(b"\0")
    mine = register(t, "alice", "al-tinker", init_from="tinker/alice/model_1/sampler_weights/w")
    assert mine["config"]["init_from"] == "tinker/alice/model_1/sampler_weights/w"
    err = register(t, "alice", "al-tinker2", status=400, init_from="tinker/bob/model_1/sampler_weights/w")
    assert "is not yours to start from" in err["detail"], err
    t("bob", "DELETE", "/v1/adapters/bo-ck", status=202)
    t.ended(b["registration_id"])
    assert register(t, "bob", "bo-ck2", resume_from=shown)["config"]["resume_from"] == shown
    assert register(t, "admin", "ad-ck", resume_from=shown)["owner"] is None


def test_a_reregistered_name_keeps_its_earlier_runs_reachable(t):
    first = register(t, "bob", "bo-re")
    t.trained(first["registration_id"], steps=3)
    t("bob", "DELETE", "/v1/adapters/bo-re", status=202)
    t.ended(first["registration_id"])
    second = register(t, "bob", "bo-re")
    assert second["registration_id"] != first["registration_id"]

    runs = t("bob", "GET", "/v1/adapters/bo-re/runs")
    assert runs["name"] == "bo-re"
    assert [(r["registration_id"], r["state"], r["step"]) for r in runs["runs"]] == [
        (first["registration_id"], "COMPLETED", 3), (second["registration_id"], "PENDING", 0)]
    assert runs["runs"][0]["checkpoint_path"].endswith("step_00000003") and runs["runs"][0]["checkpoint_step"] == 3
    old = t("bob", "GET", f"/v1/runs/{first['registration_id']}")
    assert (old["state"], old["step"], old["samples_trained"], old["owner"]) == ("COMPLETED", 3, 12, "bob")
    series = t("bob", "GET", f"/v1/runs/{first['registration_id']}/metrics")
    assert (series["name"], [s["step"] for s in series["steps"]]) == ("bo-re", [1, 2, 3])
    assert series["steps"][2]["loss"] == pytest.approx(1 / 3)
    assert t("bob", "GET", "/v1/adapters/bo-re/metrics") == {"name": "bo-re", "registration_id": second["registration_id"], "steps": []}
    assert len(t("admin", "GET", "/v1/adapters/bo-re/runs")["runs"]) == 2
    assert t("alice", "GET", "/v1/adapters/bo-re/runs", status=404)["error"] == "not_found"
    assert t("alice", "GET", f"/v1/runs/{first['registration_id']}/metrics", status=404)["error"] == "not_found"


def test_credentials_and_operator_routes(t):
    assert t("alice", "GET", "/v1/fleet", status=403)["error"] == "forbidden"
    assert t("admin", "GET", "/v1/fleet")["processes"]
    assert t.http["alice"].get("/metrics").status_code == 403
    assert t.http["admin"].get("/metrics").status_code == 200
    assert "rounds" in t("alice", "GET", "/v1/fleet/stats")  # fleet totals, no names: any caller
    ready = t.http["alice"].get("/ready").json()  # a tenant gets the public view
    assert all(c.get("detail") is None for c in ready["components"].values()), ready
    with httpx.Client(base_url=t.url, timeout=10.0) as anon:
        r = anon.get("/v1/adapters", headers={"X-API-Key": KEYS["alice"]})  # the Tinker SDK's header works too
        assert r.status_code == 200 and "bo-1" not in [a["name"] for a in r.json()["adapters"]]
        for headers in ({"Authorization": "Bearer tml-unknown-0123456789"}, {"X-API-Key": "tml-unknown-0123456789"}, {}):
            r = anon.get("/v1/adapters", headers=headers)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"


def test_keys_without_an_admin_token_have_no_anonymous_admin(tmp_path):
    from service.control.controller import Controller

    world = make_world(tmp_path)
    settings = world.settings.model_copy(update={"api_token": None})
    controller = Controller(settings, CAPACITY)
    try:
        with serve(controller, settings, tenant_keys=TenantKeys(KEYS)) as server, httpx.Client(base_url=server.url) as http:
            r = http.get("/v1/adapters")
            assert r.status_code == 401 and "a tenant key of the keys file" in r.json()["detail"], r.text
            assert http.get("/v1/adapters", headers={"X-API-Key": KEYS["bob"]}).status_code == 200
    finally:
        controller.close()


def test_the_admin_token_may_not_be_a_tenant_key(tmp_path):
    from api.app import create_app

    world = make_world(tmp_path)
    settings = world.settings.model_copy(update={"api_token": SecretStr(KEYS["alice"])})
    with pytest.raises(ValueError, match="also the key of tenant 'alice'"):
        create_app(None, settings, tenant_keys=TenantKeys(KEYS))


def test_cli_with_a_tenant_key(t):
    from typer.testing import CliRunner

    from api.cli.main import app

    first = register(t, "alice", "al-cli")
    t("alice", "DELETE", "/v1/adapters/al-cli", status=202)
    t.ended(first["registration_id"])
    second = register(t, "alice", "al-cli")

    def cli(*args: str, env: dict[str, str]):
        result = CliRunner().invoke(app, list(args), env={"LORAFLEET_API_URL": t.url, "LORAFLEET_API_TOKEN": None, "COLUMNS": "200", **env})
        return result.exit_code, result.stdout, result.stderr

    code, out, err = cli("adapters", "runs", "al-cli", "--json", "--api-key", KEYS["alice"], env={})
    assert code == 0, err
    assert [r["registration_id"] for r in json.loads(out)] == [first["registration_id"], second["registration_id"]]
    code, out, err = cli("adapters", "runs", "al-cli", env={"TINKER_API_KEY": KEYS["alice"]})
    assert code == 0 and first["registration_id"] in out and "COMPLETED" in out, err
    code, out, err = cli("adapters", "ls", "--json", env={"TINKER_API_KEY": KEYS["bob"]})
    assert code == 0 and "al-cli" not in [a["name"] for a in json.loads(out)], err
    code, out, err = cli("adapters", "runs", "al-cli", env={"TINKER_API_KEY": KEYS["bob"]})
    assert code == 1 and "error 404 not_found" in err and "no adapter named 'al-cli'" in err
    code, out, err = cli("fleet", env={"TINKER_API_KEY": KEYS["bob"]})
    assert code == 1 and "error 403 forbidden" in err
