"""The one storage layer's interface: `CheckpointStore`, whole folders under keys, with checksums.

Every layout lorafleet keeps beside its registry (runs' checkpoints and exports, Tinker checkpoints
and records: trainer/storage/layouts.py names them) is a set of folders in one store; nothing else
in the product writes those paths. Backends: local files (trainer/storage/local_store.py) and
S3-compatible object storage (trainer/storage/s3_store.py).

A key is a relative POSIX path ("runs/digits-3f2a/checkpoints/step-000012"). A folder under a key
is *committed* once its manifest (``MANIFEST``: every file's size and SHA-256, and the sub-keys it
needs) is written, and the manifest is written LAST, after every file is durable (S5 excepted):

  S1 a reader sees a committed folder whole, or no folder: `get_folder` refuses a key without a
     manifest, and (verify=True) a file whose size or checksum differs from it;
  S2 a write that fails or is cut short (a crash, a lost connection) never becomes current: its
     files sit under a key without a manifest, which readers and `list` ignore and the next write
     of the key replaces; the previous committed folder of another key stays current;
  S3 re-writing a committed key first takes its manifest away (it is then not current), so a
     reader never mixes old and new files;
  S4 a folder may need sub-keys committed on their own (a run checkpoint's ``trainer/`` and
     ``adapter/``, written by the trainer's rank 0 while the coordinator writes the rest): its
     manifest lists them, and it is complete only while they are;
  S5 a folder committed with ``durable=False`` (a Tinker sampler folder the SDK calls ephemeral:
     ``save_weights_and_get_sampling_client``) is written in the same order without waiting for
     the disk: whole after a crash of the process (the system's page cache holds it), possibly
     torn after a crash of the machine. Its manifest is still written last, so a reader that goes
     through `get_folder` (verify=True) sees it whole or not at all (S1, S2); a reader of its files
     by path must ask `get_folder` first when the machine may have stopped since (a Tinker sampling
     session restored after a restart: api/tinker/sampling/sampler.py).

Keys may also be given as absolute paths inside a local store's root (the trainer's in-process
callers and older records name folders that way); `key_of` turns a reference back into a key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = ".lorafleet-manifest.json"
FORMAT = "lorafleet-store-v1"
_CHUNK = 8 << 20


class StoreError(ValueError):
    """A key that is not a usable committed folder (missing, partial, or corrupted); the message
    names the key and what is wrong."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a committed folder holds: its files (relative POSIX paths) and the sub-keys it needs."""

    key: str
    files: dict[str, FileEntry]
    children: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "key": self.key, "created_at": self.created_at, "children": list(self.children),
                           "meta": self.meta, "files": {n: [e.size, e.sha256] for n, e in sorted(self.files.items())}},
                          sort_keys=True)

    @staticmethod
    def from_json(text: str, where: str) -> "Manifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r} is not {FORMAT!r}")
            files = {n: FileEntry(int(s), str(h)) for n, (s, h) in raw["files"].items()}
            return Manifest(raw["key"], files, tuple(raw.get("children", ())), dict(raw.get("meta", {})), float(raw["created_at"]))
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{where}: its manifest is unreadable: {e}") from None


def check_key(key: str) -> str:
    """A key as a normalized relative POSIX path; StoreError for an empty one or one that climbs out."""
    p = PurePosixPath(str(key).replace("\\", "/"))
    if not str(key) or p.is_absolute() or any(part in ("..", "") for part in p.parts) or str(p) == ".":
        raise StoreError(f"storage key {key!r} invalid: a relative path of named parts (no '..')")
    return str(p)


def file_digest(path: Path) -> FileEntry:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileEntry(size, h.hexdigest())


def folder_files(folder: Path, skip: set[str] = frozenset()) -> list[str]:
    """Every file below `folder` (relative POSIX paths), except the manifest and the `skip` sub-trees."""
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and p.name != MANIFEST and not any(rel == s or rel.startswith(s + "/") for s in skip):
            out.append(rel)
    return out


