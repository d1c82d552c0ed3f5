"""lorafleet on a 2-node Ray cluster with object storage and no shared state dir (issue 44 items 2, 4):
Ray's own cluster on loopback (tests/integration/loopback_cluster.py: a head with no CPUs, where the
coordinator attaches, and two worker nodes of 2 CPUs), a real SeaweedFS (tests/s3_server.py) as
`service.storage: s3://...`, and a real `lorafleet serve` of the tiny job (two RL adapters, one SFT).

Each worker node gets its own environment, as `ray start` on a machine would: the AWS variables and its
own scratch folder (LORAFLEET_STORAGE_CACHE); the coordinator has its own. The nodes share one
filesystem here (one host), so the proof is what the service needs, not what it could reach:

  1. the job runs with the trainer and the engine on the two worker nodes (the planner's choice, as in
     test_multinode.py); the trainer writes checkpoints into the object store (committed folders under
     runs/ in the bucket); the start-up probe ran on the trainer's node with that node's environment;
  2. the coordinator is SIGKILLed mid-run, every run live with a checkpoint (the SFT run, ten times
     faster here, registered over REST once the RL runs have theirs); then the dead coordinator's
     state dir and every node's scratch folder are DELETED, leaving only a copy of its registry
     (sqlite3's backup of registry.sqlite3, as an operator copies it) in a new state dir, as a
     coordinator restarted on another machine would have;
  3. a new coordinator on that state dir resumes every run from the object store: each prepared again
     at its last checkpoint's step (at least the one the registry recorded before the kill), every
     run ends COMPLETED at its total with each step recorded once, nothing trained twice past a
     checkpoint, and its export committed in the bucket (verified through the store; the SFT run's
     also copied below the location the operator allows for exports, as its export_to asked); each
     run is prepared from its checkpoint's s3:// URL, the resumed slot states downloaded into the
     trainer node's own scratch folder, and the new state dir never holds a runs/ folder;
  4. meanwhile, once the resumed RL runs step, the engine's node is lost (test_multinode.py's
     engine-node drill): a third node with its own environment joins, the engine comes back there
     and the RL runs go on (two steps each), their weights reaching the new engine from the trainer
     (no hand-off folder is shared).
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.loopback_cluster import LoopbackCluster
from tests.integration.service_world import REPO, Service, serve_job, serving, wait_for
from tests.s3_server import seaweedfs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

TINY = yaml.safe_load((REPO / "examples" / "tiny" / "job.yaml").read_text())
# Small (CI budget). The RL adapters are the job's (prepared once the engine is up); the SFT one, which
# trains at once and ~10x faster on the tiny world, is registered over REST once both RL runs have a
# checkpoint, so the kill finds all three live, each with a checkpoint.
RL_STEPS, RL_INTERVAL, SFT_STEPS, SFT_INTERVAL = 14, 2, 60, 5
PER_STEP = {"digits": 4 * 8, "vowels": 4 * 8, "kinds_sft": 6}  # prompts_per_step x group size; examples per step
INTERVAL = {"digits": RL_INTERVAL, "vowels": RL_INTERVAL, "kinds_sft": SFT_INTERVAL}
PREFIX, EXPORTS = "fleet", "exports"  # the storage's prefix; where runs may also export to (export_to)
LONG_S = 1500.0  # deadlines: a loaded 2-core machine starts an engine in minutes


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode-s3")
    with seaweedfs() as s3:
        scratch = {name: tmp / name for name in ("node-a", "node-b", "node-c", "coordinator")}

        def node_env(name: str) -> dict[str, str]:  # what `ray start` on that machine would have
            return {**s3.env(), "LORAFLEET_STORAGE_CACHE": str(scratch[name] / "cache")}

        cluster = LoopbackCluster([])
        try:
            nodes = {cluster.add(2, env=node_env(n)): n for n in ("node-a", "node-b")}
            path = serve_job(tmp, tiny_world, engines={"startup_deadline_s": 1200},
                             service={"storage": f"s3://{s3.bucket}/{PREFIX}", "export_destinations": {"*": [f"s3://{s3.bucket}/{EXPORTS}"]}})
            job = yaml.safe_load(path.read_text())
            job["ray"] = {"address": cluster.address, "connect_timeout_s": 120}
            job["trainer"]["swap_spill_dir"] = str(tmp / "trainer-scratch" / "swap")  # a node-local disk folder
            adapters = {a["name"]: {**a["config"], "data": {"path": str(tiny_world / "data" / Path(a["config"]["data"]["path"]).name)},
                                    "checkpoint_interval": INTERVAL[a["name"]], "num_epoch": None,
                                    "num_step": RL_STEPS if a["config"]["objective"] == "rl" else SFT_STEPS}
                        for a in TINY["adapters"]}
            job["adapters"] = [{"name": n, "config": c} for n, c in adapters.items() if c["objective"] == "rl"]
            path.write_text(yaml.safe_dump(job))
            env = {**cluster.env, **s3.env(), "LORAFLEET_STORAGE_CACHE": str(scratch["coordinator"] / "cache")}
            yield tmp, s3, cluster, nodes, node_env, scratch, path, env, adapters["kinds_sft"]
        finally:
            cluster.shutdown()


def records(client) -> dict[str, dict]:  # noqa: ANN001
    return {n: client.get(n) for n in PER_STEP}


def read_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


def backup_registry(src: Path, dst: Path) -> None:
    """A consistent copy of a registry a killed coordinator left (its write-ahead log included)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


