"""tests/s3_server.py's SeaweedFS, when a port picked for it is taken before the server binds it.

The tier runs two test files at once, and a full run of it here saw it: another file's process took a picked
port in the moment between the pick and the server's bind, and the server exited ("bind: address
already in use"). The race cannot be caused on demand, so the first pick here returns ports of which
one is held by this test (a named fault injection); the server, its bind failure and the retry on
fresh ports are real.
"""

from __future__ import annotations

import socket

import pytest

import tests.s3_server as s3_server

pytestmark = pytest.mark.unit


def test_a_taken_port_gets_the_server_fresh_ports(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = s3_server.free_ports
        picks = []

        def first_pick_has_a_taken_port(n: int) -> list[int]:
            ports = real(n)
            if not picks:
                ports[s3_server._LISTENERS.index("filer")] = taken  # the listener that run saw fail
            picks.append(ports)
            return ports

        monkeypatch.setattr(s3_server, "free_ports", first_pick_has_a_taken_port)
        with s3_server.seaweedfs() as server:
            assert len(picks) == 2 and taken not in server.ports.values()
            assert server.ports == dict(zip(s3_server._LISTENERS, picks[1], strict=True))  # serving its bucket: start checked
        assert not server.folder.exists()
