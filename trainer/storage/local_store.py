"""The storage layer on local files: `LocalStore(root)`, a key's folder at ``root/key``.

The manifest (trainer/storage/store.py ``MANIFEST``) sits inside the folder and is written last, by
an atomic rename, after every file is in place and synced to disk (not synced for a caller that
asked for ``durable=False``, store.py S5); taking it away (unlink, then
syncing the folder) uncommits. A folder is moved into place file by file from the staging area
(``root/.lorafleet-staging``, the same filesystem, so a move is a rename); a cross-filesystem
caller's files are copied. Old files of a re-written key are removed before the new ones arrive,
while the key is uncommitted (store.py S3).

A local store is also what a trainer uses without a configured location: root ``/``, keys are then
absolute paths made relative (its staging area is the system's temporary folder).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from trainer.storage.store import MANIFEST, CheckpointStore, Manifest, StoreError, check_key, file_digest, folder_files

STAGING = ".lorafleet-staging"


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(CheckpointStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))

    # -- keys and paths ---------------------------------------------------------------------------

    def key_of(self, reference: str | Path) -> str:
        ref = str(reference)
        if os.path.isabs(ref):
            path = Path(os.path.abspath(ref))
            if path != self.root and self.root not in path.parents:
                raise StoreError(f"{ref} is outside this store's folder {self.root}")
            return check_key(path.relative_to(self.root).as_posix())
        return check_key(ref)

    def path(self, key: str | Path) -> Path:
        return self.root / self.key_of(key)

    @property
    def location(self) -> str:
        return str(self.root)

    def url(self, key: str) -> str:
        return str(self.path(key))

    def legacy_folder(self, key: str) -> Path | None:
        folder = self.path(key)
        return folder if folder.is_dir() else None

    def staging(self) -> Path:
        if self.root == Path("/"):
            return Path(tempfile.mkdtemp(prefix="lorafleet-staging-"))
        folder = self.root / STAGING / uuid.uuid4().hex
        folder.mkdir(parents=True)
        return folder

    # -- reads ------------------------------------------------------------------------------------

    def manifest(self, key: str) -> Manifest | None:
        mfile = self.path(key) / MANIFEST
        try:
            text = mfile.read_text()
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, str(mfile.parent))

    def get_folder(self, key: str, *, verify: bool = True) -> Path:
        key = self.key_of(key)
        folder = self.path(key)
        m = self.committed(key, self.manifest(key))
        for rel, entry in m.files.items():
            f = folder / rel
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                raise StoreError(f"{folder}: {rel} is missing (its manifest lists it)") from None
            if size != entry.size or (verify and file_digest(f).sha256 != entry.sha256):
                raise StoreError(f"{folder}: {rel} does not match its manifest (size {size}, expected {entry.size}"
                                 f"{'' if size != entry.size else '; checksum differs'}): the folder is corrupted")
        return folder

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        key = self.key_of(prefix)
        return [f"{key}/{p.name}" for p in sorted(base.iterdir()) if p.is_dir() and (p / MANIFEST).is_file()]

    def folders(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        key = self.key_of(prefix)
        return [f"{key}/{p.name}" for p in sorted(base.iterdir()) if p.is_dir()]

    # -- writes -----------------------------------------------------------------------------------

    def _uncommit(self, folder: Path) -> None:
        mfile = folder / MANIFEST
        if mfile.exists():
            mfile.unlink()
            _fsync_path(folder, directory=True)

    def put_folder(self, key: str, local_dir: Path, *, children: tuple[str, ...] = (), meta: dict | None = None,
                   move: bool = False, durable: bool = True) -> Manifest:
        key = self.key_of(key)
        dest = self.path(key)
        src = Path(local_dir)
        if not src.is_dir():
            raise StoreError(f"cannot commit {key}: {src} is not a folder")
        skip = set(children)
        dest.mkdir(parents=True, exist_ok=True)
        self._uncommit(dest)
        for rel in folder_files(dest, skip):  # the previous version's own files
            (dest / rel).unlink()
        files = {}
        for rel in folder_files(src, skip):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if move:
                try:
                    os.replace(src / rel, target)
                except OSError:  # another filesystem
                    shutil.copy2(src / rel, target)
            else:
                shutil.copy2(src / rel, target)
            if durable:
                _fsync_path(target)
            files[rel] = file_digest(target)
        missing = [c for c in children if not self.complete(f"{key}/{c}")]
        if missing:
            raise StoreError(f"cannot commit {key}: its sub-folders {missing} are not committed")
        manifest = Manifest(key, files, tuple(children), dict(meta or {}))
        tmp = dest / f"{MANIFEST}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, dest / MANIFEST)  # the commit (S1); without `durable` (S5) the disk is not waited for
        if durable:
            _fsync_path(dest, directory=True)
        return manifest

    def delete(self, key: str) -> None:
        folder = self.path(key)
        if folder.exists():
            self._uncommit(folder)
            shutil.rmtree(folder, ignore_errors=True)

    def copy(self, src: str, dst: str) -> Manifest:
        m = self.manifest(src)
        if m is None:
            raise StoreError(f"cannot copy {src}: it is not a committed folder")
        for child in m.children:
            self.copy(f"{self.key_of(src)}/{child}", f"{self.key_of(dst)}/{child}")
        tmp = self.staging()
        try:
            for rel in m.files:  # hard links: an export is the final checkpoint's files, not a second write
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(self.path(src) / rel, tmp / rel)
                except OSError:
                    shutil.copy2(self.path(src) / rel, tmp / rel)
            return self.put_folder(dst, tmp, children=m.children, meta=m.meta, move=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def clear_staging(self) -> None:
        if self.root != Path("/"):
            shutil.rmtree(self.root / STAGING, ignore_errors=True)
