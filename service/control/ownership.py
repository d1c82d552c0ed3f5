"""What a run may start from and export to (issue 14, F5; issue 44): `check_store_start` for a folder
named by its storage URL, `check_tenant_start_paths` for what a tenant may name, and
`check_export_to` for where a run's final export may also go.

A run's `init_from` / `resume_from` names a folder on the service host, or, with `service.storage:
s3://...`, a folder of the service's storage by its URL (``s3://bucket/prefix/runs/<run>/export``:
what the records show as export_path / checkpoint_path). A URL must lie under the storage's own
location (the service holds credentials for it and nothing else) and name a complete folder:
`check_store_start` reads it through the store (a PEFT folder for init_from, a checkpoint for
resume_from) and refuses it otherwise. Local paths are checked by the registration checks
(service/control/config_checks.py: confined to the data roots and the state dir, resolved).

For a tenant (not the admin) this module narrows that further:

  * in the storage, only the tenant's own folders: those of its runs (trainer/storage/layouts.py
    ``run_prefix``: their checkpoints and exports), in any state, and its Tinker prefix
    (``tinker/<tenant>/``: its sampler weights are PEFT folders), whether the storage is the state
    dir, another folder or object storage (`own_references`); everything else there (other tenants'
    runs and Tinker folders, and in the state dir the registry and swap files) is refused;
  * a data root nested inside the state dir stays allowed (the operator shared it);
  * outside the state dir, the shared data roots, as for the admin.

A run's `export_to` names a folder strictly below one of the locations the operator lists for the
caller (service.export_destinations: per tenant, '*' for every tenant; the admin may use any listed
location): an s3:// URL below an s3:// location, or an absolute local path below a local one, part
by part, never through '..'. At the run's end the export is copied there (FleetRuntime.finish_adapter).

The admin (None) keeps the registration checks' rule. The refusal is a BadValue (400) that
says what is allowed and changes nothing. It comes after the existence check of
config_checks, so a tenant can learn whether a path exists; a run folder's name holds the
run's registration id (uuid4), which only its owner and the admin see, so that says
nothing about other tenants' runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from service.config.adapter import AdapterConfig
from service.errors import BadValue
from trainer.storage import layouts
from trainer.storage.store import CheckpointStore, StoreError

URL_SCHEME = "s3://"


def is_store_url(reference: str | Path | None) -> bool:
    """Whether `reference` names a folder by an object-storage URL (not a local path)."""
    return reference is not None and str(reference).startswith(URL_SCHEME)


def _url_parts(url: str) -> list[str] | None:
    """The named parts of an ``s3://`` URL, or None when it is not one of plain named parts (empty,
    '.' or '..' parts: such a URL names nothing a prefix test could vouch for)."""
    parts = url[len(URL_SCHEME):].rstrip("/").split("/")
    return None if any(p in ("", ".", "..") for p in parts) else parts


def url_under(url: str, prefix: str) -> bool:
    """Whether the ``s3://`` URL `url` is `prefix` or lies below it, part by part."""
    inner, outer = _url_parts(url), _url_parts(prefix) if is_store_url(prefix) else None
    return inner is not None and outer is not None and inner[: len(outer)] == outer


def check_store_start(reference: str, store: CheckpointStore, field: str, *, peft_marker: str | None) -> Path | None:
    """An ``s3://`` `reference` to start a run from, checked in `store` (the service's storage): it
    must lie under the store's location and name a complete folder. `peft_marker` set (init_from): a
    PEFT folder (its verified local copy is returned, for the PEFT checks); None (resume_from): a
    lorafleet checkpoint, or a run's folder holding one. BadValue saying what is allowed otherwise."""
    from trainer.storage.locations import readable_folder
    from trainer.storage.run_checkpoints import CheckpointError, load_checkpoint

    root = store.location
    if not is_store_url(root) or not url_under(reference, root):
        where = f"this service's storage is {root}" if is_store_url(root) else "this service's storage is a local folder"
        raise BadValue(f"{field}: {reference} is not a folder of this service's storage ({where}); allowed: a URL under "
                       "it (export_path / checkpoint_path of a run) or a local folder in the data roots", field=field)
    try:
        if peft_marker is not None:
            return readable_folder(store, reference, legacy_marker=peft_marker)
        load_checkpoint(store, reference)
        return None
    except (StoreError, CheckpointError) as e:
        raise BadValue(f"{field}: {e}", field=field) from None


