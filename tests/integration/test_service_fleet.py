"""One running `lorafleet serve` (real CLI process: Ray, one SGLang CPU engine, the
Megatron-Bridge trainer, controller + runtime actors, REST API with a token), shared by
every test here, in this order:

  1. tenants come and go during training (register mid-run, retire, re-register the name:
     the new tenant gets the retired slot with a new version and never an old sample)
  2. `lorafleet smoke` passes against it                                    (issue 6 proof)
  3. load: 200 concurrent GETs + 50 register/retire cycles during training:
     no 5xx, no leaked slot, p99 of GET /v1/adapters printed                  (issue 6 proof)
  4. restart: SIGKILL the service mid-run, start it again over the same state dir:
     the runs resume from their checkpoints and finish
  5. the trainer stopped (through Ray, as an operator would): `lorafleet smoke` fails
     with a clear message                                                      (issue 6 proof)
  teardown: SIGTERM drains (every live run checkpointed) and the process exits 0.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from api.client import ApiError, LorafleetClient

pytestmark = pytest.mark.integration

LORAFLEET = Path(sys.executable).parent / "lorafleet"
TOKEN = "fleet-test-token-31d7"
START_TIMEOUT_S = 480


@dataclass
class Service:
    job_path: Path
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    url: str = ""
    ray_address: str = ""

    def start(self) -> None:
        info = self.state_dir / "service.json"
        info.unlink(missing_ok=True)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([str(LORAFLEET), "serve", str(self.job_path), "-v"], stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "LORAFLEET_API_TOKEN": TOKEN, "COLUMNS": "200"})
        deadline = time.monotonic() + START_TIMEOUT_S
        while not info.is_file():
            if self.proc.poll() is not None:
                raise RuntimeError(f"lorafleet serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"lorafleet serve not up after {START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)
        data = json.loads(info.read_text())
        self.url, self.ray_address = data["api_url"], data["ray_address"]

    def kill(self) -> None:
        """SIGKILL: no drain, no cleanup (the engines it started are left behind, like after a crash)."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout_s: float = 180) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return -9

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def client(self, timeout_s: float = 30.0) -> LorafleetClient:
        return LorafleetClient(self.url, TOKEN, timeout_s)


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    from service.app_runtime import reap_engines

    tmp = tmp_path_factory.mktemp("fleet")
    job = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny" / "job.yaml").read_text())
    job["base_model"]["path"] = str(tiny_world / "model")
    job["adapters"] = []
    job["service"] = {"state_dir": str(tmp / "state"), "data_roots": [str(tiny_world / "data"), str(tmp)], "port": 0}
    job_path = tmp / "job.yaml"
    job_path.write_text(yaml.safe_dump(job))
    svc = Service(job_path, tmp / "state", tmp / "serve.log")
    try:
        svc.start()
        yield svc
        code = svc.stop()
        assert code == 0, f"lorafleet serve exited {code} on SIGTERM:\n{svc.log_tail()}"
        assert "stopped (SIGTERM received" in svc.log_path.read_text(), svc.log_tail()
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.proc.kill()
        reap_engines(svc.state_dir)


def rl(data: Path, name: str = "digits", **over) -> dict:
    return {"objective": "rl", "rank": 4, "alpha": 8, "learning_rate": 3e-3, "data": {"path": str(data / "data" / f"{name}.jsonl")},
            "reward": {"name": "target_share"}, "prompts_per_step": 2, "num_step": 1000, "checkpoint_interval": 0,
            "sampling": {"n_samples_per_prompt": 4, "max_new_tokens": 12}, **over}


def sft(data: Path, **over) -> dict:
    return {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 3e-3, "data": {"path": str(data / "data" / "echo_sft.jsonl")},
            "prompts_per_step": 4, "num_step": 1000, "checkpoint_interval": 0, **over}


