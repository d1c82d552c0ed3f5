"""Tenant code named by import path: the one place that resolves it (rewards and rollouts).

A tenant's config may name a custom reward function or a custom rollout (an environment
class or an async rollout function) as ``package.module:attribute`` (or
``package.module.attribute``). The service must never import and call arbitrary code of
its host on a tenant's say-so, so a name resolves only when its module is one of the
configured import roots or below one (``myorg.envs`` allows ``myorg.envs`` and
``myorg.envs.calc``, not ``myorg.envs_old``). The roots are the operator's:
``reward_import_roots`` for rewards, ``rollout_import_roots`` for rollouts
(ServiceSettings; LORAFLEET_REWARD_IMPORT_ROOTS / LORAFLEET_ROLLOUT_IMPORT_ROOTS).

The registration check (service/control/config_checks.py) and the rollout worker call the same
loaders (rollout/rewards.py `load_reward`, rollout/rollouts.py `load_rollout`), which call
`import_confined` here, so what registration accepts is exactly what the worker loads.
"""

from __future__ import annotations

import importlib
from typing import Any


class TenantCodeError(ValueError):
    """A name of tenant code that cannot be used; the message says what is allowed."""


# kind -> the setting (and its environment variable) that lists its roots, for the messages
ROOT_SETTINGS = {"reward": "LORAFLEET_REWARD_IMPORT_ROOTS", "rollout": "LORAFLEET_ROLLOUT_IMPORT_ROOTS"}


def split_import_path(name: str, kind: str) -> tuple[str, str]:
    """('package.module', 'attribute') of 'package.module:attribute' or 'package.module.attribute'."""
    module, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not module or not attr:
        raise TenantCodeError(f"custom {kind} {name!r} must look like 'package.module:function'")
    return module, attr


def is_import_path(name: str) -> bool:
    """Whether `name` names tenant code (has a module part) rather than a built-in."""
    return "." in name or ":" in name


def under_roots(module: str, roots: list[str] | tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def import_confined(name: str, roots: list[str] | tuple[str, ...], kind: str, what: str) -> Any:
    """The object `name` names, imported only from under `roots`; TenantCodeError otherwise
    (`what` names the object the message says is missing, e.g. "callable").

    The root check comes before the import: a refused module is never imported (its
    top-level code never runs)."""
    module_name, attr = split_import_path(name, kind)
    if not under_roots(module_name, roots):
        allowed = list(roots) or f"none configured (set {ROOT_SETTINGS.get(kind, 'the import roots')})"
        raise TenantCodeError(f"custom {kind} module {module_name!r} is not under an allowed {kind} import root; allowed: {allowed}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # its own import errors too: the tenant should see them
        raise TenantCodeError(f"cannot import {kind} module {module_name!r}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise TenantCodeError(f"{kind} module {module_name!r} has no {what} {attr!r}")
    return getattr(module, attr)
