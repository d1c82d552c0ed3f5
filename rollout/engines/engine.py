"""Launch, watch, stop and restart SGLang server processes.

An `EngineProcess` is one server: a subprocess in its own process group (so a
stop reaches SGLang's scheduler and detokenizer children too), its output in a
log file, readiness awaited with a deadline. The launch command and every
CPU-only adjustment come from rollout.engines.sglang_cpu.

Invariants:
* `url` is set only while a process is started; `stop()` is idempotent and
  always leaves no process of this engine behind (on CUDA SIGTERM to the group,
  then SIGKILL after a grace period; on CPU SIGKILL at once: see `stop`).
* `wait_ready()` either returns with the server answering /health_generate (a
  real generation), or raises `EngineStartError` with the log's tail, after
  stopping the process.
* With `die_with_parent` the server gets SIGKILL when the thread that started it
  ends (Linux PR_SET_PDEATHSIG; SGLang's own children die with the server): an
  engine launcher (rollout/engines/engine_launcher.py) starts it from a thread that lives
  as long as its process, so a lost launcher (its node's raylet died) leaves no
  engine behind holding the node's GPUs and ports.
* A CPU server runs at `engines.cpu_nice` (every thread and process it starts, and its session's
  autogroup where Linux has one): it yields the shared cores to the training loop's serial path.
  A GPU server keeps the service's priority.
"""

from __future__ import annotations

import ctypes
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from rollout.config import EngineConfig
from rollout.engines.sglang_cpu import ENGINE_SCRATCH_ENV, ServerLaunch, build_server_launch


class EngineStartError(RuntimeError):
    """A server did not become ready; the message holds the tail of its log."""


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# uvicorn's line when the server's port was taken between pick_free_port and the server's bind
# (seen in CI: another process took the port in the ~15 s SGLang spends loading first). The
# server does not exit after it: it waits in "application shutdown" until killed.
PORT_IN_USE_MARK = "error while attempting to bind on address"
PORT_RETRIES = 3  # fresh ports tried when a picked port is taken before the server binds it
GRACE_S = 15.0  # a CUDA server's time for SGLang's own exit after SIGTERM (EngineProcess.stop)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


SCRATCH_PREFIX = "lorafleet-engine-"  # an engine start's scratch folder in the system's temp dir: <prefix><index>-<random>
SCRATCH_OWNER = "server.pgid"  # in it: the server's process group (its pid: it leads its own session)