def wait_for(client: LorafleetClient, name: str, pred, what: str, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        ref = client.get(name)
        assert ref["state"] != "FAILED", f"{name} FAILED: {ref['failure_reason']}"
        if pred(ref):
            return ref
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: {what} not reached in {timeout_s} s; now {ref['state']} step {ref['step']}")
        time.sleep(0.3)


def retire_and_wait(client: LorafleetClient, *names: str) -> None:
    for n in names:
        client.retire(n)
    for n in names:
        ref = wait_for(client, n, lambda r: r["state"] == "COMPLETED", "COMPLETED")
        assert ref["export_path"] and Path(ref["export_path"], "adapter_model.safetensors").is_file()


# --- 1 -------------------------------------------------------------------------------------------


def test_tenants_come_and_go_without_disturbing_the_others(service, tiny_world):
    with service.client() as c:
        a = c.register("t-rl", rl(tiny_world))
        c.register("t-sft", sft(tiny_world))
        wait_for(c, "t-rl", lambda r: r["step"] >= 3, "3 steps")
        wait_for(c, "t-sft", lambda r: r["step"] >= 3, "3 steps")

        c.register("t-new", rl(tiny_world, "vowels"))  # a third tenant joins mid-run
        wait_for(c, "t-new", lambda r: r["step"] >= 2, "2 steps")
        before = {n: c.get(n)["step"] for n in ("t-sft", "t-new")}
        retired = c.retire("t-rl")
        assert retired["state"] == "RETIRING"
        done = wait_for(c, "t-rl", lambda r: r["state"] == "COMPLETED", "COMPLETED")
        assert Path(done["export_path"], "adapter_config.json").is_file()
        # the others kept training through the retirement
        for n, step in before.items():
            wait_for(c, n, lambda r, s=step: r["step"] >= s + 2, f"2 more steps than {step}")

        # the same name again: a new registration in the freed slot, with a new version
        b = c.register("t-rl", rl(tiny_world))
        assert b["registration_id"] != a["registration_id"]
        assert b["slot"] == a["slot"] and b["slot_version"] > done["weight_version"] > a["slot_version"]
        wait_for(c, "t-rl", lambda r: r["step"] >= 3, "3 steps")
        series = c.metrics("t-rl")
        assert series["registration_id"] == b["registration_id"]
        for s in series["steps"]:
            # every sample of the new tenant came from its own weights (versions handed out
            # after its registration) and none of another tenant reached the trainer
            assert s["metrics"]["sample_version_min"] > b["slot_version"], s
            assert s["metrics"]["foreign_samples_dropped"] == 0, s
            assert s["samples"] == 8
        assert all(r["state"] != "FAILED" for r in c.list())
        retire_and_wait(c, "t-rl", "t-sft", "t-new")
        assert c.ready()["slots"]["free"] == 4


# --- 2 -------------------------------------------------------------------------------------------


def test_smoke_passes_against_the_running_service(service):
    proc = subprocess.run([str(LORAFLEET), "smoke", "--api-url", service.url, "--steps", "3", "--train-timeout", "300",
                           "--poll", "0.3"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LORAFLEET_API_TOKEN": TOKEN, "COLUMNS": "200"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for check in ("health", "ready", "register", "train", "metrics", "retire", "complete"):
        assert check in out
    assert "COMPLETED at step" in out and "FAILED" not in out


# --- 3 -------------------------------------------------------------------------------------------


def test_load_concurrent_gets_and_register_retire_cycles(service, tiny_world):
    with service.client() as c:
        c.register("load-bg", sft(tiny_world))  # training goes on during the load
        wait_for(c, "load-bg", lambda r: r["step"] >= 1, "1 step")
        step0 = c.get("load-bg")["step"]

    statuses: list[int] = []
    latencies: list[float] = []
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def get_list(http: httpx.Client) -> None:
        t0 = time.perf_counter()
        r = http.get("/v1/adapters")
        with lock:
            latencies.append(time.perf_counter() - t0)
            statuses.append(r.status_code)

    def cycles(worker: int, n: int) -> None:
        with httpx.Client(base_url=service.url, headers=headers, timeout=60) as http:
            for i in range(n):
                name = f"cyc-{worker}-{i}"
                while True:  # a slot frees when the previous cycle's run has COMPLETED: 409 until then
                    r = http.post("/v1/adapters", json={"name": name, "config": sft(tiny_world)})
                    with lock:
                        statuses.append(r.status_code)
                    if r.status_code == 201:
                        break
                    assert r.status_code == 409 and "no free slot" in r.text, r.text
                    time.sleep(0.2)
                r = http.delete(f"/v1/adapters/{name}")
                with lock:
                    statuses.append(r.status_code)
                assert r.status_code == 202, r.text

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=34) as pool:
        cyclers = [pool.submit(cycles, w, 25) for w in range(2)]
        with httpx.Client(base_url=service.url, headers=headers, timeout=60,
                          limits=httpx.Limits(max_connections=200)) as http:
            gets = [pool.submit(get_list, http) for _ in range(200)]
            for f in gets:
                f.result()
        for f in cyclers:
            f.result()
    elapsed = time.monotonic() - t0

    assert not [s for s in statuses if s >= 500], f"5xx answers: {sorted(set(statuses))}"
    assert statuses.count(201) == 50
    lat = sorted(latencies)
    p50, p99 = lat[len(lat) // 2], lat[int(0.99 * (len(lat) - 1))]
    print(f"\nload: 200 concurrent GET /v1/adapters + 50 register/retire cycles in {elapsed:.1f} s; "
          f"GET p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; statuses {sorted(set(statuses))}")
    with service.client() as c:
        for w in range(2):
            for i in range(25):
                wait_for(c, f"cyc-{w}-{i}", lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=120)
        assert c.get("load-bg")["step"] > step0  # training went on
        retire_and_wait(c, "load-bg")
        assert c.ready()["slots"]["free"] == 4  # no leaked slot
        text = c.prometheus()
        assert "lorafleet_slots_free 4.0" in text and "lorafleet_train_step_seconds" in text


# --- 4 -------------------------------------------------------------------------------------------


def test_restart_resumes_runs_from_their_checkpoints(service, tiny_world):
    total, interval = 9, 3
    with service.client() as c:
        c.register("r-rl", rl(tiny_world, num_step=total, checkpoint_interval=interval))
        c.register("r-sft", sft(tiny_world, num_step=total, checkpoint_interval=interval))
        for n in ("r-rl", "r-sft"):
            wait_for(c, n, lambda r: (r["checkpoint_step"] or 0) >= interval and r["step"] > r["checkpoint_step"],
                     "a step past a checkpoint")
    service.kill()
    killed_at = time.time()
    service.start()  # same job file, same state dir: the engines left behind are reaped
    with service.client() as c:
        for n in ("r-rl", "r-sft"):
            ref = wait_for(c, n, lambda r: r["state"] == "COMPLETED", "COMPLETED")
            assert ref["step"] == total and Path(ref["export_path"], "adapter_model.safetensors").is_file()
            steps = c.metrics(n)["steps"]
            assert [s["step"] for s in steps] == list(range(1, total + 1))
            assert ref["samples_trained"] == sum(s["samples"] for s in steps)
            after = [s["step"] for s in steps if s["recorded_at"] > killed_at]
            # trained again from the checkpoint on (steps after it that the killed process
            # had recorded were dropped and redone), not from scratch
            assert after and after[0] % interval == 1 and after[0] > 1, (n, after)


# --- 5 -------------------------------------------------------------------------------------------


def test_smoke_fails_clearly_when_the_trainer_is_stopped(service):
    stop = subprocess.run(
        [sys.executable, "-c", (
            "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "ray.get(ray.get_actor('lorafleet-runtime', namespace='lorafleet').stop_trainer.remote())")
         , service.ray_address],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "token"},
    )
    assert stop.returncode == 0, stop.stderr[-3000:]
    proc = subprocess.run([str(LORAFLEET), "smoke", "--api-url", service.url, "--ready-timeout", "3", "--poll", "0.5"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LORAFLEET_API_TOKEN": TOKEN, "COLUMNS": "200"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "smoke FAILED at ready" in out and "trainer: trainer not running (stopped by the operator)" in out, out
    with service.client() as c:
        assert all(not r["name"].startswith("smoke-") or r["state"] == "COMPLETED" for r in c.list())  # nothing registered
