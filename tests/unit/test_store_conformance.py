"""One conformance suite for every storage backend (trainer/storage/store.py S1-S4), run on the
local store and on S3Store against a real SeaweedFS server on loopback (tests/s3_server.py), plus
what only object storage has: presigned URLs, multipart uploads, a server that dies mid-write or is
gone (retries, then StoreError naming the key and never a credential).

Faults are planted behind the store's back with `Backdoor`: plain file writes on the local store,
a raw S3 client (obstore, with the server's credentials) on the object store. Expected contents are
the test's own bytes and hashlib's digests, never the store's answers.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import urllib.request
import uuid
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store as RawClient

from tests.s3_server import seaweedfs
from tests.waiting import wait_until
from trainer.storage import layouts
from trainer.storage.local_store import LocalStore
from trainer.storage.run_checkpoints import (
    PendingCheckpoint,
    RunState,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
)
from trainer.storage.s3_store import RetryPolicy, S3Store
from trainer.storage.store import MANIFEST, StoreError

pytestmark = pytest.mark.integration  # starts SeaweedFS servers

FAST_FAIL = RetryPolicy(max_retries=2, init_backoff_s=0.05, max_backoff_s=0.5, retry_timeout_s=10.0,
                        connect_timeout_s=2.0, read_timeout_s=10.0, request_timeout_s=60.0, body_attempts=2,
                        part_bytes=5 << 20, part_concurrency=1)


@pytest.fixture(scope="module")
def seaweed():
    with seaweedfs() as server:
        yield server


class Backdoor:
    """Reads and writes under a store's key without the store (to plant faults and to look)."""

    def __init__(self, store, server=None) -> None:  # noqa: ANN001
        self.store = store
        if isinstance(store, S3Store):
            self.raw = RawClient(server.bucket, endpoint=server.endpoint, region=server.region,
                                 access_key_id=server.access_key_id, secret_access_key=server.secret_access_key,
                                 client_options={"allow_http": True})

    def _path(self, key: str, rel: str) -> str:
        return "/".join(p for p in (self.store.prefix, key, rel) if p)

    def write(self, key: str, rel: str, data: bytes) -> None:
        if isinstance(self.store, S3Store):
            obstore.put(self.raw, self._path(key, rel), data)
        else:
            path = self.store.root / key / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def remove(self, key: str, rel: str) -> None:
        if isinstance(self.store, S3Store):
            obstore.delete(self.raw, self._path(key, rel))
        else:
            (self.store.root / key / rel).unlink()

    def exists(self, key: str, rel: str) -> bool:
        if isinstance(self.store, S3Store):
            try:
                obstore.head(self.raw, self._path(key, rel))
                return True
            except FileNotFoundError:
                return False
        return (self.store.root / key / rel).is_file()

    def head(self, key: str, rel: str) -> dict:
        return obstore.head(self.raw, self._path(key, rel))


@pytest.fixture
def fresh_reader(request, tmp_path):
    """The store as another machine sees it: for S3, a new instance with an empty cache of its own."""

    def reader(store):  # noqa: ANN001, ANN202
        if not isinstance(store, S3Store):
            return store
        return request.getfixturevalue("seaweed").store(store.prefix, cache_dir=tmp_path / "readers" / uuid.uuid4().hex,
                                                        retry=store.retry)

    return reader


def other_machine(server, store):  # noqa: ANN001, ANN201 - the tests that own their server
    return server.store(store.prefix, cache_dir=store.cache_dir.parent.parent / uuid.uuid4().hex, retry=store.retry)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("seaweed")
    return server.store(f"tests/{uuid.uuid4().hex[:8]}", cache_dir=tmp_path / "cache")


@pytest.fixture
def backdoor(store, request):
    return Backdoor(store, request.getfixturevalue("seaweed") if isinstance(store, S3Store) else None)


