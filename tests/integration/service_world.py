"""Shared set-up of the service end-to-end tests (test_service_fleet.py, test_service_faults.py):
a real `lorafleet serve` process over a job file with no adapters, reached over REST, and
small adapter configs on the tiny world's data."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from api.cli.client import ApiError, LorafleetClient
from tests.paths import REPO

# The `lorafleet` entry point (api/cli/main.py), run by this interpreter: independent of how the
# venv's console script was generated.
LORAFLEET = [sys.executable, "-m", "api.cli.main"]
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
    env: dict[str, str] | None = None  # the service's environment (default: this process's)

    def start(self, new_session: bool = False) -> None:
        """`new_session`: the service leads a session and process group of its own (as under systemd),
        so the test can signal the whole group without reaching pytest."""
        info = self.state_dir / "service.json"
        info.unlink(missing_ok=True)
        log = open(self.log_path, "a")
        # cwd: the repository, so the test rewards (tests.integration.rewards_for_tests) import in Ray's workers
        self.proc = subprocess.Popen([*LORAFLEET, "serve", str(self.job_path), "-v"], stdout=log, stderr=subprocess.STDOUT,
                                     env={**(self.env or os.environ), "LORAFLEET_API_TOKEN": TOKEN, "COLUMNS": "200"}, cwd=REPO,
                                     start_new_session=new_session)
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


# num_step of a run that trains until a test retires it or its service stops: the default 1,000 tiny SFT steps
# can run out mid-test (an SFT run needs no engine, so it trains while one starts)
UNTIL_RETIRED = 10**6


def rl(data: Path, name: str = "digits", **over) -> dict:
    return {"objective": "rl", "rank": 4, "alpha": 8, "learning_rate": 3e-3, "data": {"path": str(data / "data" / f"{name}.jsonl")},
            "reward": {"name": "target_share"}, "prompts_per_step": 2, "num_step": 1000, "checkpoint_interval": 0,
            "sampling": {"n_samples_per_prompt": 4, "max_new_tokens": 12}, **over}


def sft(data: Path, **over) -> dict:
    return {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 3e-3, "data": {"path": str(data / "data" / "echo_sft.jsonl")},
            "prompts_per_step": 4, "num_step": 1000, "checkpoint_interval": 0, **over}


def wait_for(client: LorafleetClient, name: str, pred, what: str, timeout_s: float = 240.0, *,
             may_fail: bool = False) -> dict:
    """Poll the adapter's record until `pred` holds; a FAILED run ends the wait at once unless
    `may_fail` (tests whose runs are meant to fail wait for FAILED itself)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ref = client.get(name)
        assert may_fail or ref["state"] != "FAILED", f"{name} FAILED: {ref['failure_reason']}"
        if pred(ref):
            return ref
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: {what} not reached in {timeout_s} s; now {ref['state']} step {ref['step']}: "
                                 f"{ref['failure_reason']}")
        time.sleep(0.3)  # poll interval of a deadline loop


def export_dir(state_dir: Path, ref: dict) -> Path:
    """The folder of a record's `export_path`, which the API shows relative to the state dir (api/public_paths.py)."""
    assert ref["export_path"] and not Path(ref["export_path"]).is_absolute(), ref["export_path"]
    return state_dir / ref["export_path"]


def register_from_threads(url: str, token_of: Callable[[str], str], configs: dict[str, dict], threads: int) -> Counter:
    """POST every name -> config from `threads` concurrent clients (each name with the token
    `token_of(name)`); the statuses answered, counted."""
    statuses: Counter = Counter()
    lock = threading.Lock()

    def register(item: tuple[str, dict]) -> None:
        name, cfg = item
        with LorafleetClient(url, token_of(name), 60.0) as c:
            try:
                c.register(name, cfg)
                status = 201
            except ApiError as e:
                status = e.status
        with lock:
            statuses[status] += 1

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(register, configs.items()))
    return statuses


def retire_and_wait(client: LorafleetClient, state_dir: Path, *names: str) -> None:
    for n in names:
        client.retire(n)
    for n in names:
        ref = wait_for(client, n, lambda r: r["state"] == "COMPLETED", "COMPLETED")
        assert (export_dir(state_dir, ref) / "adapter_model.safetensors").is_file()




