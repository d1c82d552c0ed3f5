"""Tinker tenants survive a restart (issue 40): the official SDK and the cookbook's chat_sl recipe,
unmodified, against a live `lorafleet serve` that is stopped and started again on the same state
dir and port while they run. One service for the module (tinker_durability: step; the last test
restarts it with an interval policy).

(a) SIGTERM + restart in the middle of a recipe: the recipe finishes, and its final training state
    equals an uninterrupted run's bit for bit (every tensor torch.equal): the graceful stop saved
    every model whole (pending gradient included) and the calls it had queued, and the SDK's
    retries rode through the gap.
(b) kill -9 of the whole process group with tinker_durability: step: the recipe finishes; no
    acknowledged optim_step is lost (the model comes back at least at the step the recipe had been
    answered) and none runs twice (its snapshot step at the end is the recipe's step count); its
    losses follow the uninterrupted run's within the spread two trainer starts show (ACROSS_STARTS_REL).
(c) tinker_durability interval, kill -9: the model's next call is answered with the error naming
    the step it was restored to (never "unknown request id"); create_training_client_from_state on
    its last save_state works; another tenant whose model had nothing past its snapshot carries on.
    (The snapshots are made by a graceful restart's drain, so the test does not race the interval.)

Both runs of the recipe get the same LoRA init seed from the service (tinker_default_seed: the
recipe passes none). Restart times (stop, start, first answered call) are printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.tiny.build import SERVED_NAME, hf_env
from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.service_world import REPO, Service, serve_job
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-restart-key-1", "bob": "tml-bob-restart-key-22"}
SEED = 7
STEPS = 6
RECIPE_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Restartable:
    """A `lorafleet serve` on a fixed port (the SDK's base_url stays right), in a process group of its
    own, stopped and started again on the same state dir."""

    def __init__(self, tmp: Path, tiny_world: Path) -> None:
        self.tmp = tmp
        keys = tmp / "tinker_keys.yaml"
        keys.write_text(json.dumps(KEYS))
        self.port = _free_port()
        job = serve_job(tmp, tiny_world, slots={"num_slots": 4, "max_rank": 8, "evict_idle_s": 3600.0},
                        base_model={"served_name": SERVED_NAME},
                        service={"tinker_keys_file": str(keys), "tinker_window_ms": 10, "tinker_max_seq_len": 256,
                                 "tinker_session_timeout_s": 3600, "tinker_default_seed": SEED, "port": self.port})
        self.svc = Service(job, tmp / "state", tmp / "serve.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.durability = ""  # the policy of the last start

    def start(self, durability: str) -> float:
        t0 = time.monotonic()
        self.durability = durability
        self.svc.env = {**os.environ, "LORAFLEET_TINKER_DURABILITY": durability, "PYTHONFAULTHANDLER": "1"}
        try:
            self.svc.start(new_session=True)
        except TimeoutError:  # its threads' stacks into the log (faulthandler on SIGABRT), then the failure
            os.kill(self.svc.proc.pid, signal.SIGABRT)
            self.svc.proc.wait(30)
            raise TimeoutError(self.svc.log_tail()) from None
        return time.monotonic() - t0

    def sigterm(self) -> float:
        t0 = time.monotonic()
        assert self.svc.stop(timeout_s=300) == 0, self.svc.log_tail()
        return time.monotonic() - t0

    def kill9(self) -> None:
        from service.fleet.engine_pids import reap_engines

        os.killpg(os.getpgid(self.svc.proc.pid), signal.SIGKILL)
        self.svc.proc.wait(30)
        reap_engines(self.svc.state_dir)

    def ensure(self, durability: str) -> None:
        """The service under `durability`: a graceful restart only if another policy is in force (a
        restart is the costliest thing these tests do, about 40 s on a 2-core machine)."""
        if self.durability != durability:
            self.sigterm()
            self.start(durability)

    def close(self) -> None:
        from service.fleet.engine_pids import reap_engines

        if self.svc.proc is not None and self.svc.proc.poll() is None:
            os.killpg(os.getpgid(self.svc.proc.pid), signal.SIGKILL)
            self.svc.proc.wait(30)
        reap_engines(self.svc.state_dir)


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    svc = Restartable(tmp_path_factory.mktemp("tinker-restart"), tiny_world)
    try:
        svc.start("step")
        yield svc
    finally:
        svc.close()


def _recipe(service: Restartable, log: Path, tiny_world: Path, data: Path) -> subprocess.Popen:
    """chat_sl, unmodified, as a user's shell starts it (tests/integration/test_cookbook_recipes.py `run`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(hf_env(tiny_world), TINKER_API_KEY=KEYS["alice"], WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    args = ["-m", "tinker_cookbook.recipes.chat_sl.train", f"base_url={service.url}", f"model_name={SERVED_NAME}",
            f"dataset={data}", f"log_path={log}", "batch_size=4", "learning_rate=5e-3", "lora_rank=8", "max_length=128",
            f"max_steps={STEPS}", "save_every=0", "eval_every=0", "infrequent_eval_every=0", "behavior_if_log_dir_exists=delete"]
    return subprocess.Popen([sys.executable, *args], cwd=log.parent, env=env, stdout=open(f"{log}.out", "w"),
                            stderr=subprocess.STDOUT)


