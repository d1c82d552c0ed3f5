"""Which store a location names: `open_store(location)` (one instance per location and process), and
`readable_folder`, the folder to read a reference from (a committed folder, or one written before the
store). Apart from trainer/storage/store.py so that the backends import the interface and this module
imports the backends, without a circle.
"""

from __future__ import annotations

from pathlib import Path

from trainer.storage.local_store import LocalStore
from trainer.storage.store import CheckpointStore, StoreError


def readable_folder(store: CheckpointStore, reference: str | Path, *, legacy_marker: str) -> Path:
    """The local folder to read `reference` from: a committed folder of `store` (verified, S1), or a
    folder written before the store (no manifest) that holds `legacy_marker`, the file its writer
    wrote last. A reference outside a local store is read from the local filesystem."""
    try:
        key = store.key_of(reference)
    except StoreError:
        store = open_store(None)
        key = store.key_of(reference)
    if store.manifest(key) is not None:
        return store.get_folder(key)
    url = store.url(key)
    if not url.startswith("s3://") and (Path(url) / legacy_marker).is_file():
        return Path(url)
    raise StoreError(f"{url} is not a complete folder (no manifest and no {legacy_marker})")


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
