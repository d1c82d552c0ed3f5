"""Which store a location names: `open_store(location)` (one instance per location and process),
`check_location` (a process's first use of a location: its staging leftovers removed, then one
folder written, read back and deleted, so a bad URL, endpoint or credential fails at start with the
store's reason), `locate` (the store and key a reference names), `readable_folder`, the folder to
read a reference from (a committed folder, or one written before the store), and `committed_files`,
a folder's files by its manifest, and `copy_folder`, a folder from one store to another. Apart from trainer/storage/store.py so that the backends import the
interface and this module imports the backends, without a circle.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from trainer.storage.local_store import LocalStore
from trainer.storage.store import CheckpointStore, Manifest, StoreError, folder_files


def locate(store: CheckpointStore, reference: str | Path) -> tuple[CheckpointStore, str]:
    """Where `reference` is: a key of `store`, else (a path outside a local store) of the local filesystem."""
    try:
        return store, store.key_of(reference)
    except StoreError:
        local = open_store(None)
        return local, local.key_of(reference)


def readable_folder(store: CheckpointStore, reference: str | Path, *, legacy_marker: str) -> Path:
    """The local folder to read `reference` from: a committed folder of `store` (verified, S1), or a
    folder written before the store (no manifest) that holds `legacy_marker`, the file its writer
    wrote last. A reference outside a local store is read from the local filesystem."""
    store, key = locate(store, reference)
    if store.manifest(key) is not None:
        return store.get_folder(key)
    legacy = store.legacy_folder(key)
    if legacy is not None and (legacy / legacy_marker).is_file():
        return legacy
    raise StoreError(f"{store.url(key)} is not a complete folder (no manifest and no {legacy_marker})")


def committed_files(store: CheckpointStore, reference: str | Path) -> set[str]:
    """The files of the folder `reference` names, without reading them: its manifest's (committed),
    else those of a folder written before the store; empty when it is neither."""
    store, key = locate(store, reference)
    manifest = store.manifest(key)
    if manifest is not None:
        return set(manifest.files)
    legacy = store.legacy_folder(key)
    return set(folder_files(legacy)) if legacy is not None else set()


def copy_folder(src: CheckpointStore, src_key: str, dst: CheckpointStore, dst_key: str) -> Manifest:
    """The committed folder `src_key` of `src` committed again as `dst_key` of `dst`, sub-keys first
    (S4): within one store its own `copy` (links, or server-side on S3); across stores read whole
    (verified, S1) and written (committed last, S2)."""
    if dst is src:
        return src.copy(src_key, dst_key)
    manifest = src.committed(src_key, src.manifest(src_key))
    for child in manifest.children:
        copy_folder(src, f"{src_key}/{child}", dst, f"{dst_key}/{child}")
    return dst.put_folder(dst_key, src.get_folder(src_key), children=manifest.children, meta=manifest.meta)


_STORES: dict[str, CheckpointStore] = {}


def open_store(location: str | Path | None) -> CheckpointStore:
    """The store at `location` (one instance per location and process): an ``s3://bucket/prefix`` URL,
    or a local folder; None = the local filesystem's root (keys are then absolute paths made relative:
    in-process trainers of the tests and tools that name folders directly)."""
    loc = "/" if location is None else str(location)
    store = _STORES.get(loc)
    if store is None:
        if loc.startswith("s3://"):
            from trainer.storage.s3_store import S3Store  # imports its client library only when used

            store = S3Store.from_url(loc)
        else:
            store = LocalStore(Path(loc))
        _STORES[loc] = store
    return store


PROBE_PREFIX = ".lorafleet-probe-"  # check_location's folders (top-level keys): one per check, deleted by it
PROBE_FILE = "probe"


def check_location(location: str | Path, *, quick_retries: int = 2) -> CheckpointStore:
    """The store at `location`, checked from this process: what writes cut short left in its staging
    area on this machine is removed (store.py S2: never current anyway), then a small folder is
    committed under ``.lorafleet-probe-<host>-<pid>-<random>``, read back (verified) and deleted. StoreError
    naming the location and the store's reason (an unknown bucket, a refused endpoint, a wrong
    key: the S3 answer's code) when any step fails. The probe of an object store retries only
    `quick_retries` times (the store's own policy waits up to two minutes for a server that is
    restarting; a location that is wrong from the start should fail at once)."""
    store = open_store(location)
    store.clear_staging()
    probe_store = store
    if str(location).startswith("s3://"):
        from trainer.storage.s3_store import RetryPolicy, S3Store

        probe_store = S3Store.from_url(str(location), retry=RetryPolicy(max_retries=quick_retries, retry_timeout_s=10.0))
    key = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    token = uuid.uuid4().hex
    try:
        with probe_store.write_folder(key) as tmp:
            (tmp / PROBE_FILE).write_text(token)
        if (probe_store.get_folder(key) / PROBE_FILE).read_text() != token:
            raise StoreError(f"{probe_store.url(key)}: the folder read back is not the one written")
        probe_store.delete(key)
    except (StoreError, OSError) as e:
        raise StoreError(f"storage {location} is not usable from {socket.gethostname()} (pid {os.getpid()}): "
                         f"writing, reading back and deleting a probe folder failed: {e}") from None
    return store