def _nll(log: Path) -> list[float]:
    path = log / "metrics.jsonl"
    if not path.is_file():
        return []
    return [m["train_mean_nll"] for m in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if "train_mean_nll" in m]


def _finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(RECIPE_TIMEOUT_S) == 0, Path(f"{log}.out").read_text()[-6000:]


def _final_path(log: Path) -> list[str]:
    """The recipe's final state: [model, kind, name] of its tinker://<model>/weights/final."""
    records = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines() if x.strip()]
    return next(r for r in records if r["name"] == "final")["state_path"][len("tinker://"):].split("/")


def _final_state(service: Restartable, log: Path) -> dict:
    from safetensors.torch import load_file

    model, kind, name = _final_path(log)
    folder = service.svc.state_dir / "tinker" / "alice" / model.replace(":", "_") / kind / name
    return load_file(str(folder / "slot_state.safetensors"))


@pytest.fixture(scope="module")
def chat_data(tiny_world, tmp_path_factory) -> Path:
    from tests.integration.test_cookbook_recipes import kinds_chat

    return kinds_chat(tiny_world, tmp_path_factory.mktemp("restart-data") / "kinds_chat.jsonl", 64)


@pytest.fixture(scope="module")
def uninterrupted(service, tiny_world, chat_data, tmp_path_factory):
    """The recipe run to its end with no restart: (its losses, its final state's tensors)."""
    service.ensure("step")
    log = tmp_path_factory.mktemp("uninterrupted") / "run"
    _finish(_recipe(service, log, tiny_world, chat_data), log)
    return _nll(log), _final_state(service, log)


def _interrupted(service, tiny_world, chat_data, tmp_path_factory, name: str, interrupt) -> tuple[list[float], dict]:  # noqa: ANN001
    """The recipe, with `interrupt(log)` (a stop and a start) after its third step; (losses, final state)."""
    service.ensure("step")  # (a) and (b) are about tinker_durability: step, whatever ran before them
    log = tmp_path_factory.mktemp(name) / "run"
    proc = _recipe(service, log, tiny_world, chat_data)
    wait_until(lambda: len(_nll(log)) >= 3 or proc.poll() is not None, "the recipe's third step", timeout_s=RECIPE_TIMEOUT_S)
    assert proc.poll() is None, Path(f"{log}.out").read_text()[-3000:]
    interrupt(log)
    _finish(proc, log)
    return _nll(log), _final_state(service, log)


@pytest.mark.timeout(1800)  # two runs of the recipe and a restart of the service
def test_a_graceful_restart_mid_recipe_is_invisible(service, tiny_world, chat_data, uninterrupted, tmp_path_factory):
    import torch

    times: dict[str, float] = {}

    def restart(_log: Path) -> None:
        times["stop"] = service.sigterm()
        times["start"] = service.start("step")

    nll, state = _interrupted(service, tiny_world, chat_data, tmp_path_factory, "graceful", restart)
    print(f"\ngraceful restart: stopped in {times['stop']:.1f} s, serving again {times['start']:.1f} s after the start")
    base_nll, base_state = uninterrupted
    assert nll == base_nll and len(nll) == STEPS, (nll, base_nll)
    assert set(state) == set(base_state)
    assert all(torch.equal(state[k], base_state[k]) for k in state), [k for k in state if not torch.equal(state[k], base_state[k])]


# Two models of the same seed and recipe created on two starts of the service can round the same steps
# differently in their last bits (measured 2026-12-05: on one start they repeat bit for bit; a model made
# after a restart had its second loss 1e-7 off, cause not isolated), and the recipe's Adam (eps 1e-12)
# turns that into an update of a full learning rate on a near-zero gradient: the final loss then differs
# by up to 1.0%. A model carried across a restart stays bit-exact (test (a)). So the losses here are
# compared at a bound above that spread, and "no acknowledged step lost, none run twice" is checked
# exactly, on the model's own step counts.
ACROSS_STARTS_REL = 5e-2


