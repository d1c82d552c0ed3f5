"""The storage layer on S3-compatible object storage: `S3Store`, a key's folder under
``s3://bucket/prefix/key/`` (AWS S3, MinIO, SeaweedFS, GCS's S3 interface, ...).

Same semantics as the local store (trainer/storage/store.py S1-S4), with objects:
  * a folder is its files as objects ``prefix/key/<relative path>`` and its manifest object
    ``prefix/key/.lorafleet-manifest.json`` (store.py ``MANIFEST``), PUT LAST, after every file's
    upload has completed. A single PUT is atomic in S3, so a reader sees the manifest whole or not
    at all; a key without it is not committed (S2): `get_folder` refuses it, `list` skips it, the
    next `put_folder` of the key replaces its objects;
  * re-writing a committed key first DELETEs its manifest (S3), then the previous version's files
    that the new one does not have, then uploads; `delete` removes every manifest below the key
    (the key's first) before any file;
  * `get_folder` downloads into a local cache folder (``cache_dir/<key>``) and hashes every file as
    it arrives: a size or SHA-256 that differs from the manifest is refused (StoreError, S1). A
    cached copy whose manifest equals the store's is reused (re-verified when verify=True);
    sub-keys land in their sub-folders of the parent's copy, as on a local disk;
  * `copy` is server-side (CopyObject; objects over 5 GiB, S3's limit for it, are streamed through
    this process); `url` is ``s3://bucket/prefix/key``; `presigned_urls` hands out GET URLs of a
    folder's files (Tinker's ``get_external_weights_urls``).

Connection: the bucket and prefix come from the URL; endpoint, region and credentials from the
standard AWS variables (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL; AWS_REGION, else
AWS_DEFAULT_REGION, else us-east-1; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)
unless given to the constructor. Credentials are never printed: errors name the key, the request
and the failure, and any credential text in a server's answer is replaced by ``***``.
The local cache: ``LORAFLEET_STORAGE_CACHE`` or the constructor's ``cache_dir``, else a folder in
the system's temporary folder; one per bucket and prefix.

Client library: obstore (Python bindings of the Rust ``object_store`` crate), chosen over boto3 and
s3fs (docs/operations.md "Object storage"; measured against SeaweedFS on loopback here, 512 MiB
files, 3 rounds: GET 210-269 MB/s obstore, 93-131 boto3, 21-50 s3fs; PUT 19-28, 19-25, 9-18):
  * speed: requests run in Rust off the GIL; a file given as a path is read and sent without
    passing through Python; the fastest reads of the three;
  * multipart: `put` of a file larger than the part size becomes a multipart upload with parts in
    flight concurrently, and the upload is ABORTED when a part fails (no invisible half-object);
    s3fs buffers whole blocks in Python, boto3 needs its separate transfer manager;
  * retries: every request retries 5xx answers, refused / reset connections and timeouts with
    exponential backoff and jitter, bounded by a count and a total time (`RetryPolicy`), then
    raises; boto3's retry modes are comparable, s3fs retries only some errors itself;
  * one small wheel with no dependencies beyond typing_extensions (boto3 brings botocore,
    s3transfer, jmespath; s3fs brings aiobotocore, aiohttp and an event loop thread).
Reads of a response body are retried here too (`RetryPolicy.body_attempts`): a connection cut in
the middle of a download restarts that file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import obstore
from obstore.store import S3Store as _ObjectStoreS3

from trainer.storage.store import MANIFEST, CheckpointStore, FileEntry, Manifest, StoreError, check_key, file_digest, folder_files

T = TypeVar("T")
COPY_OBJECT_LIMIT = 5 << 30  # S3's largest CopyObject source; bigger objects are streamed through
PRESIGN_MAX_S = 7 * 24 * 3600  # SigV4's longest validity
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard a request tries before the store raises StoreError (every bound is per request)."""

    max_retries: int = 8  # retries of one request (5xx, refused/reset connections, timeouts)
    init_backoff_s: float = 0.1  # first wait; doubles (with jitter) up to max_backoff_s
    max_backoff_s: float = 10.0
    retry_timeout_s: float = 120.0  # no retry starts later than this after the first attempt
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # a stalled connection (no byte for this long) is a timeout
    request_timeout_s: float = 3600.0  # one whole request, body included (a large GET)
    body_attempts: int = 3  # downloads of one file when its body is cut mid-way
    part_bytes: int = 16 << 20  # multipart part size (files larger than this are multipart)
    part_concurrency: int = 8  # parts in flight per file

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.body_attempts < 1 or self.part_bytes < (5 << 20) or self.part_concurrency < 1:
            raise ValueError("RetryPolicy: max_retries >= 0, body_attempts >= 1, part_bytes >= 5 MiB (S3's smallest "
                             "part), part_concurrency >= 1")


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end; may be empty)."""
    if not url.startswith("s3://"):
        raise StoreError(f"storage location {url!r} is not an s3:// URL (s3://bucket or s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise StoreError(f"storage location {url!r}: bucket {bucket!r} invalid (3-63 characters: lower-case "
                         "letters, digits, '.', '-')")
    prefix = prefix.strip("/")
    if prefix:
        check_key(prefix)
    return bucket, prefix


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


class S3Store(CheckpointStore):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None, region: str | None = None,
                 access_key_id: str | None = None, secret_access_key: str | None = None,
                 session_token: str | None = None, cache_dir: str | Path | None = None,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        self.bucket, self.prefix = parse_url(f"s3://{bucket}/{prefix}")
        self.retry = retry
        self.endpoint = endpoint or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        region = region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        key_id = access_key_id or _env("AWS_ACCESS_KEY_ID")
        secret = secret_access_key or _env("AWS_SECRET_ACCESS_KEY")
        token = session_token or _env("AWS_SESSION_TOKEN")
        self._secrets = tuple(s for s in (key_id, secret, token) if s)  # only to take out of error texts
        config = {"region": region}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        for name, value in (("access_key_id", key_id), ("secret_access_key", secret), ("session_token", token)):
            if value:
                config[name] = value
        self._client = _ObjectStoreS3(
            self.bucket, config=config,
            client_options={"allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
                            "connect_timeout": timedelta(seconds=retry.connect_timeout_s),
                            "read_timeout": timedelta(seconds=retry.read_timeout_s),
                            "timeout": timedelta(seconds=retry.request_timeout_s)},
            retry_config={"max_retries": retry.max_retries, "retry_timeout": timedelta(seconds=retry.retry_timeout_s),
                          "backoff": {"init_backoff": timedelta(seconds=retry.init_backoff_s),
                                      "max_backoff": timedelta(seconds=retry.max_backoff_s), "base": 2}})
        where = self.prefix.replace("/", "_") or "_"
        root = cache_dir or os.environ.get("LORAFLEET_STORAGE_CACHE")
        self.cache_dir = (Path(root) if root else Path(tempfile.gettempdir()) / f"lorafleet-store-cache-{os.getuid()}") \
            / self.bucket / where

    @classmethod
    def from_url(cls, url: str, **options) -> S3Store:  # noqa: ANN003 - the constructor's keywords
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **options)

    def __repr__(self) -> str:  # never the client's config: it holds the credentials
        return f"S3Store({self.url_root!r}, endpoint={self.endpoint!r})"

    # -- keys, objects and errors -----------------------------------------------------------------

    @property
    def url_root(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/" if self.prefix else f"s3://{self.bucket}/"

    @property
    def location(self) -> str:
        return self.url_root.rstrip("/")

    def url(self, key: str) -> str:
        return self.url_root + self.key_of(key)

    def key_of(self, reference: str | Path) -> str:
        ref = str(reference)
        if ref.startswith("s3://"):
            if not ref.startswith(self.url_root):
                raise StoreError(f"{ref} is outside this store's location {self.url_root}")
            return check_key(ref[len(self.url_root):].rstrip("/"))
        if os.path.isabs(ref):
            raise StoreError(f"{ref} is a local path, not a key of the object store {self.url_root}")
        return check_key(ref)

    def _object(self, key: str, rel: str = "") -> str:
        path = f"{self.prefix}/{key}" if self.prefix else key
        return f"{path}/{rel}" if rel else path

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _failure(self, key: str, what: str, error: BaseException) -> StoreError:
        """A StoreError naming the key, the step and the client's reason (its first line: the request,
        the retries made, the cause), never a credential."""
        text = str(error).strip()
        reason = (text.splitlines() or [""])[0][:500].removesuffix('<?xml version="1.0" encoding="UTF-8"?>').rstrip()
        answer = re.search(r"<Code>([^<]*)</Code>(?:<Message>([^<]*)</Message>)?", text)  # the S3 error body
        if answer:
            reason += f" [{answer.group(1)}{': ' + answer.group(2) if answer.group(2) else ''}]"
        return StoreError(self._redact(f"{self.url(key)}: {what} failed: {type(error).__name__}: {reason}"))

    def _call(self, key: str, what: str, fn: Callable[..., T], *args, **kwargs) -> T:  # noqa: ANN002, ANN003
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as e:  # obstore's errors (retries already spent), local I/O
            raise self._failure(key, what, e) from None

    def _list_paths(self, key: str) -> list[str]:
        """Every object below `key` (its own files, sub-keys' files, manifests)."""
        def every_path() -> list[str]:
            stream = obstore.list(self._client, prefix=self._object(key) + "/", chunk_size=1000)
            return [o["path"] for batch in stream for o in batch]

        return self._call(key, "listing", every_path)

    def _delete_paths(self, key: str, paths: list[str]) -> None:
        if paths:
            self._call(key, "deleting", obstore.delete, self._client, paths)

    # -- reads ------------------------------------------------------------------------------------

    def _manifest_text(self, key: str) -> str | None:
        try:
            raw = self._call(key, "reading the manifest", lambda: obstore.get(self._client, self._object(key, MANIFEST)).bytes())
        except FileNotFoundError:
            return None
        return bytes(raw).decode()

    def manifest(self, key: str) -> Manifest | None:
        key = self.key_of(key)
        text = self._manifest_text(key)
        return None if text is None else Manifest.from_json(text, self.url(key))

    def list(self, prefix: str) -> list[str]:
        prefix = self.key_of(prefix)
        return [k for k in self.folders(prefix) if self.manifest(k) is not None]

    def folders(self, prefix: str) -> list[str]:
        prefix = self.key_of(prefix)
        found = self._call(prefix, "listing", obstore.list_with_delimiter, self._client, self._object(prefix) + "/")
        start = len(self._object(prefix)) + 1
        return sorted(f"{prefix}/{p.rstrip('/')[start:]}" for p in found["common_prefixes"])

    def get_folder(self, key: str, *, verify: bool = True) -> Path:
        key = self.key_of(key)
        text = self._manifest_text(key)
        m = self.committed(key, None if text is None else Manifest.from_json(text, self.url(key)))
        local = self.cache_dir / key
        with self._cache_lock(key):
            if _read_or_none(local / MANIFEST) == text and self._cached_ok(local, m, verify):
                return local
            local.mkdir(parents=True, exist_ok=True)
            (local / MANIFEST).unlink(missing_ok=True)  # the copy is not current while it changes
            for rel in folder_files(local, set(m.children)):
                if rel not in m.files:
                    (local / rel).unlink()
            for rel, entry in m.files.items():
                self._download(key, rel, entry, local / rel)
            _write_atomic(local / MANIFEST, text)
        return local

    def _cached_ok(self, local: Path, m: Manifest, verify: bool) -> bool:
        for rel, entry in m.files.items():
            f = local / rel
            if not f.is_file() or f.stat().st_size != entry.size or (verify and file_digest(f).sha256 != entry.sha256):
                return False
        return True

    def _download(self, key: str, rel: str, entry: FileEntry, target: Path) -> None:
        """One file into `target` (via a temporary name beside it), hashed as it arrives; refused
        when it differs from the manifest. A body cut mid-way is fetched again (body_attempts)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.part")
        try:
            for attempt in range(1, self.retry.body_attempts + 1):
                try:
                    result = obstore.get(self._client, self._object(key, rel))
                except FileNotFoundError:
                    raise StoreError(f"{self.url(key)}: {rel} is missing (its manifest lists it)") from None
                except Exception as e:
                    raise self._failure(key, f"downloading {rel}", e) from None
                digest, size = hashlib.sha256(), 0
                try:
                    with open(tmp, "wb") as f:
                        for chunk in result.stream(min_chunk_size=8 << 20):
                            f.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                    break
                except Exception as e:  # the body was cut: fetch the whole file again
                    if attempt == self.retry.body_attempts:
                        raise self._failure(key, f"downloading {rel} ({attempt} attempts)", e) from None
                    time.sleep(min(self.retry.max_backoff_s, self.retry.init_backoff_s * 2 ** attempt))
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise StoreError(f"{self.url(key)}: {rel} does not match its manifest (size {size}, expected {entry.size}"
                                 f"{'' if size != entry.size else '; checksum differs'}): the folder is corrupted")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _cache_lock(self, key: str) -> Iterator[None]:
        """One download of a key at a time on this machine (processes sharing the cache included)."""
        locks = self.cache_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / hashlib.sha1(key.encode()).hexdigest(), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def presigned_urls(self, key: str, expires_s: int = 3600) -> dict[str, str]:
        """GET URLs, valid `expires_s` seconds, for every file of the committed folder `key` and of
        its sub-keys ({relative path: URL}); whoever holds one can download that object, nothing else."""
        if not 1 <= int(expires_s) <= PRESIGN_MAX_S:
            raise StoreError(f"presigned URL lifetime {expires_s} s invalid: 1 to {PRESIGN_MAX_S} s (7 days)")
        key = self.key_of(key)
        if not self.complete(key):
            raise StoreError(f"{self.url(key)} is not a complete folder of this store: no URLs for it")
        files = self._all_files(key)
        urls = self._call(key, "signing URLs", obstore.sign, self._client, "GET",
                          [self._object(key, rel) for rel in files], timedelta(seconds=int(expires_s)))
        return dict(zip(files, urls, strict=True))

    def _all_files(self, key: str) -> list[str]:
        m = self.manifest(key)
        return sorted(m.files) + [f"{c}/{rel}" for c in m.children for rel in self._all_files(f"{key}/{c}")]

    # -- writes -----------------------------------------------------------------------------------

    def staging(self) -> Path:
        folder = self.cache_dir / ".staging" / uuid.uuid4().hex
        folder.mkdir(parents=True)
        return folder

    def _uncommit(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # S3 answers a DELETE of nothing with success; others may not
            self._call(key, "deleting the manifest", obstore.delete, self._client, self._object(key, MANIFEST))

    def _own_paths(self, key: str, children: tuple[str, ...]) -> list[str]:
        """The objects of `key` itself: not its manifest, not its sub-keys' trees."""
        base = self._object(key) + "/"
        return [p for p in self._list_paths(key) if p != base + MANIFEST
                and not any(p.startswith(f"{base}{c}/") for c in children)]

    def _put_manifest(self, manifest: Manifest) -> Manifest:
        self._call(manifest.key, "writing the manifest", obstore.put, self._client,
                   self._object(manifest.key, MANIFEST), manifest.to_json().encode(), use_multipart=False)
        return manifest

    def put_folder(self, key: str, local_dir: Path, *, children: tuple[str, ...] = (), meta: dict | None = None,
                   move: bool = False, durable: bool = True) -> Manifest:  # `durable` (S5): every PUT is durable when answered
        key = self.key_of(key)
        src = Path(local_dir)
        if not src.is_dir():
            raise StoreError(f"cannot commit {self.url(key)}: {src} is not a folder")
        names = folder_files(src, set(children))
        self._uncommit(key)  # S3: the previous version is no longer current from here on
        keep = {self._object(key, rel) for rel in names}
        self._delete_paths(key, [p for p in self._own_paths(key, tuple(children)) if p not in keep])
        files = {}
        for rel in names:
            files[rel] = file_digest(src / rel)
            self._call(key, f"uploading {rel}", obstore.put, self._client, self._object(key, rel), src / rel,
                       chunk_size=self.retry.part_bytes, max_concurrency=self.retry.part_concurrency)
        missing = [c for c in children if not self.complete(f"{key}/{c}")]
        if missing:
            raise StoreError(f"cannot commit {self.url(key)}: its sub-folders {missing} are not committed")
        manifest = self._put_manifest(Manifest(key, files, tuple(children), dict(meta or {})))  # LAST: the commit
        if move:
            shutil.rmtree(src, ignore_errors=True)
        return manifest

    def delete(self, key: str) -> None:
        key = self.key_of(key)
        self._uncommit(key)
        paths = self._list_paths(key)
        manifests = sorted((p for p in paths if p.endswith("/" + MANIFEST)), key=len)  # outermost first
        for p in manifests:  # no sub-key stays committed with its files going
            self._call(key, "deleting a manifest", obstore.delete, self._client, p)
        self._delete_paths(key, [p for p in paths if p not in set(manifests)])
        with self._cache_lock(key):
            shutil.rmtree(self.cache_dir / key, ignore_errors=True)

    def copy(self, src: str, dst: str) -> Manifest:
        src, dst = self.key_of(src), self.key_of(dst)
        m = self.manifest(src)
        if m is None:
            raise StoreError(f"cannot copy {self.url(src)}: it is not a committed folder")
        for child in m.children:
            self.copy(f"{src}/{child}", f"{dst}/{child}")
        self._uncommit(dst)
        keep = {self._object(dst, rel) for rel in m.files}
        self._delete_paths(dst, [p for p in self._own_paths(dst, m.children) if p not in keep])
        for rel, entry in m.files.items():
            self._copy_object(dst, self._object(src, rel), self._object(dst, rel), entry.size)
        return self._put_manifest(Manifest(dst, dict(m.files), m.children, dict(m.meta)))

    def _copy_object(self, key: str, src: str, dst: str, size: int) -> None:
        if size <= COPY_OBJECT_LIMIT:
            self._call(key, f"copying {src}", obstore.copy, self._client, src, dst)
            return
        body = self._call(key, f"reading {src}", obstore.get, self._client, src)
        self._call(key, f"copying {src}", obstore.put, self._client, dst, body.stream(min_chunk_size=self.retry.part_bytes),
                   chunk_size=self.retry.part_bytes, max_concurrency=self.retry.part_concurrency)

    def clear_staging(self) -> None:
        shutil.rmtree(self.cache_dir / ".staging", ignore_errors=True)

    def clear_cache(self) -> None:
        """Remove this machine's cached copies and staging folders (nothing in the store changes)."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
