"""The service on its storage (issue 44): what the service does with the store beyond the store itself
(tests/unit/test_store_conformance.py covers that), on a real SeaweedFS on loopback (tests/s3_server.py)
and on local folders:

  * the start-up checks (service/fleet/cluster_checks.py check_storage, check_storage_on_nodes over
    trainer/storage/locations.py check_location): a good location leaves no probe behind and clears this
    machine's staging leftovers; a wrong secret, an unknown bucket and a refused endpoint each refuse at
    once with the store's reason (never the secret), also from a Ray node whose environment is wrong;
  * which nodes need the state dir and which the store (state_dir_users, storage_users);
  * runs started from storage URLs (service/control/ownership.py: check_store_start, own_references,
    may_start_from) and export destinations (export_destination, check_export_to; copy_folder across
    stores); the retire check of an export by its manifest (committed_files);
  * Tinker's get_external_weights_urls answered with the object store's presigned URLs (the route over
    real TinkerRecords, TrainingRuns and tenant keys), downloaded straight from SeaweedFS.

Expected values are the test's own bytes and its own reading of the rules, never the product's answers.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import obstore
import pytest
from obstore.store import S3Store as RawClient

from service.errors import BadValue, PlacementError
from tests.s3_server import free_ports, seaweedfs
from trainer.storage import layouts
from trainer.storage.local_store import LocalStore
from trainer.storage.locations import check_location, committed_files, copy_folder, open_store
from trainer.storage.run_checkpoints import PendingCheckpoint, RunState
from trainer.storage.store import MANIFEST, StoreError

pytestmark = pytest.mark.integration  # starts a SeaweedFS server

PEFT = {"adapter_config.json": b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}',
        "adapter_model.safetensors": b"weights " * 100}


@pytest.fixture(scope="module")
def seaweed():
    with seaweedfs() as server:
        yield server


@pytest.fixture
def aws(seaweed, tmp_path, monkeypatch):
    """This process's environment pointed at the server (as a node's would be); a fresh prefix."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LORAFLEET_STORAGE_CACHE", str(tmp_path / "cache"))
    return f"s3://{seaweed.bucket}/wiring-{uuid.uuid4().hex[:8]}"


def raw_paths(seaweed, location: str) -> list[str]:
    raw = RawClient(seaweed.bucket, endpoint=seaweed.endpoint, region=seaweed.region, access_key_id=seaweed.access_key_id,
                    secret_access_key=seaweed.secret_access_key, client_options={"allow_http": True})
    prefix = location.split("/", 3)[3]
    return [o["path"] for batch in obstore.list(raw, prefix=prefix + "/") for o in batch]


def write(store, key: str, files: dict[str, bytes], children: tuple[str, ...] = ()) -> None:  # noqa: ANN001
    with store.write_folder(key, children=children) as d:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)


def read_all(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


# --- start-up checks -----------------------------------------------------------------------------------


def test_a_good_location_is_probed_and_its_staging_cleared(seaweed, aws, tmp_path):
    store = open_store(aws)
    leftover = store.staging()  # what a write cut short on this machine left
    (leftover / "half.bin").write_bytes(b"x")
    assert check_location(aws) is store
    assert not leftover.exists()
    assert raw_paths(seaweed, aws) == []  # the probe folder was written, read back and deleted
    local = tmp_path / "local-store"
    check_location(local)
    assert [p.name for p in local.iterdir()] == [".lorafleet-staging"] and not any((local / ".lorafleet-staging").iterdir())


@pytest.mark.parametrize("fault", ["wrong secret", "unknown bucket", "refused endpoint"])
def test_a_wrong_location_refuses_the_start_with_the_stores_reason(seaweed, aws, tmp_path, monkeypatch, fault):
    from service.config.settings import ServiceSettings
    from service.fleet.cluster_checks import check_storage

    location, reason = aws, None
    if fault == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + uuid.uuid4().hex)
        reason = "SignatureDoesNotMatch"
    elif fault == "unknown bucket":
        location, reason = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p", "NoSuchBucket"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    settings = ServiceSettings(state_dir=tmp_path / "state", storage=location, storage_cache=tmp_path / "node-cache")
    with pytest.raises(PlacementError) as err:
        check_storage(settings)
    text = str(err.value)
    assert text.startswith(f"service.storage: storage {location} is not usable from ") and "AWS_SECRET_ACCESS_KEY" in text
    assert reason is None or reason in text, text
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in text
    assert os.environ["LORAFLEET_STORAGE_CACHE"] == str((tmp_path / "node-cache").absolute())  # exported first


