"""What a tenant may start a run from (issue 14, F5): `check_tenant_start_paths`.

A run's `init_from` / `resume_from` names a folder on the service host. The registration
checks (service/control/config_checks.py) already confine it to the data roots and the state dir
and resolve it; for a tenant (not the admin) this module narrows that further:

  * inside the state dir, only the tenant's own folders: those of its runs
    (``<state_dir>/runs/<name>-<registration id>/``, service.control.runtime_protocol.run_dir: their
    checkpoints and exports), in any state, and its Tinker folder
    (``<state_dir>/tinker/<tenant>/``: its sampler weights are PEFT folders); everything else
    there (other tenants' runs and Tinker folders, the registry, swap files) is refused;
  * a data root nested inside the state dir stays allowed (the operator shared it);
  * outside the state dir, the shared data roots, as for the admin.

The admin (None) keeps the registration checks' rule. The refusal is a BadValue (400) that
says what is allowed and changes nothing. It comes after the existence check of
config_checks, so a tenant can learn whether a path exists; a run folder's name holds the
run's registration id (uuid4), which only its owner and the admin see, so that says
nothing about other tenants' runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from service.config.adapter import AdapterConfig
from service.errors import BadValue


def may_start_from(path: Path, *, state_dir: Path, data_roots: Iterable[Path], own_dirs: Iterable[Path]) -> bool:
    """Whether a tenant whose own folders in the state dir are `own_dirs` may start from `path` (see the module doc)."""
    real = Path(path).resolve()
    if any(real.is_relative_to(Path(d).resolve()) for d in own_dirs):
        return True
    state = Path(state_dir).resolve()
    roots = [Path(r).resolve() for r in data_roots]
    if real.is_relative_to(state):
        return any(real.is_relative_to(r) and r.is_relative_to(state) for r in roots)
    return any(real.is_relative_to(r) for r in roots)


def check_tenant_start_paths(config: AdapterConfig, *, state_dir: Path, data_roots: Iterable[Path],
                             own_dirs: Iterable[Path]) -> None:
    """BadValue when `config` (already checked and resolved) starts from a folder the tenant may not use."""
    roots, dirs = list(data_roots), list(own_dirs)
    for field, value in (("init_from", config.init_from), ("resume_from", config.resume_from)):
        if value is not None and not may_start_from(Path(value), state_dir=state_dir, data_roots=roots, own_dirs=dirs):
            raise BadValue(
                f"config.{field}: {value} is not yours to start from; a tenant may name a folder under the shared "
                "data roots or one of its own runs' checkpoints or exports (checkpoint_path / export_path of "
                "GET /v1/adapters/{name}/runs)",
                field=f"config.{field}",
            )