class CheckpointStore(ABC):
    """Whole folders under keys (module doc: S1-S4). Thread-safe for different keys; one writer per key."""

    @abstractmethod
    def put_folder(self, key: str, local_dir: Path, *, children: tuple[str, ...] = (), meta: dict | None = None,
                   move: bool = False, durable: bool = True) -> Manifest:
        """Commit `local_dir`'s files (the `children` sub-trees excepted: committed on their own, S4)
        as the folder under `key`, replacing what it held (S3). `move`: the files may be moved
        rather than copied (the caller's folder is then gone). `durable=False`: answer without
        waiting for the disk (S5; an object store's write is durable when it answers either way)."""

    @abstractmethod
    def get_folder(self, key: str, *, verify: bool = True) -> Path:
        """A local folder holding the committed folder's files (a local store: the folder itself; an
        object store: a verified copy in its cache). StoreError if it is not committed, a sub-key it
        needs is not, or (verify) one of its own files differs from the manifest (sub-folders are
        verified when they are read themselves)."""

    @abstractmethod
    def manifest(self, key: str) -> Manifest | None:
        """The committed folder's manifest, or None (not committed)."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """The committed keys directly below `prefix`, sorted."""

    @abstractmethod
    def folders(self, prefix: str) -> list[str]:
        """Every folder directly below `prefix`, committed or not (a write cut short leaves one without
        a manifest, which `list` does not show and pruning must see), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Uncommit, then remove the folder under `key` and everything below it (idempotent)."""

    @abstractmethod
    def copy(self, src: str, dst: str) -> Manifest:
        """The committed folder `src` committed again under `dst` (a local store links the files)."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the store is (what open_store was given, normalized): a local folder, or ``s3://bucket/prefix``."""

    @abstractmethod
    def url(self, key: str) -> str:
        """How the folder is referenced outside (the registry, an API answer): a local path or an s3:// URL."""

    @abstractmethod
    def key_of(self, reference: str | Path) -> str:
        """The key a reference (`url`'s answer, an absolute path inside a local store, or a key) names."""

    @abstractmethod
    def staging(self) -> Path:
        """A fresh local folder to build a folder in before `put_folder` (the caller removes it, or
        hands it over with move=True)."""

    @abstractmethod
    def clear_staging(self) -> None:
        """Remove what writes cut short left in this machine's staging area (at start, before anything
        writes through this store on this machine)."""

    def committed(self, key: str, manifest: Manifest | None) -> Manifest:
        """`manifest` (what `key`'s manifest read gave) when the folder is readable whole: StoreError when
        it is None (never committed, or a write that did not finish: S2) or a sub-key it needs is not
        complete (S4). Each sub-folder is verified by whoever reads it (its own get_folder)."""
        if manifest is None:
            raise StoreError(f"{self.url(key)} is not a complete folder of this store (no manifest: never committed, "
                             "or a write that did not finish)")
        missing = [c for c in manifest.children if not self.complete(f"{key}/{c}")]
        if missing:
            raise StoreError(f"{self.url(key)}: its sub-folders {missing} are not committed")
        return manifest

    def legacy_folder(self, key: str) -> Path | None:
        """The local folder at `key` as written before the store existed (no manifest; its writer's own
        marker file says whether it is whole), or None: a local store's folder when there is one; an
        object store was only ever written through the store."""
        return None

    def exists(self, key: str) -> bool:
        return self.manifest(key) is not None

    @contextlib.contextmanager
    def write_folder(self, key: str, *, children: tuple[str, ...] = (), meta: dict | None = None,
                     durable: bool = True) -> Iterator[Path]:
        """`with store.write_folder(key) as d:` write files into `d`; committed on a clean exit,
        dropped (never current, S2) when the block raises. `durable`: as put_folder's (S5)."""
        import shutil

        tmp = self.staging()
        try:
            yield tmp
            self.put_folder(key, tmp, children=children, meta=meta, move=True, durable=durable)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def complete(self, key: str) -> bool:
        """Whether `key` and every sub-key its manifest needs are committed (S4)."""
        m = self.manifest(key)
        return m is not None and all(self.complete(f"{key}/{c}") for c in m.children)