def test_a_coordinator_on_a_new_machine_resumes_every_run_from_the_object_store(world):
    tmp, s3, cluster, nodes, node_env, scratch, path, env, sft = world
    store = s3.store(PREFIX)
    first = Service(path, tmp / "state", tmp / "serve-1.log", env=env)
    with serving(first):
        with first.client() as c:
            procs = cluster.running(c, ("trainer-rank-0", "engine-0"), LONG_S)
            trainer_node = procs["trainer-rank-0"]["node_id"]
            assert {trainer_node, procs["engine-0"]["node_id"]} == set(nodes)  # the two worker nodes
            for name in ("digits", "vowels"):
                wait_for(c, name, lambda r: (r["checkpoint_step"] or 0) >= RL_INTERVAL, "a checkpoint", LONG_S)
            c.register("kinds_sft", {**sft, "export_to": f"s3://{s3.bucket}/{EXPORTS}/kinds_sft"})
            wait_for(c, "kinds_sft", lambda r: (r["checkpoint_step"] or 0) >= SFT_INTERVAL, "a checkpoint", LONG_S)
            at_kill = records(c)
            first.kill()  # SIGKILL: no drain, no final checkpoint
    assert all(r["state"] == "ACTIVE" for r in at_kill.values()), at_kill
    probed = re.search(rf"storage s3://{s3.bucket}/{PREFIX}: usable from (.*)", first.log_path.read_text())
    assert probed and trainer_node[:12] in probed.group(1), probed  # the probe ran on the trainer's node
    for name, ref in at_kill.items():  # what the registry recorded is in the bucket, committed
        assert ref["checkpoint_path"].startswith(store.url("runs/")), ref["checkpoint_path"]
        assert store.complete(store.key_of(ref["checkpoint_path"])), ref["checkpoint_path"]

    # a new machine: only a copy of the registry survives; every local folder of the first run is gone
    backup_registry(tmp / "state" / "registry.sqlite3", tmp / "state-2" / "registry.sqlite3")
    for folder in (tmp / "state", *scratch.values(), tmp / "trainer-scratch"):
        shutil.rmtree(folder, ignore_errors=True)
    second = Service(path.with_name("job-2.yaml"), tmp / "state-2", tmp / "serve-2.log", env=env)
    job = yaml.safe_load(path.read_text())
    job["service"]["state_dir"] = str(tmp / "state-2")
    second.job_path.write_text(yaml.safe_dump(job))
    restarted_at = time.time()
    with serving(second):
        with second.client() as c:
            # the engine-node drill (test_multinode.py's second) with no shared folder, once the resumed RL
            # runs step here: a third node joins with its own environment, the engine's node is lost, the
            # engine comes back on the new node and gets the adapters' newest weights from the trainer
            for name in ("digits", "vowels"):
                wait_for(c, name, lambda r, s=at_kill[name]["step"]: r["step"] > s, "an RL step after the resume", LONG_S)
            engine = {x["name"]: x for x in c.fleet()}["engine-0"]
            spare = cluster.add(2, env=node_env("node-c"))
            nodes[spare] = "node-c"
            cluster.kill(engine["node_id"])
            moved = cluster.back_on_a_node_left(c, "engine-0", engine, LONG_S)
            assert moved["node_id"] == spare, (moved, spare)
            back_at = {n: c.get(n) for n in ("digits", "vowels")}
            assert all(r["state"] == "ACTIVE" for r in back_at.values()), back_at  # the drill hit live runs
            for name in ("digits", "vowels"):  # two steps: the first may use groups generated before the loss
                wait_for(c, name, lambda r, s=back_at[name]["step"]: r["step"] >= s + 2, "RL steps on the new engine", LONG_S)
            done = {n: wait_for(c, n, lambda r: r["state"] == "COMPLETED", "COMPLETED", LONG_S) for n in PER_STEP}
            series = {n: c.metrics(n)["steps"] for n in PER_STEP}
            trainer_node_2 = {x["name"]: x for x in c.fleet()}["trainer-rank-0"]["node_id"]
    log2 = second.log_path.read_text()

    for name, ref in done.items():
        prepared = re.search(rf"prepared {name} in slot \d+ at step (\d+) \(version \d+, from (\S+)\)", log2)
        assert prepared and int(prepared.group(1)) >= at_kill[name]["checkpoint_step"], (name, at_kill[name]["checkpoint_step"])
        assert prepared.group(2).startswith(store.url("runs/")), prepared.group(0)  # from the bucket
        redone = [s["step"] for s in series[name] if s["recorded_at"] > restarted_at]
        assert redone and redone[0] == int(prepared.group(1)) + 1, (name, redone)
        assert [s["step"] for s in series[name]] == list(range(1, ref["total_steps"] + 1)), name  # each step once
        assert ref["step"] == ref["total_steps"] and ref["samples_trained"] == ref["step"] * PER_STEP[name], ref
        export = store.key_of(ref["export_path"])
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(store.manifest(export).files)
        store.get_folder(export)  # every file's checksum against its manifest
        # the trainer read the slot state through its node's own scratch folder (the coordinator's copy of
        # run_state.json went with the checkpoint's pruning: a store's delete takes this node's copy too)
        resumed = f"{PREFIX}/runs/{ref['name']}-{ref['registration_id']}/checkpoints/step-{int(prepared.group(1)):06d}"
        trainer_cache = scratch[nodes[trainer_node_2]] / "cache" / s3.bucket / resumed
        assert (trainer_cache / "trainer" / "slot_state.safetensors").is_file(), trainer_cache
    assert (scratch["coordinator"] / "cache" / s3.bucket / PREFIX / "runs").is_dir()  # what the coordinator read
    own = store.get_folder(store.key_of(done["kinds_sft"]["export_path"]))
    asked = s3.store(EXPORTS).get_folder("kinds_sft")  # export_to: the same files, committed where it asked
    assert read_files(asked) == read_files(own) and "adapter_model.safetensors" in read_files(asked)
    assert not (tmp / "state-2" / "runs").exists()  # the state dir holds the registry, logs and pids only
