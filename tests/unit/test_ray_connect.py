"""Which Ray the service runs on (service/fleet/ray_connect.py): the address forms a job file may give, where
the address comes from (RAY_ADDRESS, the job file, else a private local Ray), and the connect timeout
against a port nobody listens on (a real socket; Ray is never initialized here)."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from service.config.job import JobConfig
from service.config.ray import RayConfig
from service.fleet.ray_connect import RayConnectError, connect_ray, resolve_ray_address, wait_for_head

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("address", ["local", "auto", "10.0.0.5:6379", "head-0.ray.svc:6379", "ray://head:10001",
                                     "127.0.0.1:6379", "[::1]:6379"])
def test_address_forms_ray_can_join_are_accepted(address):
    assert RayConfig(address=address).address == address


@pytest.mark.parametrize("address,why", [
    ("10.0.0.5", "not an address Ray can join"),
    ("http://head:6379", "not an address Ray can join"),
    ("head:99999", "port must be 1..65535"),
    ("", "not an address Ray can join"),
])
def test_other_addresses_are_refused_naming_the_allowed_forms(address, why):
    with pytest.raises(ValidationError, match=why) as err:
        RayConfig(address=address)
    assert "allowed: 'local', 'auto', or '[ray://]host:port'" in str(err.value) or "port must" in why


def test_the_job_file_has_a_ray_section_and_refuses_unknown_keys():
    job = JobConfig.model_validate({"base_model": {"path": "m"}, "trainer": {}, "ray": {"address": "10.0.0.5:6379"}})
    assert job.ray.address == "10.0.0.5:6379" and job.ray.connect_timeout_s == 60.0
    with pytest.raises(ValidationError, match="adress"):
        JobConfig.model_validate({"base_model": {"path": "m"}, "trainer": {}, "ray": {"adress": "x:1"}})


@pytest.mark.parametrize("env,job,expected", [
    ({}, None, ("local", "the default")),
    ({"RAY_ADDRESS": ""}, None, ("local", "the default")),
    ({}, "10.0.0.5:6379", ("10.0.0.5:6379", "the job file's ray.address")),
    ({"RAY_ADDRESS": "10.0.0.9:6379"}, "10.0.0.5:6379", ("10.0.0.9:6379", "RAY_ADDRESS")),
    ({"RAY_ADDRESS": "10.0.0.9:6379"}, "local", ("10.0.0.9:6379", "RAY_ADDRESS")),
])
def test_ray_address_comes_from_the_environment_then_the_job_then_local(env, job, expected):
    address, source = resolve_ray_address(RayConfig(address=job), env)
    assert address == expected[0] and expected[1] in source


def test_a_bad_ray_address_in_the_environment_is_refused_by_name():
    with pytest.raises(RayConnectError, match=r"RAY_ADDRESS='nohost' is not an address Ray can join; allowed"):
        resolve_ray_address(RayConfig(), {"RAY_ADDRESS": "nohost"})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nobody listens there


def test_an_unreachable_head_is_given_up_after_the_connect_timeout():
    port = closed_port()
    with pytest.raises(RayConnectError) as err:  # an endless retry would end in pytest's own timeout instead
        wait_for_head(f"127.0.0.1:{port}", 1.0, "the job file's ray.address")
    msg = str(err.value)
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port} (from the job file's ray.address) within 1 s" in msg
    assert "ConnectionRefusedError" in msg and "ray.connect_timeout_s" in msg


def test_connect_ray_gives_up_before_ray_is_initialized(monkeypatch):
    import ray

    port = closed_port()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayConnectError, match="cannot reach the Ray cluster"):
        connect_ray(RayConfig(address=f"127.0.0.1:{port}", connect_timeout_s=0.5), local_cpus=1, loopback_service=True)
    assert not ray.is_initialized()


def test_auto_without_a_recorded_cluster_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's temp dir: nothing recorded there
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RayConnectError, match="ray.address 'auto' .* but none is recorded"):
        connect_ray(RayConfig(address="auto"), local_cpus=1, loopback_service=True)
