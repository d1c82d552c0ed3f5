"""Which Ray the service runs on, chosen on purpose: `RayConfig` (the job file's `ray:` section)
and `connect_ray`, which joins that cluster or starts a private local Ray.

Where the address comes from, first match (`resolve_ray_address`):
  1. the environment variable RAY_ADDRESS, when set and not empty (what `ray job submit`, KubeRay's
     RayJob and `ray up` set for the process they start);
  2. the job file's `ray.address`;
  3. neither: a private local Ray, started by this process for itself alone.
Addresses: "local" (a private local Ray: the same as no address, said explicitly), "auto" (the
cluster that `ray start` recorded on this host in <ray temp dir>/ray_current_cluster: joined only
when asked for by name), or "[ray://]host:port" of a head node's GCS (or its Ray Client server).

Invariants:
  * a cluster is joined only when an address says so: a private local Ray is started with
    ray.init(address="local"), which ignores the recorded cluster of a `ray start` on this host
    (plain ray.init() would join it and then refuse num_cpus: issue 27);
  * joining never waits longer than `connect_timeout_s` for a head that does not answer: its port
    is probed first (Ray's own connect retries for minutes), and RayConnectError says what was
    tried, from where, and what to check;
  * joining changes nothing of Ray's own address handling: a head on this host reached as
    127.0.0.1 is found at the host's routable address as Ray rewrites it (KubeRay's head pod); a
    cluster whose nodes themselves are on loopback (a test cluster of ray.cluster_utils) needs
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in this process's environment, as in the cluster's
    (`ray_on_loopback` is what a private local Ray under a loopback service uses).

`RayConfig` is the job file's `ray:` section (service/config/ray.py); Ray is imported by the
functions that need it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.config.ray import RAY_ADDRESS_FORMS, RayConfig, ray_host_port
from service.shutdown import ray_processes_in_their_own_groups

RAY_ADDRESS_ENV = "RAY_ADDRESS"


class RayConnectError(RuntimeError):
    """The Ray cluster named by the job or RAY_ADDRESS could not be joined; the message says why."""


def resolve_ray_address(config: RayConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(address, where it came from): RAY_ADDRESS, else the job file's ray.address, else "local"."""
    env = os.environ if environ is None else environ
    from_env = (env.get(RAY_ADDRESS_ENV) or "").strip()
    if from_env:
        try:
            RayConfig(address=from_env)
        except ValueError as e:
            raise RayConnectError(f"environment variable {RAY_ADDRESS_ENV}={from_env!r} is not an address Ray can join; "
                                  f"allowed: {RAY_ADDRESS_FORMS}") from e
        return from_env, f"the environment variable {RAY_ADDRESS_ENV}"
    if config.address is not None:
        return config.address, "the job file's ray.address"
    return "local", "the default (no ray.address, no RAY_ADDRESS)"


def recorded_cluster_address() -> str | None:
    """The address `ray start` recorded on this host (<ray temp dir>/ray_current_cluster), if any."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def wait_for_head(address: str, timeout_s: float, source: str) -> None:
    """Return once the head's port accepts a TCP connection; RayConnectError after `timeout_s`."""
    host_port = ray_host_port(address)
    assert host_port is not None, address  # RayConfig validated it
    host, port = host_port
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise RayConnectError(
                f"cannot reach the Ray cluster at {address} (from {source}) within {timeout_s:g} s "
                f"(ray.connect_timeout_s); last attempt: {last}. Check that its head node runs (`ray status` there), "
                f"that this host reaches {host}:{port}, or unset the address to run on a private local Ray"
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def ray_on_loopback() -> None:
    """Make the Ray started next keep 127.0.0.1 as this process's node IP, so its GCS, raylet, agents and
    workers all listen on loopback (measured on Ray 2.60; FINDINGS.md). Only for a private local Ray under
    a loopback service."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray's processes started after this
    # ray_constants read the variable when first imported (already, by `import ray`): set the module's
    # copy too. A private attribute of Ray: re-check on a Ray upgrade (docs/operations.md, Ports).
    ray_constants.ENABLE_RAY_CLUSTER = False


def connect_ray(config: RayConfig, *, local_cpus: int, loopback_service: bool,
                runtime_env: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Join the cluster the address names, or start a private local Ray (module doc). Returns a line that
    says which, for the start-up log. `local_cpus`: the logical CPUs of a private local Ray."""
    import ray

    address, source = resolve_ray_address(config, environ)
    common: dict[str, Any] = {"runtime_env": runtime_env or {}, "log_to_driver": False}
    if address == "local":
        if loopback_service:
            ray_on_loopback()
        # Its processes out of the service's process group: a group SIGTERM reaches the coordinator only,
        # which drains through a Ray that is still up, then stops it (service/shutdown.py).
        with ray_processes_in_their_own_groups():
            ray.init(address="local", num_cpus=local_cpus, include_dashboard=False, **common)
        return f"Ray: a private local Ray ({local_cpus} logical CPUs; {source})"
    if address == "auto":
        recorded = recorded_cluster_address()
        if recorded is None:
            raise RayConnectError(
                f"ray.address 'auto' (from {source}) joins the cluster `ray start` recorded on this host, but none is "
                "recorded (no ray_current_cluster file in Ray's temp dir); give the head's host:port instead"
            )
        target = recorded
    else:
        target = address
    if ray_host_port(target) is not None:  # a recorded address is host:port too; anything else is Ray's to refuse
        wait_for_head(target, config.connect_timeout_s, source)
    ray.init(address=target, **common)
    return f"Ray: joined the cluster at {target} (from {source}; GCS {ray.get_runtime_context().gcs_address})"
