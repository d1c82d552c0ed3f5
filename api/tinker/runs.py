"""Training runs and their checkpoints, as the SDK's RestClient sees them.

A Tinker *training run* is a model (its id is the model id, ``<session>:train:<n>``); its
*checkpoints* are the folders its saves wrote. Both outlive the model: a run saved, unloaded
and loaded again in a later session is still listed, its checkpoints still resolvable.

Layout (the one home of the checkpoint folder layout; ``TinkerService`` resolves paths here):
``<root>/<tenant>/<run dir>/<kind>/<name>`` with ``<run dir>`` the run id with ':' -> '_',
``<kind>`` one of ``KIND_TYPES``, and next to the kinds ``run.json``: the run's record
(base model, rank, user metadata, last request time) and each checkpoint's metadata
(creation time, expiry, user metadata) by checkpoint id ``<kind>/<name>``.

Invariants:
  R1 every read and write takes the caller's tenant, and only that tenant's folder is ever
     opened: another tenant's run id or tinker path is as unknown as one never made (404);
  R2 the folders are the truth about which checkpoints exist (a folder without metadata,
     e.g. written before this module, is listed with its folder's time and no expiry); the
     metadata of a deleted folder goes with it;
  R3 an expired checkpoint (``expires_at`` passed) is deleted before any read of its tenant's
     checkpoints and by the periodic sweep, so it is never listed, resolved or loaded;
  R4 ``run.json`` is rewritten whole (temporary file + rename) under one lock, so a reader never
     sees half a record; last request times live in memory between writes (a forward_backward
     does not write to disk).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable

from fastapi import HTTPException

# checkpoint kind (the tinker path's segment) -> the SDK's checkpoint_type
KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,64}){0,4}$")
CHECKPOINT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TTL_MIN_S, TTL_MAX_S = 3600, 10 * 365 * 24 * 3600  # the SDK's documented range: 1 hour to 10 years
RECORD = "run.json"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def check_ttl(ttl_seconds: int | None) -> None:
    """ValueError unless None (never expires) or within the SDK's range."""
    if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not TTL_MIN_S <= ttl_seconds <= TTL_MAX_S):
        raise ValueError(f"ttl_seconds={ttl_seconds!r} not supported: {TTL_MIN_S} (1 hour) to {TTL_MAX_S} (10 years), "
                         "or null (never expires)")


def check_user_metadata(user_metadata: dict | None) -> dict[str, str] | None:
    """The metadata as the SDK types it (string keys and values); ValueError otherwise."""
    if user_metadata is None:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in user_metadata.items()):
        raise ValueError("user_metadata must map strings to strings")
    return dict(user_metadata)