def serve_job(tmp: Path, tiny_world: Path, slots: dict | None = None, engines: dict | None = None,
              service: dict | None = None, base_model: dict | None = None, keys: dict | None = None) -> Path:
    """The tiny job, without adapters, serving on a free port with its state under `tmp`
    (`slots`: a `slots:` section replacing the tiny job's; `engines`, `service`, `base_model`: keys
    merged into its sections of those names; `keys`: tenant -> key, written to a keys file the
    service serves: tenant keys on REST and the Tinker API on)."""
    job = yaml.safe_load((REPO / "examples" / "tiny" / "job.yaml").read_text())
    if slots is not None:
        job["slots"] = slots
    if engines is not None:
        job["engines"] = {**job.get("engines", {}), **engines}
    job["base_model"]["path"] = str(tiny_world / "model")
    job["adapters"] = []
    job["service"] = {"state_dir": str(tmp / "state"), "data_roots": [str(tiny_world / "data"), str(tmp)], "port": 0,
                      "reward_import_roots": ["tests.integration.rewards_for_tests"],
                      "rollout_import_roots": ["tests.integration.envs_for_tests", "examples.tiny_agent"], **(service or {})}
    job["base_model"].update(base_model or {})
    if keys is not None:
        (tmp / "keys.yaml").write_text(yaml.safe_dump(keys))
        job["service"]["tinker_keys_file"] = str(tmp / "keys.yaml")
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def prometheus_text(client: LorafleetClient) -> str:
    """The service's GET /metrics: Prometheus' text format (the admin token's; ApiError unless 200)."""
    body = client.request("GET", "/metrics")
    assert isinstance(body, str), f"/metrics answered JSON, not Prometheus text: {body!r}"
    return body


def fleet_pids(client: LorafleetClient, role: str) -> list[int]:
    """Process ids of the service's processes of `role` (trainer, rollout, engine), as an operator
    reads them: GET /v1/fleet (docs/operations.md, fault drills)."""
    pids = [p["pid"] for p in client.fleet() if p["role"] == role]
    assert pids and all(isinstance(p, int) for p in pids), client.fleet()
    return pids


def signal_processes(pids: list[int], sig: int = signal.SIGKILL, *, group: bool = False) -> None:
    """Send `sig` to each pid (to its whole process group with `group`: an SGLang server's children too)."""
    for pid in pids:
        if group:
            os.killpg(os.getpgid(pid), sig)
        else:
            os.kill(pid, sig)


@contextlib.contextmanager
def serving(svc: Service) -> Iterator[Service]:
    """`svc` started; killed (and its engines reaped) however the tests end."""
    from service.fleet.engine_pids import reap_engines

    try:
        svc.start()
        yield svc
    finally:
        if svc.proc is not None and svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait(60)
        reap_engines(svc.state_dir)


@contextlib.contextmanager
def registry_left_in(state_dir: Path, num_slots: int) -> Iterator["Registry"]:  # noqa: F821 - service.registry.registry
    """The SQLite registry a stopped or killed service left in `state_dir`, opened while nothing
    else uses it (what the service had committed, with no API read racing its last round)."""
    from service.config.settings import ServiceSettings
    from service.registry.registry import Registry

    registry = Registry(ServiceSettings(state_dir=state_dir).db_path, num_slots)
    try:
        yield registry
    finally:
        registry.close()


@contextlib.contextmanager
def running_service(tmp: Path, tiny_world: Path, slots: dict | None = None, engines: dict | None = None,
                    service: dict | None = None, base_model: dict | None = None,
                    keys: dict | None = None) -> Iterator[Service]:
    """A started `lorafleet serve` over the tiny job without adapters (serve_job's sections and keys);
    killed (and its engines reaped) however the tests end."""
    with serving(Service(serve_job(tmp, tiny_world, slots, engines, service, base_model, keys), tmp / "state",
                         tmp / "serve.log")) as svc:
        yield svc
