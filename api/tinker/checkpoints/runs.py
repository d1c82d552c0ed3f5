"""Training runs and their checkpoints, as the SDK's RestClient sees them.

A Tinker *training run* is a model (its id is the model id, ``<session>:train:<n>``); its
*checkpoints* are the folders its saves wrote. Both outlive the model: a run saved, unloaded
and loaded again in a later session is still listed, its checkpoints still resolvable.

Where they live: the runs and their checkpoints' metadata (creation time, expiry, user metadata)
are records of the registry (service/registry/tinker_records.py: tinker_models,
tinker_checkpoints); each checkpoint's folder is in the one store, at
trainer/storage/layouts.py ``tinker_checkpoint(tenant, run, kind, name)``.

Invariants:
  R1 every read and write takes the caller's tenant, and only that tenant's records and keys are
     ever read: another tenant's run id or tinker path is as unknown as one never made (404);
  R2 a checkpoint exists when its record does and its folder is committed in the store (a save
     records it after the folder is committed; a delete removes the record, then the folder);
  R3 an expired checkpoint (``expires_at`` passed) is deleted before any read of its tenant's
     checkpoints and by the periodic sweep, so it is never listed, resolved or loaded;
  R4 last request times live in memory (a forward_backward writes nothing for them);
  R5 a published checkpoint (``public`` in its record: publish/unpublish, by its owner only) is
     readable by every tenant of the service through its tinker path (load it, sample it, read its
     weights info, copy it, see its run with ``access_scope="accessible"``) and writable by its owner
     only (delete, TTL, publish/unpublish: another tenant's id stays 404); unpublished, expired or
     deleted, it is as unknown to the others as before.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable

from fastapi import HTTPException

from service.registry.tinker_records import TinkerRecords
from trainer.storage import layouts
from trainer.storage.store import CheckpointStore

# checkpoint kind (the tinker path's segment) -> the SDK's checkpoint_type
KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,64}){0,4}$")
CHECKPOINT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TTL_MIN_S, TTL_MAX_S = 3600, 10 * 365 * 24 * 3600  # the SDK's documented range: 1 hour to 10 years


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
    def __init__(self, records: TinkerRecords, store: CheckpointStore, *, clock: Callable[[], float] = time.time):
        """``clock``: wall-clock seconds (creation times, expiry); tests pass their own."""
        self.records = records
        self.store = store
        self.clock = clock
        self._lock = threading.RLock()
        self._last_request: dict[tuple[str, str], float] = {}

    # -- layout ----------------------------------------------------------------------------------

    def key(self, tenant: str, run_id: str, kind: str, name: str) -> str:
        return layouts.tinker_checkpoint(tenant, run_id, kind, name)

    def folder(self, tenant: str, run_id: str, kind: str, name: str) -> str:
        """The store reference of a checkpoint's folder (what the trainer writes to and loads from)."""
        return self.store.url(self.key(tenant, run_id, kind, name))

    def _known(self, tenant: str, run_id: str) -> dict:
        """The caller's run record (R1); 404 for a bad, unknown or another tenant's id."""
        record = self.records.run_of(tenant, run_id) if RUN_ID_RE.match(run_id) else None
        if record is None:
            raise HTTPException(404, f"unknown training run {run_id}")
        return record

    # -- writes (from TinkerService) ---------------------------------------------------------------

    def touch(self, tenant: str, run_id: str) -> None:
        self._last_request[(tenant, run_id)] = self.clock()

    def record_checkpoint(self, tenant: str, run_id: str, kind: str, name: str, *, ttl_seconds: int | None,
                          user_metadata: dict[str, str] | None) -> None:
        """A save committed ``folder(tenant, run_id, kind, name)`` (R2): its expiry and metadata."""
        now = self.clock()
        self.records.add_checkpoint(tenant, run_id, kind, name, None if ttl_seconds is None else now + ttl_seconds,
                                    user_metadata)

    def delete(self, tenant: str, run_id: str, kind: str, name: str) -> None:
        """Delete one of the caller's checkpoints (404 if it has none by that id)."""
        with self._lock:
            self.sweep(tenant)
            self._checkpoint(tenant, run_id, kind, name)
            self.records.delete_checkpoint(tenant, run_id, kind, name).wait()
            self.store.delete(self.key(tenant, run_id, kind, name))

    def set_ttl(self, tenant: str, run_id: str, kind: str, name: str, ttl_seconds: int | None) -> None:
        """The checkpoint expires ``ttl_seconds`` from now (None: never). ValueError for a bad TTL."""
        check_ttl(ttl_seconds)
        with self._lock:
            self.sweep(tenant)
            self._checkpoint(tenant, run_id, kind, name)
            self.records.set_checkpoint_expiry(tenant, run_id, kind, name,
                                               None if ttl_seconds is None else self.clock() + ttl_seconds).wait()

    def _checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> dict:
        self._known(tenant, run_id)
        found = None
        if kind in KIND_TYPES and CHECKPOINT_NAME_RE.match(name):  # checked before a key is built
            found = next((c for c in self.records.checkpoints(tenant, run_id) if (c["kind"], c["name"]) == (kind, name)), None)
        if found is None or not self.store.exists(self.key(tenant, run_id, kind, name)):
            raise HTTPException(404, f"unknown checkpoint {kind}/{name} of training run {run_id}")
        return found

    def sweep(self, tenant: str | None = None) -> list[str]:
        """Delete the expired checkpoints of ``tenant`` (None: every tenant); their tinker paths (R3)."""
        gone = []
        with self._lock:
            for c in self.records.expired_checkpoints(self.clock(), tenant):
                self.records.delete_checkpoint(c["tenant"], c["run_id"], c["kind"], c["name"]).wait()
                self.store.delete(self.key(c["tenant"], c["run_id"], c["kind"], c["name"]))
                gone.append(f"tinker://{c['run_id']}/{c['kind']}/{c['name']}")
        return gone

    # -- reads (the RestClient's routes) ---------------------------------------------------------

    def _checkpoints(self, tenant: str, run_id: str, only_public: bool = False) -> list[dict]:
        out = []
        for c in self.records.checkpoints(tenant, run_id):
            manifest = self.store.manifest(self.key(tenant, run_id, c["kind"], c["name"]))
            if manifest is None or c["kind"] not in KIND_TYPES or (only_public and not c["public"]):
                continue  # R2: a save that did not finish (R5: another tenant sees the published ones only)
            cid = f"{c['kind']}/{c['name']}"
            out.append({"checkpoint_id": cid, "checkpoint_type": KIND_TYPES[c["kind"]], "time": _iso(c["created_at"]),
                        "tinker_path": f"tinker://{run_id}/{cid}", "public": bool(c["public"]),
                        "size_bytes": sum(f.size for f in manifest.files.values()),
                        "user_metadata": json.loads(c["user_metadata"]) if c["user_metadata"] else None,
                        "expires_at": None if c["expires_at"] is None else _iso(c["expires_at"])})
        return sorted(out, key=lambda c: (c["time"], c["checkpoint_id"]))

    def _run_view(self, tenant: str, record: dict, only_public: bool = False) -> dict:
        run_id = record["model_id"]
        checkpoints = self._checkpoints(tenant, run_id, only_public)
        last = {t: [c for c in checkpoints if c["checkpoint_type"] == t] for t in ("training", "sampler")}
        seen = self._last_request.get((tenant, run_id), record["created_at"])
        return {"training_run_id": run_id, "base_model": self.base_model, "model_owner": tenant, "is_lora": True,
                "corrupted": False, "lora_rank": record["rank"], "last_request_time": _iso(seen),
                "last_checkpoint": last["training"][-1] if last["training"] else None,
                "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
                "user_metadata": json.loads(record["user_metadata"]) if record["user_metadata"] else None}

    base_model: str | None = None  # the served base model (set by TinkerService)

    def get_run(self, tenant: str, run_id: str, accessible: bool = False) -> dict:
        """The caller's run; with ``accessible``, also another tenant's run that has a published
        checkpoint (R5: its published checkpoints only)."""
        with self._lock:  # reads hold the lock too: a sweep or delete never removes a folder mid-listing
            self.sweep(tenant)
            if accessible and self.records.run_of(tenant, run_id) is None:
                owner = next((o for o, r in self._published_runs() if r == run_id), None)
                if owner is not None:
                    return self._run_view(owner, self.records.run_of(owner, run_id), only_public=True)
            return self._run_view(tenant, self._known(tenant, run_id))

    def list_runs(self, tenant: str, limit: int, offset: int, accessible: bool = False) -> dict:
        """The caller's runs, oldest first; with ``accessible``, then the other tenants' runs that have a
        published checkpoint (R5)."""
        with self._lock:
            self.sweep(tenant)
            records = [(tenant, r, False) for r in self.records.runs_of(tenant)]
            if accessible:
                records += [(o, row, True) for o, r in self._published_runs() if o != tenant
                            for row in [self.records.run_of(o, r)] if row is not None]
            page = [self._run_view(o, r, shared) for o, r, shared in records[offset: offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}

    # -- publishing (R5) -------------------------------------------------------------------------

    def _published_runs(self) -> list[tuple[str, str]]:
        """(owner, run id) of the runs with a live published checkpoint, expired ones swept first."""
        self.sweep()
        return sorted(self.records.published_runs(), key=lambda pair: pair[1])

    def set_public(self, tenant: str, run_id: str, kind: str, name: str, public: bool) -> None:
        """Publish (or unpublish) one of the caller's checkpoints: 404 if it has none by that id (another
        tenant's included). Idempotent: the SDK sends a request again when its answer was lost (and
        retries a 409 for minutes), so publishing a published checkpoint changes nothing and succeeds."""
        with self._lock:
            self.sweep(tenant)
            if bool(self._checkpoint(tenant, run_id, kind, name)["public"]) != public:
                self.records.set_checkpoint_public(tenant, run_id, kind, name, public).wait()

    def readable(self, tenant: str, run_id: str, kind: str, name: str) -> tuple[str, dict] | None:
        """(owner, record) of a checkpoint the caller may read: its own, else a published one (R5) that
        has not expired; None otherwise (the caller's own run shadows any other: run ids are unique)."""
        if self.records.run_of(tenant, run_id) is not None:
            found = next((c for c in self.records.checkpoints(tenant, run_id) if (c["kind"], c["name"]) == (kind, name)), None)
            return (tenant, found) if found is not None else None
        found = self.records.published(run_id, kind, name)
        if found is None or (found["expires_at"] is not None and found["expires_at"] <= self.clock()):
            return None
        return found["tenant"], found

    def copy_to(self, tenant: str, run_id: str, kind: str, name: str, to_run: str, ttl_seconds: int | None) -> dict:
        """Copy a checkpoint the caller may read (its own or a published one, R5) into the caller's run
        ``to_run``, same kind and name: the folder (hard links, or a server-side copy), then its record
        (R2) with ``ttl_seconds`` and the source's user metadata. The source's run record (its owner's);
        404 if the caller may not read it."""
        with self._lock:  # no sweep or delete removes the source mid-copy
            self.sweep(tenant)
            found = self.readable(tenant, run_id, kind, name)
            run = self.records.run_of(found[0], run_id) if found is not None else None
            if run is None or not self.store.exists(self.key(found[0], run_id, kind, name)):
                raise HTTPException(404, f"no checkpoint tinker://{run_id}/{kind}/{name} for this API key")
            owner, checkpoint = found
            self.store.copy(self.key(owner, run_id, kind, name), self.key(tenant, to_run, kind, name))
            self.record_checkpoint(tenant, to_run, kind, name, ttl_seconds=ttl_seconds,
                                   user_metadata=json.loads(checkpoint["user_metadata"]) if checkpoint["user_metadata"] else None)
            return run

    def readable_key(self, tenant: str, run_id: str, kind: str, name: str) -> str:
        """The store key a read of ``tinker://<run_id>/<kind>/<name>`` by ``tenant`` resolves to: the
        caller's own checkpoint, or a published one (R5); else the caller's key (where nothing is)."""
        found = self.readable(tenant, run_id, kind, name)
        return self.key(found[0] if found is not None else tenant, run_id, kind, name)

    def list_checkpoints(self, tenant: str, run_id: str) -> dict:
        with self._lock:
            self.sweep(tenant)
            self._known(tenant, run_id)
            return {"checkpoints": self._checkpoints(tenant, run_id)}

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        """Every checkpoint of the caller's runs, newest first."""
        with self._lock:
            self.sweep(tenant)
            everything = [c for r in self.records.runs_of(tenant) for c in self._checkpoints(tenant, r["model_id"])]
        everything.sort(key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
        return {"checkpoints": everything[offset: offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)}}

    def checkpoint_folder(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """A local folder holding one of the caller's live checkpoints (verified; 404 otherwise)."""
        with self._lock:
            self.sweep(tenant)
            self._checkpoint(tenant, run_id, kind, name)
            return self.store.get_folder(self.key(tenant, run_id, kind, name))