class TrainingRuns:
    def __init__(self, root: str | Path, *, clock: Callable[[], float] = time.time):
        """``clock``: wall-clock seconds (creation times, expiry); tests pass their own."""
        self.root = Path(root)
        self.clock = clock
        self._lock = threading.RLock()
        self._last_request: dict[tuple[str, str], float] = {}

    # -- layout ----------------------------------------------------------------------------------

    def run_dir(self, tenant: str, run_id: str) -> Path:
        return self.root / tenant / run_id.replace(":", "_")

    def folder(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        return self.run_dir(tenant, run_id) / kind / name

    def _record(self, tenant: str, run_id: str) -> dict | None:
        path = self.run_dir(tenant, run_id) / RECORD
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def _write(self, tenant: str, run_id: str, record: dict) -> None:
        path = self.run_dir(tenant, run_id) / RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RECORD}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)

    def _known(self, tenant: str, run_id: str) -> dict:
        """The caller's run record (R1); 404 for a bad, unknown or another tenant's id."""
        record = self._record(tenant, run_id) if RUN_ID_RE.match(run_id) else None
        if record is None:
            raise HTTPException(404, f"unknown training run {run_id}")
        return record

    # -- writes (from TinkerService) ---------------------------------------------------------------

    def record_run(self, tenant: str, run_id: str, *, base_model: str, rank: int,
                   user_metadata: dict[str, str] | None) -> None:
        """A model was created (create_model, or create-via-load): its run record, kept after it is unloaded."""
        now = self.clock()
        with self._lock:
            self._write(tenant, run_id, {"training_run_id": run_id, "base_model": base_model, "lora_rank": rank,
                                         "user_metadata": user_metadata, "created": now, "last_request_time": now,
                                         "checkpoints": {}})

    def touch(self, tenant: str, run_id: str) -> None:
        self._last_request[(tenant, run_id)] = self.clock()

    def record_checkpoint(self, tenant: str, run_id: str, kind: str, name: str, *, ttl_seconds: int | None,
                          user_metadata: dict[str, str] | None) -> None:
        """A save wrote ``folder(tenant, run_id, kind, name)``: its time, expiry and metadata."""
        now = self.clock()
        with self._lock:
            record = self._record(tenant, run_id) or {"training_run_id": run_id, "checkpoints": {}}
            record["checkpoints"][f"{kind}/{name}"] = {
                "time": now, "expires_at": None if ttl_seconds is None else now + ttl_seconds, "user_metadata": user_metadata}
            record["last_request_time"] = max(now, self._last_request.get((tenant, run_id), 0.0))
            self._write(tenant, run_id, record)

    def delete(self, tenant: str, run_id: str, kind: str, name: str) -> None:
        """Delete one of the caller's checkpoints (404 if it has none by that id)."""
        with self._lock:
            self.sweep(tenant)
            record, folder = self._checkpoint(tenant, run_id, kind, name)
            shutil.rmtree(folder)
            record["checkpoints"].pop(f"{kind}/{name}", None)
            self._write(tenant, run_id, record)

    def set_ttl(self, tenant: str, run_id: str, kind: str, name: str, ttl_seconds: int | None) -> None:
        """The checkpoint expires ``ttl_seconds`` from now (None: never). ValueError for a bad TTL."""
        check_ttl(ttl_seconds)
        with self._lock:
            self.sweep(tenant)
            record, folder = self._checkpoint(tenant, run_id, kind, name)
            meta = record["checkpoints"].setdefault(f"{kind}/{name}", {"time": folder.stat().st_mtime, "user_metadata": None})
            meta["expires_at"] = None if ttl_seconds is None else self.clock() + ttl_seconds
            self._write(tenant, run_id, record)

    def _checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> tuple[dict, Path]:
        record = self._known(tenant, run_id)
        folder = self.folder(tenant, run_id, kind, name)  # kind and name are checked before the folder is
        if kind not in KIND_TYPES or not CHECKPOINT_NAME_RE.match(name) or not folder.is_dir():
            raise HTTPException(404, f"unknown checkpoint {kind}/{name} of training run {run_id}")
        return record, folder

    def sweep(self, tenant: str | None = None) -> list[str]:
        """Delete the expired checkpoints of ``tenant`` (None: every tenant); their tinker paths (R3)."""
        now = self.clock()
        gone = []
        with self._lock:
            tenants = [tenant] if tenant is not None else [p.name for p in self.root.iterdir() if p.is_dir()] \
                if self.root.is_dir() else []
            for t in tenants:
                for path in sorted((self.root / t).glob(f"*/{RECORD}")):
                    record = json.loads(path.read_text())
                    expired = [cid for cid, m in record["checkpoints"].items()
                               if m.get("expires_at") is not None and m["expires_at"] <= now]
                    if not expired:
                        continue
                    for cid in expired:
                        shutil.rmtree(path.parent / cid, ignore_errors=True)
                        del record["checkpoints"][cid]
                        gone.append(f"tinker://{record['training_run_id']}/{cid}")
                    self._write(t, record["training_run_id"], record)
        return gone

    # -- reads (the RestClient's routes) ---------------------------------------------------------

    def _checkpoints(self, tenant: str, record: dict) -> list[dict]:
        run_id = record["training_run_id"]
        out = []
        for kind, ctype in KIND_TYPES.items():
            kind_dir = self.run_dir(tenant, run_id) / kind
            for folder in sorted(kind_dir.iterdir()) if kind_dir.is_dir() else []:
                if not folder.is_dir() or not CHECKPOINT_NAME_RE.match(folder.name):
                    continue  # a save in progress writes under a temporary name
                cid = f"{kind}/{folder.name}"
                meta = record["checkpoints"].get(cid, {})
                expires = meta.get("expires_at")
                out.append({"checkpoint_id": cid, "checkpoint_type": ctype, "time": _iso(meta.get("time", folder.stat().st_mtime)),
                            "tinker_path": f"tinker://{run_id}/{cid}", "public": False,
                            "size_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
                            "user_metadata": meta.get("user_metadata"), "expires_at": None if expires is None else _iso(expires)})
        return sorted(out, key=lambda c: (c["time"], c["checkpoint_id"]))

    def _run_view(self, tenant: str, record: dict) -> dict:
        run_id = record["training_run_id"]
        checkpoints = self._checkpoints(tenant, record)
        last = {t: [c for c in checkpoints if c["checkpoint_type"] == t] for t in ("training", "sampler")}
        seen = max(record.get("last_request_time", 0.0), self._last_request.get((tenant, run_id), 0.0))
        return {"training_run_id": run_id, "base_model": record.get("base_model"), "model_owner": tenant, "is_lora": True,
                "corrupted": False, "lora_rank": record.get("lora_rank"), "last_request_time": _iso(seen),
                "last_checkpoint": last["training"][-1] if last["training"] else None,
                "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
                "user_metadata": record.get("user_metadata")}

    def get_run(self, tenant: str, run_id: str) -> dict:
        with self._lock:  # reads hold the lock too: a sweep or delete never removes a folder mid-listing
            self.sweep(tenant)
            return self._run_view(tenant, self._known(tenant, run_id))

    def _records(self, tenant: str) -> list[dict]:
        tenant_dir = self.root / tenant
        records = [json.loads(p.read_text()) for p in tenant_dir.glob(f"*/{RECORD}")] if tenant_dir.is_dir() else []
        return sorted(records, key=lambda r: (r.get("created", 0.0), r["training_run_id"]))

    def list_runs(self, tenant: str, limit: int, offset: int) -> dict:
        with self._lock:
            self.sweep(tenant)
            records = self._records(tenant)
            page = [self._run_view(tenant, r) for r in records[offset: offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}

    def list_checkpoints(self, tenant: str, run_id: str) -> dict:
        with self._lock:
            self.sweep(tenant)
            return {"checkpoints": self._checkpoints(tenant, self._known(tenant, run_id))}

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        """Every checkpoint of the caller's runs, newest first."""
        with self._lock:
            self.sweep(tenant)
            everything = [c for r in self._records(tenant) for c in self._checkpoints(tenant, r)]
        everything.sort(key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
        return {"checkpoints": everything[offset: offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)}}

    def checkpoint_folder(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """The folder of one of the caller's live checkpoints (404 otherwise)."""
        with self._lock:
            self.sweep(tenant)
            return self._checkpoint(tenant, run_id, kind, name)[1]