def test_a_node_whose_environment_is_wrong_is_named(seaweed, aws, monkeypatch):
    """check_storage_on_nodes runs the probe on the node, with the node's environment: a Ray node started
    with a wrong secret is refused by name, although this process's own environment is right."""
    from service.fleet.cluster_checks import check_storage_on_nodes
    from tests.local_ray import start_ray, stop_ray

    import ray

    good = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "node-secret-" + uuid.uuid4().hex)  # the node inherits this at its start
    start_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good)
        check_location(aws)  # this process reaches the store
        node = ray.get_runtime_context().get_node_id()
        with pytest.raises(PlacementError) as err:
            check_storage_on_nodes(aws, {node: "trainer ranks write there"}, {node: "node 1 (10.0.0.2)"})
    finally:
        stop_ray()
    text = str(err.value)
    assert "node 1 (10.0.0.2) (trainer ranks write there)" in text and "SignatureDoesNotMatch" in text, text
    assert "environment" in text and good not in text


def test_object_storage_takes_the_trainer_nodes_off_the_state_dir():
    from service.config.job import PlacementConfig
    from service.fleet.cluster_checks import state_dir_users, storage_users
    from service.fleet.placement import ClusterShape, plan_placement

    cluster = ClusterShape(node_gpus=(0, 0, 0), node_cpus=(0.0, 2.0, 2.0), node_ids=("h" * 56, "t" * 56, "e" * 56),
                           node_addresses=("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    plan = plan_placement(PlacementConfig(), cluster)  # trainer on node 1, engine on node 2 (the planner's CPU rule)
    trainer, engine = "t" * 56, "e" * 56
    assert set(state_dir_users(plan, "disk", "10.0.0.1")) == {trainer, engine}
    by_disk = state_dir_users(plan, "disk", "10.0.0.1", "s3://b/p")  # only the hand-off folders: rank 0 and the engines
    assert set(by_disk) == {trainer, engine} and "handoff" in by_disk[trainer] and "checkpoints" not in by_disk[trainer]
    assert state_dir_users(plan, "tensors", "10.0.0.1", "s3://b/p") == {}
    assert set(state_dir_users(plan, "tensors", "10.0.0.1", "/shared/store")) == {trainer}  # a local storage
    assert set(storage_users(plan, "h" * 56)) == {trainer} and storage_users(plan, trainer) == {}


# --- where runs start from and export to -------------------------------------------------------------


def committed_checkpoint(store, name: str, registration: str, step: int) -> str:  # noqa: ANN001
    with PendingCheckpoint(store, name, registration, step) as pending:
        write(store, pending.trainer_key, {"slot_state.json": b"{}"})
        write(store, pending.adapter_key, PEFT)
        pending.commit(RunState(name=name, registration_id=registration, objective="sft", rank=4, step=step,
                                samples_trained=4 * step))
    return store.url(pending.key)


def test_a_run_starts_from_urls_of_its_storage_and_a_tenant_from_its_own(seaweed, aws):
    from service.control.ownership import check_store_start, may_start_from, own_references

    store = open_store(aws)
    ckpt = committed_checkpoint(store, "a", "r1", 3)
    export = store.url(layouts.run_export("a", "r1"))
    store.copy(f"{store.key_of(ckpt)}/adapter", layouts.run_export("a", "r1"))
    assert check_store_start(ckpt, store, "config.resume_from", peft_marker=None) is None
    assert check_store_start(store.url(layouts.run_prefix("a", "r1")), store, "config.resume_from", peft_marker=None) is None
    assert read_all(check_store_start(export, store, "config.init_from", peft_marker="adapter_config.json")) == PEFT
    refusals = {f"s3://{seaweed.bucket}/elsewhere/runs/a-r1/export": "is not a folder of this service's storage",
                f"{aws}/runs/a-r1/../a-r1/export": "is not a folder of this service's storage",
                f"{aws}/runs/a-r1/checkpoints/step-000009": "is not a lorafleet checkpoint",
                f"{aws}/runs/a-r1/nothing": "not a complete folder"}
    for url, why in refusals.items():
        field = "config.init_from" if url.endswith("export") or url.endswith("nothing") else "config.resume_from"
        with pytest.raises(BadValue, match=why):
            check_store_start(url, store, field, peft_marker="adapter_config.json" if field.endswith("init_from") else None)
    with pytest.raises(BadValue, match="this service's storage is a local folder"):
        check_store_start(export, LocalStore(Path("/tmp")), "config.init_from", peft_marker="adapter_config.json")

    own = own_references(store, [SimpleNamespace(name="a", registration_id="r1")], "alice")
    assert own == [f"{aws}/runs/a-r1", f"{aws}/tinker/alice"]
    allowed = {ckpt: True, export: True, f"{aws}/tinker/alice/s_train_0/sampler_weights/x": True,
               f"{aws}/runs/a-r10/export": False,  # a prefix of the name is not its folder
               f"{aws}/runs/b-r2/export": False, f"{aws}/tinker/bob/s_train_0/weights/x": False,
               f"{aws}/runs/a-r1/../b-r2/export": False, f"s3://{seaweed.bucket}/other/runs/a-r1/export": False}
    for url, ok in allowed.items():
        assert may_start_from(url, state_dir=Path("/srv/state"), data_roots=[], own_dirs=own) is ok, url


def test_own_references_of_a_local_store_are_the_run_folders(tmp_path):
    from service.control.ownership import may_start_from, own_references

    state = tmp_path / "state"
    own = own_references(LocalStore(state), [SimpleNamespace(name="a", registration_id="r1")], "alice")
    assert own == [str(state / "runs" / "a-r1"), str(state / "tinker" / "alice")]
    (state / "runs" / "a-r1" / "export").mkdir(parents=True)
    (state / "runs" / "b-r2" / "export").mkdir(parents=True)
    assert may_start_from(state / "runs" / "a-r1" / "export", state_dir=state, data_roots=[], own_dirs=own)
    assert not may_start_from(state / "runs" / "b-r2" / "export", state_dir=state, data_roots=[], own_dirs=own)


def test_export_destinations_are_the_operators_and_the_copy_crosses_stores(seaweed, aws, tmp_path):
    from service.config.settings import ServiceSettings
    from service.control.ownership import check_export_to, export_destination

    shared, team = f"{aws}/exports", f"{aws}/alice-exports/"
    local = tmp_path / "exports"
    allowed = ServiceSettings(state_dir=tmp_path, export_destinations={"*": [shared], "alice": [team, str(local)]})
    dests = allowed.export_destinations
    assert dests["alice"][0] == team.rstrip("/")
    assert check_export_to(f"{shared}/a/final", dests, "bob") == (shared, "a/final")
    assert check_export_to(f"{team}x", dests, "alice") == (team.rstrip("/"), "x")
    assert check_export_to(str(local / "a" / "b"), dests, None) == (str(local), "a/b")  # the admin: any listed
    for bad, who in ((f"{team}x", "bob"), (shared, "bob"), (f"{shared}/../alice-exports/x", "bob"),
                     (f"{aws}/exportsX/a", "bob"), (str(local / ".." / "x"), "alice"), ("relative/x", "alice")):
        with pytest.raises(BadValue, match="not below a location you may export to; allowed: a folder below"):
            check_export_to(bad, dests, who)
    with pytest.raises(BadValue, match=r"\(none: the operator allows none"):
        check_export_to(f"{shared}/a", {}, "bob")
    assert export_destination(f"{aws}/exports/deep/a", [aws, shared]) == (shared, "deep/a")  # the closest location
    with pytest.raises(ValueError, match="is not a location"):
        ServiceSettings(state_dir=tmp_path, export_destinations={"*": ["exports/relative"]})

    # a folder with a sub-key, from the object store to another prefix of it and to a local folder
    src = open_store(aws)
    write(src, "runs/a-r1/final/adapter", PEFT)
    write(src, "runs/a-r1/final", {"run_state.json": b"{}"}, children=("adapter",))
    for location, key in (check_export_to(f"{shared}/a", dests, None), check_export_to(str(local / "a"), dests, None)):
        dst = open_store(location)
        copy_folder(src, "runs/a-r1/final", dst, key)
        assert dst.complete(key)
        assert read_all(dst.get_folder(f"{key}/adapter")) == PEFT
        assert read_all(dst.get_folder(key)) == {"run_state.json": b"{}", **{f"adapter/{k}": v for k, v in PEFT.items()}}


def test_an_export_is_checked_by_its_manifest(seaweed, aws, tmp_path):
    store = open_store(aws)
    write(store, "runs/a-r1/export", PEFT)
    assert committed_files(store, store.url("runs/a-r1/export")) == set(PEFT)
    assert committed_files(store, store.url("runs/a-r1/missing")) == set()
    legacy = tmp_path / "before-the-store"  # a folder written before the store: its own files
    legacy.mkdir()
    (legacy / "adapter_config.json").write_text("{}")
    assert committed_files(store, legacy) == {"adapter_config.json"}


# --- Tinker's external weights -------------------------------------------------------------------------


def test_external_weights_urls_are_the_object_stores_presigned_urls(seaweed, aws, tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from api.tenant_keys import TenantKeys
    from api.tinker.checkpoints.routes import runs_router
    from api.tinker.checkpoints.runs import TrainingRuns
    from service.registry.tinker_records import TinkerRecords

    store = open_store(aws)
    records = TinkerRecords(tmp_path / "registry.sqlite3")
    try:
        runs = TrainingRuns(records, store)
        run = "s-1:train:0"
        records.add_model(run, "alice", "s-1", 4, 0, ("attention",), None, 0).wait()
        write(store, runs.key("alice", run, "external_weights", "exp"), PEFT)
        records.add_checkpoint("alice", run, "external_weights", "exp", None, None).wait()
        write(store, runs.key("alice", run, "weights", "w"), {"slot_state.json": b"{}"})
        records.add_checkpoint("alice", run, "weights", "w", None, None).wait()
        service = SimpleNamespace(runs=runs, store=store, keys=TenantKeys({"alice": "tml-alice-key-1", "bob": "tml-bob-key-22"}))
        app = FastAPI()
        app.include_router(runs_router(service), prefix="/api/v1")
        client = TestClient(app)

        def urls(tenant: str, kind: str, name: str):  # noqa: ANN202
            key = {"alice": "tml-alice-key-1", "bob": "tml-bob-key-22"}[tenant]
            return client.get(f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls",
                              headers={"X-API-Key": key})

        got = urls("alice", "external_weights", "exp")
        assert got.status_code == 200, got.text
        body = got.json()
        assert sorted(body["urls"]) == sorted(PEFT) and body["expires"]
        for rel, url in body["urls"].items():
            assert url.startswith(seaweed.endpoint + "/")  # straight from the object store, not through the service
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.read() == PEFT[rel]
        assert urls("bob", "external_weights", "exp").status_code == 404  # another tenant's run
        assert urls("alice", "external_weights", "nope").status_code == 404
        assert urls("alice", "weights", "w").status_code == 400  # not an external weights checkpoint
        assert json.loads(urls("alice", "weights", "w").text)["detail"].startswith("only external_weights checkpoints")
    finally:
        records.close()
