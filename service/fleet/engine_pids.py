"""SGLang engines left behind by a killed service, on every node: their record (`record_engines`) and
reaping (`reap_engines` on this host, `reap_engines_everywhere` on every host of the cluster).

SGLang servers run in their own session (so a stop reaches their children). Started by an engine
launcher they die with it (rollout/engines/engine.py die_with_parent), and the launchers die with the
driver's job; this record is the second line: a server that outlived all that (an older version,
a launcher that hung) is killed at the next start. Each engine's node, pid and port are recorded in
<state_dir>/engines.json at start and after every engine restart or move; reaping kills what still
runs under the SGLang server's command line with a recorded pid or port, on the host it was
recorded for: this host's entries here, another host's by a task on a live node of that address.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

ENGINE_PIDS_FILE = "engines.json"
REMOTE_REAP_TIMEOUT_S = 60.0


class RecordedEngine(Protocol):
    """What is recorded of an engine (rollout.messages.EngineHealth has these)."""

    url: str
    pid: int | None
    node_id: str
    node_ip: str


def record_engines(state_dir: Path, engines: Iterable[RecordedEngine]) -> None:
    entries = [{"node_id": e.node_id, "node_ip": e.node_ip, "pid": e.pid, "port": int(e.url.rsplit(":", 1)[1])}
               for e in engines if e.url]
    (Path(state_dir) / ENGINE_PIDS_FILE).write_text(json.dumps({"engines": entries}))


def _recorded(state_dir: Path) -> list[dict[str, Any]]:
    path = Path(state_dir) / ENGINE_PIDS_FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return []
    if "engines" in data:
        return list(data["engines"])
    # the record of a version before per-node entries: {"ports": [...], "pids": [...]}, this host's
    return [{"node_ip": "", "pid": p} for p in data.get("pids", [])] + [{"node_ip": "", "port": p} for p in data.get("ports", [])]


def reap_engines(state_dir: Path, local_ips: set[str] | None = None) -> list[int]:
    """Kill the recorded engines of this host (entries whose node address is in `local_ips`, or recorded
    without one; all entries when `local_ips` is None: a caller outside Ray, on a one-host cluster) and
    remove the record. Returns the pids killed."""
    entries = [e for e in _recorded(state_dir) if local_ips is None or not e.get("node_ip") or e["node_ip"] in local_ips]
    killed = reap_recorded(entries)
    (Path(state_dir) / ENGINE_PIDS_FILE).unlink(missing_ok=True)
    return killed


def reap_engines_everywhere(state_dir: Path) -> list[int]:
    """reap_engines for this host, and for each other recorded host a task on a live Ray node with that
    address (a host with no live node has lost its engines with it). Needs Ray initialized."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = {ray.util.get_node_ip_address(), "127.0.0.1", "localhost"}
    entries = _recorded(state_dir)
    remote: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e.get("node_ip") and e["node_ip"] not in here:
            remote.setdefault(e["node_ip"], []).append(e)
    killed = reap_engines(state_dir, here)
    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    reaper = ray.remote(num_cpus=0, max_retries=0)(reap_recorded)
    refs = {ip: reaper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=alive[ip], soft=False)).remote(found)
            for ip, found in remote.items() if ip in alive}
    for ip in sorted(set(remote) - set(refs)):
        log.info("engines recorded on %s: no live Ray node there now (they went with it)", ip)
    for ip, ref in refs.items():
        try:
            killed += ray.get(ref, timeout=REMOTE_REAP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - one host's answer must not stop the start
            log.warning("reaping engines left on %s: %s: %s", ip, type(e).__name__, e)
    return killed


def reap_recorded(entries: list[dict[str, Any]]) -> list[int]:
    """On this host: SIGKILL the process group of every SGLang server whose pid or port is among `entries`."""
    pids = {e["pid"] for e in entries if e.get("pid")}
    ports = {e["port"] for e in entries if e.get("port")}
    if not pids and not ports:
        return []
    killed = []
    for pid in _sglang_server_pids():
        if pid in pids or _port_of(pid) in ports:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.1)
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
        if b"rollout.engines.sglang_server" in argv or b"sglang.launch_server" in argv:
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
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
