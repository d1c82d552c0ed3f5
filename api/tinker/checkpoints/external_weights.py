"""External weights: ``save_weights_external`` and the signed URLs that download them.

``save_weights_external(name)`` writes the model's LoRA as a PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``: the "external" format every
PEFT / SGLang / vLLM user loads) under ``tinker://<model>/external_weights/<name>``; with
``age_encryption_recipients`` every file is encrypted to them (age, through ``pyrage``) and
stored as ``<file>.age`` only. ``get_external_weights_urls`` answers one URL per file, valid
for ``URL_TTL_S``; the URL itself is the credential (``urllib.request.urlretrieve`` sends no
key, as with the signed URLs of an object store), so it carries an HMAC-SHA256 signature over
the tenant, run, checkpoint, file and expiry under a key only this process holds.

Invariants:
  X1 a URL opens exactly the one file it was signed for, of the tenant it was signed for,
     until it expires; anything else (another file, a changed expiry, a deleted or expired
     checkpoint, a path that leaves the checkpoint folder) answers 404, never 403, so a URL
     tells nothing about what exists;
  X2 URLs die with the process (the key is random per process): a restarted service signs new ones;
  X3 the folder is written under a temporary name and renamed into place, so a listing or a
     URL never shows half an export, and a failed export leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable
from urllib.parse import quote

from trainer.storage.store import MANIFEST, CheckpointStore, folder_files

MAX_RECIPIENTS = 10  # the SDK's documented limit
URL_TTL_S = 3600.0
AGE_SUFFIX = ".age"


def parse_recipients(recipients: list[str] | None) -> list:
    """pyrage recipients for the SDK's ``age_encryption_recipients`` (native ``age1...`` keys or SSH
    public keys); ValueError naming the bad one."""
    if not recipients:
        return []
    import pyrage

    if len(recipients) > MAX_RECIPIENTS:
        raise ValueError(f"age_encryption_recipients: at most {MAX_RECIPIENTS} recipients, got {len(recipients)}")
    out = []
    for r in recipients:
        kind = pyrage.x25519.Recipient if r.startswith("age1") else pyrage.ssh.Recipient
        try:
            out.append(kind.from_str(r))
        except pyrage.RecipientError as err:
            raise ValueError(f"age_encryption_recipients: {r[:24]!r}... is neither an age1... key nor an SSH public key "
                             f"({err})") from None
    return out


def write_external(save_peft: Callable[[str], str], store: CheckpointStore, key: str, recipients: list) -> int:
    """Commit the export under `key` of the store (X3): ``save_peft(to)`` has the trainer write the
    model's PEFT folder to the store reference `to` (a scratch key beside `key`), whose files are then
    encrypted to ``recipients`` (when any) into the committed folder; the scratch goes. Returns the
    export's size in bytes."""
    parent, name = key.rsplit("/", 1)
    plain = f"{parent}/.{name}.plain"
    store.delete(plain)
    try:
        save_peft(store.url(plain))
        src = store.get_folder(plain)
        with store.write_folder(key) as tmp:
            for rel in folder_files(src):
                f = src / rel
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                if recipients:
                    import pyrage

                    pyrage.encrypt_file(str(f), str(tmp / rel) + AGE_SUFFIX, recipients)
                else:
                    shutil.copy2(f, tmp / rel)
        manifest = store.manifest(key)
        return sum(e.size for e in manifest.files.values())
    finally:
        store.delete(plain)


class UrlSigner:
    """Signed download URLs for the files of external-weights checkpoints (X1, X2)."""

    def __init__(self, *, ttl_s: float = URL_TTL_S, clock: Callable[[], float] = time.time):
        self._key = secrets.token_bytes(32)
        self.ttl_s = ttl_s
        self.clock = clock

    def _sig(self, tenant: str, run_id: str, name: str, file: str, expires: int) -> str:
        msg = "\n".join((tenant, run_id, name, file, str(expires))).encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def urls(self, base_url: str, tenant: str, run_id: str, name: str, folder: Path) -> dict:
        """The SDK's ExternalWeightsUrlsResponse for every file of ``folder``."""
        expires = int(self.clock() + self.ttl_s)
        urls = {}
        for rel in folder_files(folder):  # the adapter's files; the store's manifest is not one of them
            query = f"expires={expires}&sig={self._sig(tenant, run_id, name, rel, expires)}"
            urls[rel] = (f"{base_url.rstrip('/')}/api/v1/external_weights_files/{quote(tenant)}/{quote(run_id)}/"
                         f"{quote(name)}/{quote(rel)}?{query}")
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    def valid(self, tenant: str, run_id: str, name: str, file: str, expires: int, sig: str) -> bool:
        return expires > self.clock() and hmac.compare_digest(sig, self._sig(tenant, run_id, name, file, expires))


def file_in(folder: Path, rel: str) -> Path | None:
    """``folder/rel`` when it is a file inside ``folder`` (no escape through '..' or links), else None."""
    path = (folder / rel).resolve()
    ok = path.is_file() and path.is_relative_to(folder.resolve()) and path.name != MANIFEST
    return path if ok else None