def export_locations(export_destinations: dict[str, list[str]], tenant: str | None) -> list[str]:
    """The locations `tenant` (None: the admin, who may use every listed one) may export below."""
    if tenant is None:
        return sorted({loc for locations in export_destinations.values() for loc in locations})
    return list(export_destinations.get("*", [])) + list(export_destinations.get(tenant, []))


def export_destination(destination: str, locations: Iterable[str]) -> tuple[str, str] | None:
    """(the location holding `destination`, its key there) when `destination` names a folder strictly
    below one of `locations` (the closest), else None."""
    found = None
    for loc in locations:
        if is_store_url(destination) and is_store_url(loc) and url_under(destination, loc):
            key = "/".join(_url_parts(destination)[len(_url_parts(loc)):])
        elif not is_store_url(destination) and not is_store_url(loc) and Path(destination).is_absolute() \
                and ".." not in Path(destination).parts and Path(destination).is_relative_to(loc):
            key = Path(destination).relative_to(loc).as_posix()
        else:
            continue
        if key not in ("", ".") and (found is None or len(loc) > len(found[0])):
            found = (loc, key)
    return found


def check_export_to(destination: str, export_destinations: dict[str, list[str]], tenant: str | None) -> tuple[str, str]:
    """Where a run of `tenant` exports to (`export_destination`); BadValue saying what is allowed."""
    allowed = export_locations(export_destinations, tenant)
    found = export_destination(destination, allowed)
    if found is None:
        raise BadValue(f"config.export_to: {destination} is not below a location you may export to; allowed: a folder "
                       f"below {', '.join(allowed) if allowed else '(none: the operator allows none, service.export_destinations)'}",
                       field="config.export_to")
    return found


def own_references(store: CheckpointStore, runs: Iterable[Any], tenant: str) -> list[str]:
    """Where a tenant's own folders are in `store` (module doc): each run's prefix (`runs`: records
    with name and registration_id) and its Tinker prefix, as the store references them (local
    paths or URLs)."""
    return [store.url(layouts.run_prefix(r.name, r.registration_id)) for r in runs] + [store.url(layouts.tinker_tenant(tenant))]


def may_start_from(path: Path | str, *, state_dir: Path, data_roots: Iterable[Path], own_dirs: Iterable[Path | str]) -> bool:
    """Whether a tenant whose own folders are `own_dirs` (`own_references`) may start from `path` (see the module doc)."""
    own = [str(d) for d in own_dirs]
    if is_store_url(path):
        return any(url_under(str(path), d) for d in own if is_store_url(d))
    real = Path(path).resolve()
    if any(real.is_relative_to(Path(d).resolve()) for d in own if not is_store_url(d)):
        return True
    state = Path(state_dir).resolve()
    roots = [Path(r).resolve() for r in data_roots]
    if real.is_relative_to(state):
        return any(real.is_relative_to(r) and r.is_relative_to(state) for r in roots)
    return any(real.is_relative_to(r) for r in roots)


def check_tenant_start_paths(config: AdapterConfig, *, state_dir: Path, data_roots: Iterable[Path],
                             own_dirs: Iterable[Path | str]) -> None:
    """BadValue when `config` (already checked and resolved) starts from a folder the tenant may not use."""
    roots, dirs = list(data_roots), list(own_dirs)
    for field, value in (("init_from", config.init_from), ("resume_from", config.resume_from)):
        if value is not None and not may_start_from(value, state_dir=state_dir, data_roots=roots, own_dirs=dirs):
            raise BadValue(
                f"config.{field}: {value} is not yours to start from; a tenant may name a folder under the shared "
                "data roots or one of its own runs' checkpoints or exports (checkpoint_path / export_path of "
                "GET /v1/adapters/{name}/runs)",
                field=f"config.{field}",
            )
