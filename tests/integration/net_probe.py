"""What a process tree listens on (psutil): the loopback checks of Ray and the SGLang engines."""

from __future__ import annotations

import psutil


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `pid` and its children."""
    root = psutil.Process(pid)
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            found += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return found


def is_loopback(ip: str) -> bool:
    return ip.removeprefix("::ffff:") == "127.0.0.1" or ip == "::1"