FILES = {"config.json": b'{"r": 4}', "weights/a.bin": os.urandom(3000), "weights/empty": b"",
         "weights/deep/b.bin": os.urandom(70_001)}


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def read_all(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    out = {}
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and p.name != MANIFEST and not any(rel.startswith(s + "/") for s in skip):
            out[rel] = p.read_bytes()
    return out


# -- the contract, on both backends ----------------------------------------------------------------


def test_put_get_list_roundtrip(store, tmp_path, fresh_reader):
    m = store.put_folder("runs/a/checkpoints/step-000001", make_folder(tmp_path / "src", FILES))
    assert {rel: (e.size, e.sha256) for rel, e in m.files.items()} == \
        {rel: (len(d), hashlib.sha256(d).hexdigest()) for rel, d in FILES.items()}
    got = fresh_reader(store).get_folder("runs/a/checkpoints/step-000001")
    assert read_all(got) == FILES
    store.put_folder("runs/a/checkpoints/step-000002", make_folder(tmp_path / "src2", {"x": b"2"}))
    store.put_folder("runs/a/checkpoints/step-000002/deeper", make_folder(tmp_path / "src3", {"y": b"3"}))
    assert store.list("runs/a/checkpoints") == ["runs/a/checkpoints/step-000001", "runs/a/checkpoints/step-000002"]
    assert store.list("runs/a") == [] and store.list("runs/nothing") == []  # only committed keys directly below
    assert store.key_of(store.url("runs/a/checkpoints/step-000001")) == "runs/a/checkpoints/step-000001"
    assert store.manifest("runs/a/checkpoints/step-000001").files == m.files


def test_write_folder_commits_on_success_only(store):
    with store.write_folder("k/ok") as d:
        (d / "f").write_bytes(b"ok")
    with pytest.raises(RuntimeError), store.write_folder("k/bad") as d:
        (d / "f").write_bytes(b"half")
        raise RuntimeError("crash while writing")
    assert store.list("k") == ["k/ok"] and store.manifest("k/bad") is None


def test_a_key_without_manifest_is_ignored_and_replaced(store, backdoor, tmp_path, fresh_reader):
    backdoor.write("runs/b/step-000003", "weights.bin", b"half of an upload")  # a write cut short (S2)
    assert store.manifest("runs/b/step-000003") is None and not store.exists("runs/b/step-000003")
    assert store.list("runs/b") == []
    with pytest.raises(StoreError, match="no manifest"):
        store.get_folder("runs/b/step-000003")
    store.put_folder("runs/b/step-000003", make_folder(tmp_path / "src", {"other.bin": b"whole"}))
    assert read_all(fresh_reader(store).get_folder("runs/b/step-000003")) == {"other.bin": b"whole"}
    assert not backdoor.exists("runs/b/step-000003", "weights.bin")  # the next write replaced it


def test_rewriting_a_committed_key_replaces_it_whole(store, backdoor, tmp_path, fresh_reader):
    key = "tinker/t/run/weights/w1"
    store.put_folder(key, make_folder(tmp_path / "v1", {"a": b"old a", "b": b"old b"}))
    reader = fresh_reader(store)
    assert read_all(reader.get_folder(key)) == {"a": b"old a", "b": b"old b"}
    store.put_folder(key, make_folder(tmp_path / "v2", {"a": b"new a", "b": b"new b"}))  # same names and sizes
    assert read_all(reader.get_folder(key)) == {"a": b"new a", "b": b"new b"}  # a cached copy is not served stale
    store.put_folder(key, make_folder(tmp_path / "v3", {"a": b"v3 a", "c": b"v3 c"}))
    assert read_all(reader.get_folder(key)) == {"a": b"v3 a", "c": b"v3 c"}
    assert not backdoor.exists(key, "b")  # the previous version's files that the new one lacks are gone
    # S3: a re-write that fails after it started has already taken the old manifest away
    with pytest.raises(StoreError, match="not committed"):
        store.put_folder(key, make_folder(tmp_path / "v4", {"a": b"v4"}), children=("missing",))
    assert store.manifest(key) is None
    with pytest.raises(StoreError):
        reader.get_folder(key)


def test_sub_keys_are_committed_on_their_own(store, tmp_path, fresh_reader):
    key = "runs/c/checkpoints/step-000004"
    with pytest.raises(StoreError, match="not committed"):  # S4: a parent needs its children first
        store.put_folder(key, make_folder(tmp_path / "p0", {"run_state.json": b"{}"}), children=("trainer", "adapter"))
    store.put_folder(f"{key}/trainer", make_folder(tmp_path / "t", {"slot.bin": b"T" * 100}))
    store.put_folder(f"{key}/adapter", make_folder(tmp_path / "a", {"adapter.bin": b"A" * 50}))
    parent = make_folder(tmp_path / "p", {"run_state.json": b"{}"})
    make_folder(parent / "trainer", {"ignored": b"committed on its own, not by the parent"})
    m = store.put_folder(key, parent, children=("trainer", "adapter"))
    assert set(m.files) == {"run_state.json"} and store.complete(key)
    reader = fresh_reader(store)
    assert read_all(reader.get_folder(f"{key}/trainer")) == {"slot.bin": b"T" * 100}
    assert (reader.get_folder(key) / "run_state.json").read_bytes() == b"{}"
    store.delete(f"{key}/adapter")  # a child gone: the parent is incomplete, and refused
    assert store.manifest(key) is not None and not store.complete(key)
    with pytest.raises(StoreError, match="sub-folders"):
        fresh_reader(store).get_folder(key)


def test_corrupted_file_is_refused(store, backdoor, tmp_path, fresh_reader):
    key = "handoff/x-r/v3"
    store.put_folder(key, make_folder(tmp_path / "src", FILES))
    bad = bytearray(FILES["weights/deep/b.bin"])
    bad[12345] ^= 0xFF  # same size, one bit pattern changed
    backdoor.write(key, "weights/deep/b.bin", bytes(bad))
    with pytest.raises(StoreError, match="b.bin does not match its manifest .*checksum differs"):
        fresh_reader(store).get_folder(key)
    backdoor.write(key, "weights/deep/b.bin", b"short")
    with pytest.raises(StoreError, match=r"size 5, expected 70001"):
        fresh_reader(store).get_folder(key)
    backdoor.remove(key, "weights/a.bin")
    with pytest.raises(StoreError, match="missing"):
        fresh_reader(store).get_folder(key)


def test_delete_and_copy(store, backdoor, tmp_path, fresh_reader):
    src = "runs/d/checkpoints/step-000005"
    store.put_folder(f"{src}/adapter", make_folder(tmp_path / "a", {"adapter_model.safetensors": b"w" * 999}))
    store.put_folder(src, make_folder(tmp_path / "s", {"run_state.json": b'{"step": 5}'}), children=("adapter",))
    m = store.copy(src, "runs/d/export")
    assert set(m.files) == {"run_state.json"} and m.children == ("adapter",) and store.complete("runs/d/export")
    reader = fresh_reader(store)
    assert read_all(reader.get_folder("runs/d/export/adapter")) == {"adapter_model.safetensors": b"w" * 999}
    with pytest.raises(StoreError, match="not a committed folder"):
        store.copy("runs/d/none", "runs/d/none2")
    store.delete(src)
    assert store.manifest(src) is None and store.manifest(f"{src}/adapter") is None
    assert not backdoor.exists(src, "run_state.json") and not backdoor.exists(src, "adapter/adapter_model.safetensors")
    assert store.complete("runs/d/export")  # the copy is its own
    store.delete(src)  # idempotent
    store.delete("runs/d/never-written")


def test_a_folder_committed_without_waiting_for_the_disk_reads_whole_and_is_checked_like_any(store, backdoor, tmp_path,
                                                                                             fresh_reader):
    """S5: `durable=False` changes when the write is answered, not what readers see."""
    key = "tinker/t/run/sampler_weights/ephemeral"
    with store.write_folder(key, durable=False) as d:
        make_folder(d, FILES)
    assert read_all(fresh_reader(store).get_folder(key)) == FILES
    backdoor.write(key, "weights/a.bin", b"torn by a stop of the machine")
    with pytest.raises(StoreError, match="a.bin does not match its manifest"):
        fresh_reader(store).get_folder(key)


def test_a_local_commit_syncs_files_manifest_and_folder_unless_not_durable(tmp_path, monkeypatch):
    """The local store's S1 (every file and the manifest on disk before the folder's entry is) and S5
    (nothing waited for): os.fsync's calls counted (a spy: the real calls still run)."""
    store = LocalStore(tmp_path / "store")
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    store.put_folder("k/durable", make_folder(tmp_path / "a", FILES))
    assert len(synced) == len(FILES) + 2  # each file, the manifest, the folder
    synced.clear()
    store.put_folder("k/ephemeral", make_folder(tmp_path / "b", FILES), durable=False)
    assert synced == [] and read_all(store.get_folder("k/ephemeral")) == FILES


def test_bad_keys_are_refused(store):
    for bad in ("", "../up", "a/../../b", "."):
        with pytest.raises(StoreError, match="invalid"):
            store.manifest(bad)
    if isinstance(store, S3Store):
        with pytest.raises(StoreError, match="outside this store"):
            store.key_of("s3://another-bucket/x")
        with pytest.raises(StoreError, match="local path"):
            store.key_of("/var/tmp/x")  # the callers then read it from the local filesystem


# -- run checkpoints on both backends -----------------------------------------------------------------


def _state(step: int) -> RunState:
    return RunState(name="a", registration_id="r1", objective="sft", rank=4, step=step, samples_trained=4 * step)


def _write_checkpoint(store, step: int, trainer_bytes: bytes = b"state") -> None:  # noqa: ANN001
    with PendingCheckpoint(store, "a", "r1", step) as p:
        with store.write_folder(p.adapter_key) as d:  # what the trainer's rank 0 does
            (d / "adapter_model.safetensors").write_bytes(b"adapter %d" % step)
        with store.write_folder(p.trainer_key) as d:
            (d / "slot_state.safetensors").write_bytes(trainer_bytes)
        p.commit(_state(step))


def test_run_checkpoints_commit_load_prune(store, backdoor, fresh_reader):
    ckpts = layouts.run_checkpoints("a", "r1")
    for step in (2, 4, 6):
        _write_checkpoint(store, step)
    # left by a crash: step 8's parts committed, the step folder never was; step 3 the same, older
    for step in (3, 8):
        key = layouts.run_checkpoint("a", "r1", step)
        with store.write_folder(f"{key}/adapter") as d:
            (d / "x").write_bytes(b"x")
        backdoor.write(key, "run_state.json", b"{}")
    assert latest_checkpoint(store, ckpts) == layouts.run_checkpoint("a", "r1", 6)
    ck = load_checkpoint(store, store.url(layouts.run_prefix("a", "r1")))
    assert ck.state.step == 6 and ck.folder == store.url(layouts.run_checkpoint("a", "r1", 6))
    assert (fresh_reader(store).get_folder(ck.adapter_key) / "adapter_model.safetensors").read_bytes() == b"adapter 6"
    doomed = prune_checkpoints(store, ckpts, keep=2)
    assert doomed == [layouts.run_checkpoint("a", "r1", s) for s in (2, 3)]  # step 8 may still be being written
    assert [k.rsplit("-", 1)[1] for k in store.list(ckpts)] == ["000004", "000006"]
    assert load_checkpoint(store, store.url(ckpts)).state.step == 6


# -- object storage only ----------------------------------------------------------------------------


def test_presigned_urls_download_the_files(seaweed, tmp_path):
    store = seaweed.store("presign", cache_dir=tmp_path / "c")
    store.put_folder("tinker/t/run/sampler_weights/s1/inner", make_folder(tmp_path / "i", {"z": b"zz"}))
    store.put_folder("tinker/t/run/sampler_weights/s1", make_folder(tmp_path / "s", FILES), children=("inner",))
    urls = store.presigned_urls("tinker/t/run/sampler_weights/s1", expires_s=300)
    assert set(urls) == set(FILES) | {"inner/z"}
    for rel, url in urls.items():  # a plain HTTP client with no credentials
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.read() == (FILES | {"inner/z": b"zz"})[rel]
    with pytest.raises(StoreError, match="not a complete folder"):
        store.presigned_urls("tinker/t/run/sampler_weights/none")
    with pytest.raises(StoreError, match="1 to 604800"):
        store.presigned_urls("tinker/t/run/sampler_weights/s1", expires_s=0)


def test_large_files_go_up_in_parts_and_come_back_verified(seaweed, tmp_path):
    store = seaweed.store("multipart", cache_dir=tmp_path / "c", retry=FAST_FAIL)  # 5 MiB parts
    data = os.urandom(12 << 20)
    store.put_folder("swap/rank0/t1", make_folder(tmp_path / "s", {"slot.swap": data, "small": b"s"}))
    etag = Backdoor(store, seaweed).head("swap/rank0/t1", "slot.swap")["e_tag"].strip('"')
    assert etag.endswith("-3"), f"12 MiB in 5 MiB parts is a 3-part upload; ETag {etag}"
    assert "-" not in Backdoor(store, seaweed).head("swap/rank0/t1", "small")["e_tag"]
    assert (other_machine(seaweed, store).get_folder("swap/rank0/t1") / "slot.swap").read_bytes() == data


def _no_credentials(server, text: str) -> None:  # noqa: ANN001
    assert server.access_key_id not in text and server.secret_access_key not in text, text


def test_server_crash_mid_upload_leaves_the_previous_checkpoint_current(tmp_path):
    with seaweedfs() as server:
        store = server.store("crash", cache_dir=tmp_path / "c", retry=FAST_FAIL)
        _write_checkpoint(store, 1)
        pending = PendingCheckpoint(store, "a", "r1", 2)
        src = make_folder(tmp_path / "t2", {"a.json": b"{}", "b.safetensors": os.urandom(40 << 20)})
        failure: list[BaseException] = []

        def trainer_rank0() -> None:  # the trainer's commit of step 2's trainer/ (files go up in sorted order)
            try:
                store.put_folder(pending.trainer_key, src)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                failure.append(e)

        writer = threading.Thread(target=trainer_rank0)
        writer.start()
        peek = Backdoor(store, server)
        wait_until(lambda: peek.exists(pending.trainer_key, "a.json"), "step 2's first file uploaded", interval_s=0.02)
        server.signal(signal.SIGSTOP)  # frozen between the files: b.safetensors' upload cannot finish
        server.kill()
        writer.join(timeout=300)
        assert not writer.is_alive() and len(failure) == 1 and isinstance(failure[0], StoreError)
        message = str(failure[0])
        assert store.url(pending.trainer_key) in message and "uploading b.safetensors failed" in message, message
        assert re.search(r"after 2 retries", message), message  # FAST_FAIL's bound, spent
        _no_credentials(server, message)
        with pytest.raises(StoreError) as cleanup:  # the coordinator's clean-up cannot reach the server either
            pending.__exit__(None, None, None)
        _no_credentials(server, str(cleanup.value))

        server.start()  # back, same data: step 1 is current, step 2 never became a checkpoint
        reader = other_machine(server, store)
        ckpts = layouts.run_checkpoints("a", "r1")
        assert reader.manifest(pending.trainer_key) is None and not reader.complete(pending.key)
        assert latest_checkpoint(reader, ckpts) == layouts.run_checkpoint("a", "r1", 1)
        assert load_checkpoint(reader, reader.url(ckpts)).state.step == 1
        with pytest.raises(StoreError, match="no manifest"):
            reader.get_folder(pending.trainer_key)
        _write_checkpoint(store, 2, trainer_bytes=b"step 2 again")  # the next write replaces the leftovers
        assert load_checkpoint(reader, reader.url(ckpts)).state.step == 2
        got = reader.get_folder(layouts.run_checkpoint("a", "r1", 2) + "/trainer")
        assert read_all(got) == {"slot_state.safetensors": b"step 2 again"}


def test_server_gone_retries_then_fails_with_a_clear_reason(tmp_path):
    with seaweedfs() as server:
        store = server.store("gone", cache_dir=tmp_path / "c", retry=FAST_FAIL)
        store.put_folder("runs/e/export", make_folder(tmp_path / "s", {"f": b"1"}))
        server.kill()
        calls = {"manifest": lambda: store.manifest("runs/e/export"),
                 "get_folder": lambda: store.get_folder("runs/e/export"),
                 "put_folder": lambda: store.put_folder("runs/e/export", tmp_path / "s"),
                 "list": lambda: store.list("runs/e"),
                 "delete": lambda: store.delete("runs/e/export"),
                 "copy": lambda: store.copy("runs/e/export", "runs/e/copy")}
        for name, call in calls.items():
            with pytest.raises(StoreError) as e:
                call()
            text = str(e.value)
            assert "s3://lorafleet-tests/gone/runs/e" in text and "failed" in text, (name, text)
            assert re.search(r"after 2 retries", text), (name, text)
            _no_credentials(server, text)
        _no_credentials(server, repr(store))


def test_the_location_and_the_aws_variables_configure_the_store(seaweed, monkeypatch, tmp_path):
    from trainer.storage.locations import open_store

    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("LORAFLEET_STORAGE_CACHE", str(tmp_path / "opened"))
    location = f"s3://{seaweed.bucket}/env-{uuid.uuid4().hex[:6]}"
    opened = open_store(location)
    assert isinstance(opened, S3Store) and opened.url("a/b") == f"{location}/a/b" and opened.endpoint == seaweed.endpoint
    assert tmp_path / "opened" in opened.cache_dir.parents
    store = S3Store.from_url(location + "/", cache_dir=tmp_path / "c")
    store.put_folder("a/b", make_folder(tmp_path / "s", {"f": b"via the environment"}))
    assert read_all(opened.get_folder("a/b")) == {"f": b"via the environment"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there: the S3-specific one wins
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", seaweed.endpoint)
    assert S3Store.from_url(location, cache_dir=tmp_path / "c2").manifest("a/b") is not None
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + seaweed.secret_access_key)  # refused by the server
    with pytest.raises(StoreError) as refused:
        S3Store.from_url(location, cache_dir=tmp_path / "c3", retry=FAST_FAIL).get_folder("a/b")
    assert f"{location}/a/b" in str(refused.value)
    _no_credentials(seaweed, str(refused.value))
    for bad in ("s3://", "s3://Upper/x", "s3://b/x", "http://bucket/x", f"s3://{seaweed.bucket}/../x"):
        with pytest.raises(StoreError, match="invalid|not an s3"):
            S3Store.from_url(bad)


class ResettingListener:
    """A stand-in for a gateway that is restarting (a fault not caused otherwise on demand): it
    holds the S3 port and resets every connection it accepts, counting them."""

    def __init__(self, port: int) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.resets = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import socket
        import struct

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: done
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            conn.close()
            self.resets += 1

    def close(self) -> None:
        import socket

        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(timeout=30)


def test_transient_failures_are_retried_until_the_server_is_back(tmp_path):
    # bounded by time, not count: the server's restart took 3-20 s here, depending on the machine's load
    patient = RetryPolicy(max_retries=100_000, init_backoff_s=0.05, max_backoff_s=1.0, retry_timeout_s=240.0,
                          connect_timeout_s=2.0, read_timeout_s=30.0, request_timeout_s=60.0)
    with seaweedfs() as server:
        store = server.store("flaky", cache_dir=tmp_path / "c", retry=patient)
        store.put_folder("runs/f/export", make_folder(tmp_path / "s", FILES))
        server.kill()
        resetter = ResettingListener(server.ports["s3"])
        got: list = []

        def read() -> None:
            try:
                got.append(read_all(other_machine(server, store).get_folder("runs/f/export")))
            except Exception as e:  # noqa: BLE001 - the assertion below shows what the read raised
                got.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wait_until(lambda: resetter.resets >= 3, "three connections reset (the client retrying)", timeout_s=120)
        finally:
            resetter.close()
        server.start()  # the gateway is back on its port: the same read, still retrying, now succeeds
        reader.join(timeout=240)
        assert not reader.is_alive() and got == [FILES]
