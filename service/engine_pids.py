"""SGLang engines left behind by a killed service: their record (`record_engines`) and reaping (`reap_engines`).

SGLang servers run in their own session (so a stop reaches their children), which
also means they outlive a service that was killed with SIGKILL. Their ports and
pids are recorded in <state_dir>/engines.json at start and after every engine
restart; the next start (and close) kills what is still listening under the SGLang
server's command line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_PIDS_FILE = "engines.json"


def record_engines(state_dir: Path, urls: list[str]) -> None:
    ports = [int(u.rsplit(":", 1)[1]) for u in urls if u]
    pids = [pid for pid in _sglang_server_pids() if _port_of(pid) in ports]
    (Path(state_dir) / ENGINE_PIDS_FILE).write_text(json.dumps({"ports": ports, "pids": pids}))


def reap_engines(state_dir: Path) -> list[int]:
    path = Path(state_dir) / ENGINE_PIDS_FILE
    if not path.is_file():
        return []
    try:
        recorded = json.loads(path.read_text())
    except ValueError:
        recorded = {}
    ports = set(recorded.get("ports", []))
    killed = []
    for pid in _sglang_server_pids():
        if pid in recorded.get("pids", []) or _port_of(pid) in ports:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.1)
    path.unlink(missing_ok=True)
    if killed:
        log.warning("killed %d SGLang server(s) left by a previous run: %s", len(killed), killed)
    return killed


def _sglang_server_pids() -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rollout.sglang_server" in argv or b"sglang.launch_server" in argv:
            out.append(int(entry.name))
    return out


def _port_of(pid: int) -> int | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for i, a in enumerate(argv[:-1]):
        if a == b"--port":
            try:
                return int(argv[i + 1])
            except ValueError:
                return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