def sweep_stale_scratch(root: Path | None = None) -> list[Path]:
    """Remove the scratch folders (in `root`, default the system's temp dir) of engines that ended without
    their stop: the server was reaped after a coordinator or launcher was killed, so no stop removed its
    folder. A folder is stale when the process group its owner file names has no process left; a folder
    without an owner file (an engine between its folder and its spawn) and one whose group still runs, of
    this service or another on the host, are kept. Returns the folders removed."""
    gone = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        try:
            pgid = int((folder / SCRATCH_OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not _group_alive(pgid):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def scratch_env(scratch: Path) -> dict[str, str]:
    """The server's environment for its scratch folder: ENGINE_SCRATCH_ENV and the temporary directory.
    SGLang names its ZeroMQ sockets with `tempfile.NamedTemporaryFile(delete=False)` and never removes
    them: six files in the system's temp dir at every start, a long-running service's restarts
    included. With TMPDIR set here they go into this folder, removed at stop. It is made in the
    system's temp dir, not under the state dir, because a socket's path has at most 107 bytes.
    Torch's compile cache stays where it was (its default is under the temp dir too), so a restart
    keeps it."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # torch's own rule (torch._inductor's default_cache_dir)
    return {ENGINE_SCRATCH_ENV: str(scratch), "TMPDIR": str(scratch),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")}


class EngineProcess:
    """One SGLang server process."""

    def __init__(self, index: int, cfg: EngineConfig, model_path: str | Path, *, log_dir: str | Path | None = None,
                 die_with_parent: bool = False):
        self.index = index
        self.die_with_parent = die_with_parent
        self.cfg = cfg
        self.model_path = str(model_path)
        self.log_dir = Path(log_dir or cfg.log_dir or tempfile.mkdtemp(prefix="lorafleet-engines-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"engine-{index}.log"
        self.port: int | None = None
        self.launch: ServerLaunch | None = None
        self.starts = 0  # how many times this engine was started (1 + restarts)
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_offset = 0  # where this start's lines begin in log_path
        self._scratch: Path | None = None  # this start's scratch folder (scratch_env), removed at stop

    @property
    def cpu_nice(self) -> int:
        """The niceness this start runs at: the config's on CPU, 0 (the service's) on GPU."""
        return self.cfg.cpu_nice if self.launch is not None and self.launch.device == "cpu" else 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"engine {self.index} is not started")
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def scratch(self) -> Path | None:
        """This start's scratch folder (scratch_env), None once stopped."""
        return self._scratch

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Spawn the server (returns at once; see wait_ready)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"engine {self.index} is already running (pid {self._proc.pid})")
        self.port = self.cfg.port_for(self.index) or pick_free_port(self.cfg.host)
        self.launch = build_server_launch(self.cfg, self.model_path, self.port)
        self._drop_scratch()  # a start whose process ended without a stop left one
        sweep_stale_scratch()  # and those other engines' starts left when their stop never came
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{self.index}-"))
        self.launch.env.update(scratch_env(self._scratch))
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"\n=== lorafleet: start {self.starts + 1}: {' '.join(self.launch.argv)}\n".encode())
        self._log_file.flush()
        self._log_offset = self._log_file.tell()
        self._proc = subprocess.Popen(
            self.launch.argv,
            env=self.launch.env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stop() reaches SGLang's children
            preexec_fn=_child_setup(self.die_with_parent, self.cpu_nice),
        )
        if self.cpu_nice:
            share_autogroup_nice(self._proc.pid, self.cpu_nice)
        (self._scratch / SCRATCH_OWNER).write_text(str(self._proc.pid))  # its own session: pgid == pid
        self.starts += 1

    def wait_ready(self, deadline_s: float | None = None) -> float:
        """Block until the server generates (GET /health_generate is 200); return the seconds waited
        (since the last start).

        A port this engine picked itself that was taken before the server bound it is replaced by
        a fresh one (PORT_RETRIES times); a configured port that is in use is an EngineStartError."""
        deadline_s = deadline_s or self.cfg.startup_deadline_s
        t0 = time.monotonic()
        port_retries = PORT_RETRIES
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self.stop()
                raise EngineStartError(
                    f"engine {self.index} exited with code {code} before it was ready; log {self.log_path}:\n{tail(self.log_path)}"
                )
            if self._port_taken():
                configured = self.cfg.port_for(self.index)
                if configured or port_retries == 0:
                    taken = self.port
                    self.stop()
                    why = ("it is configured in engines.ports" if configured
                           else f"{PORT_RETRIES + 1} picked ports were all taken before the server bound them")
                    raise EngineStartError(
                        f"engine {self.index} could not bind {self.cfg.host}:{taken} ({why}); "
                        f"free the port or leave engines.ports empty to pick free ports; log {self.log_path}"
                    )
                port_retries -= 1
                self.stop()
                self.start()  # a fresh pick_free_port
                t0 = time.monotonic()  # the new server gets the whole startup deadline
                continue
            try:
                if httpx.get(self.url + "/health_generate", timeout=10.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > deadline_s:
                self.stop()
                raise EngineStartError(
                    f"engine {self.index} not ready after {deadline_s:.0f} s (startup_deadline_s); "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _port_taken(self) -> bool:
        """This start's log says the server could not bind its port."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return PORT_IN_USE_MARK.encode() in f.read()
        except OSError:
            return False

    def is_alive(self) -> bool:
        """The process is running (cheap; see EngineClient.health for whether it answers)."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace_s: float | None = None) -> None:
        """Terminate the server and its children; idempotent.

        `grace_s`: how long SGLang may take over its own exit after SIGTERM before the group is killed.
        Default: GRACE_S on CUDA, none on CPU. SGLang's exit looks at its SIGTERM flag every 5 s, then
        lets each scheduler free its GPU memory before the tree is killed (without that, a SIGKILL can
        leave the memory held); a CPU server has no such memory, and by the time lorafleet stops an
        engine no request of its own is left on it, so the group is killed at once (measured: 6.1 s
        from SIGTERM to exit on the tiny world, paid at every service stop)."""
        proc, self._proc = self._proc, None
        if grace_s is None:
            grace_s = GRACE_S if self.launch is None or self.launch.device == "cuda" else 0.0
        if proc is not None:
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                pgid = None
            if pgid is not None and grace_s > 0:
                _signal_group(pgid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            if pgid is not None:
                # The group leader may exit before its children: kill what is left either way.
                _signal_group(pgid, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if pgid is not None:
                _wait_group_gone(pgid, timeout_s=10.0)
        self._drop_scratch()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def restart(self, deadline_s: float | None = None) -> float:
        """Stop (if needed), start again, wait until ready. Adapters must be loaded again afterwards."""
        self.stop()
        self.start()
        return self.wait_ready(deadline_s)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None  # loaded before any fork


_PRIO_PROCESS = 0  # sys/resource.h: `who` is a process (0: the caller)


def _child_setup(die_with_parent: bool, nice: int):  # noqa: ANN202 - a preexec_fn, or None
    """What the child runs before exec, or None: only C calls (no allocation, no lock taken), as code between
    fork and exec must be. `die_with_parent`: SIGKILL when the spawning thread ends. `nice`: the child's
    niceness, inherited by every thread and process the server starts."""
    if _LIBC is None or (not die_with_parent and not nice):
        return None

    def setup() -> None:
        if die_with_parent:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if nice:
            _LIBC.setpriority(_PRIO_PROCESS, 0, nice)

    return setup


def share_autogroup_nice(pid: int, nice: int) -> bool:
    """The niceness of `pid`'s autogroup (Linux: /proc/<pid>/autogroup): where the autogroup scheduler is on,
    the cores are shared between sessions (autogroups) first, so a server that leads its own session yields
    only if its autogroup does. The child's setsid ran before its exec, so its group exists once Popen
    returns. False where the kernel has no autogroup (nothing to do: the threads' niceness then decides)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of the group exists (killed children are reaped by init shortly after)."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