@pytest.mark.timeout(1200)
def test_kill_9_with_step_durability_loses_no_acknowledged_step(service, tiny_world, chat_data, uninterrupted, tmp_path_factory):
    acked: list[int] = []
    logs: list[Path] = []

    def crash(log: Path) -> None:
        service.kill9()
        acked.append(len(_nll(log)))  # the recipe logs a step's metrics once its optim_step is answered
        logs.append(log)
        service.start("step")

    nll, _ = _interrupted(service, tiny_world, chat_data, tmp_path_factory, "kill9", crash)
    base_nll, _ = uninterrupted
    assert len(nll) == STEPS and nll == pytest.approx(base_nll, rel=ACROSS_STARTS_REL), (nll, base_nll)
    model = _final_path(logs[0])[0]
    revived = re.findall(rf"revived Tinker model {re.escape(model)} of alice: step (\d+)", service.svc.log_path.read_text())
    assert revived and int(revived[-1]) >= acked[0], (revived, acked)  # every acknowledged optim_step survived the kill
    assert _snapshot_step(service, model) == STEPS  # and none ran twice (under step: a snapshot per optim_step)


def _snapshot_step(service: Restartable, model_id: str) -> int:
    db = sqlite3.connect(service.svc.state_dir / "registry.sqlite3")
    try:
        row = db.execute("SELECT snapshot_step FROM tinker_models WHERE model_id = ?", (model_id,)).fetchone()
    finally:
        db.close()
    return -1 if row is None else row[0]


def _step(tc, data) -> float:  # noqa: ANN001 - a TrainingClient, its datums
    from tinker import types

    fb = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    return fb.result().metrics["loss:sum"]


def test_kill_9_with_interval_durability_names_the_restored_step(service, tiny_world):
    """Deterministic snapshots: the models train under whatever policy is in force, then a graceful
    restart into `interval:3600` drains them (its drain snapshots every model: alice at step 2, bob at
    step 1), and under `interval:3600` no snapshot is taken while the test runs, so alice's step 3
    after it is what the kill -9 loses. The start after the kill is under `interval:1` (the policy at
    the kill is what decides what is lost; the next test wants interval:1, so this saves it a restart)."""
    import tinker
    from transformers import AutoTokenizer

    from tests.integration.test_tinker_serve import sft_data

    alice = open_client(service.url, KEYS["alice"])
    tc = alice.create_lora_training_client(base_model=SERVED_NAME, rank=8, seed=1).result()
    data = sft_data(AutoTokenizer.from_pretrained(tiny_world / "model"), tiny_world, 4)  # this machine's copy
    _step(tc, data)
    _step(tc, data)
    saved = tc.save_state("after-2").result().path
    bob = open_client(service.url, KEYS["bob"])
    tb = bob.create_lora_training_client(base_model=SERVED_NAME, rank=8, seed=2).result()
    _step(tb, data)
    bob_saved = tb.save_state("bob-1").result().path
    service.sigterm()  # the drain: every model's durable snapshot
    service.start("interval:3600")
    assert (_snapshot_step(service, tc.model_id), _snapshot_step(service, tb.model_id)) == (2, 1)
    _step(tc, data)  # alice's step 3: past her snapshot, lost in the crash
    service.kill9()
    t0 = time.monotonic()
    service.start("interval:1")
    with pytest.raises(tinker.RequestFailedError, match=r"restored to step 2") as err:
        _step(tc, data)
    assert "unknown request id" not in str(err.value)
    first_answer = time.monotonic() - t0
    print(f"\nkill -9 and restart: alice's next call answered (with the restored step) {first_answer:.1f} s after the start")
    # her last save_state loads into a new model, which trains on
    tc2 = open_client(service.url, KEYS["alice"]).create_training_client_from_state(saved).result()
    assert _step(tc2, data) > 0
    # bob had nothing past his snapshot: his model carries on, his checkpoint is there
    assert _step(tb, data) > 0
    kept = {c.tinker_path for c in bob.create_rest_client().list_checkpoints(tb.model_id).result().checkpoints}
    assert bob_saved in kept


def test_a_periodic_snapshot_written_in_the_background_is_what_a_kill_9_restores(service, tiny_world):
    """`interval:1`: a changed model is snapshotted once its last snapshot is a second old; the trainer
    takes the state in order with the rounds and rank 0's writer thread writes it while they go on
    (issue 41); it is recorded once written. A kill -9 then brings the model back from it: its next
    step is answered (nothing was lost), and the next periodic snapshot records step 3."""
    from transformers import AutoTokenizer

    from tests.integration.test_tinker_serve import sft_data

    service.ensure("interval:1")
    alice = open_client(service.url, KEYS["alice"])
    tc = alice.create_lora_training_client(base_model=SERVED_NAME, rank=8, seed=3).result()
    data = sft_data(AutoTokenizer.from_pretrained(tiny_world / "model"), tiny_world, 4)
    _step(tc, data)
    _step(tc, data)
    wait_until(lambda: _snapshot_step(service, tc.model_id) == 2, "a periodic snapshot of step 2 recorded", timeout_s=120)
    service.kill9()
    service.start("interval:1")
    assert _step(tc, data) > 0  # restored at step 2 from the background snapshot: no step lost
    wait_until(lambda: _snapshot_step(service, tc.model_id) == 3, "the next periodic snapshot, of step 3", timeout_s=120)
