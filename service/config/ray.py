"""The job file's `ray:` section: which Ray cluster the service runs on (service/fleet/ray_connect.py
joins it; this module imports no Ray). A section of the job file (service/config/job.py's JobConfig)
kept apart so that config.py stays one readable module."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from trainer.strict_model import StrictModel

_RAY_HOST_PORT = re.compile(r"^(?:ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")
RAY_ADDRESS_FORMS = "'local', 'auto', or '[ray://]host:port' of the head node (e.g. 10.0.0.5:6379, ray://head:10001)"


def ray_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a '[ray://]host:port' Ray address; None for 'local', 'auto' or anything else."""
    m = _RAY_HOST_PORT.match(address)
    return (m["host"].strip("[]"), int(m["port"])) if m else None


class RayConfig(StrictModel):
    """The job file's `ray:` section: which Ray cluster the service runs on."""

    address: str | None = Field(
        None,
        description="The Ray cluster to join: '[ray://]host:port' of its head node, 'auto' (the cluster `ray start` "
        "recorded on this host), or 'local' (a private local Ray). Unset: a private local Ray. The environment "
        "variable RAY_ADDRESS, when set, takes precedence.",
    )
    connect_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Give up joining the cluster when its head has not answered for this many seconds (the service "
        "then exits with an error naming the address).",
    )

    @field_validator("address")
    @classmethod
    def _known_form(cls, address: str | None) -> str | None:
        if address is None:
            return None
        address = address.strip()
        host_port = ray_host_port(address)
        if host_port is not None and not 0 < host_port[1] <= 65535:
            raise ValueError(f"ray.address {address!r}: port must be 1..65535")
        if address in ("local", "auto") or host_port is not None:
            return address
        raise ValueError(f"ray.address {address!r} is not an address Ray can join; allowed: {RAY_ADDRESS_FORMS}")
