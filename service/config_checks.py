"""Registration-time checks of an adapter config against the filesystem and the service.

`check_adapter_config` is the one function the controller calls before it
registers a run. It raises `BadValue` (HTTP 400) naming the field, what was
wrong and what is allowed, and returns the config with every path replaced by
its resolved real path, so later readers never follow a symlink that was
swapped after the check.

Path confinement (the security boundary for tenant-supplied paths):
  * no `..` component anywhere in the given path;
  * relative paths are taken relative to the first allowed root;
  * the path must lie inside an allowed root lexically AND after resolving
    every symlink (a symlink inside a root that points outside is refused);
  * the lexical check comes first, so a refused path outside the roots does not
    reveal whether it exists.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from service.config import AdapterConfig, ServiceSettings, SlotCapacity
from service.errors import BadValue

# Rows whose keys are checked; the rest are only counted (a huge file is not parsed twice).
ROWS_CHECKED = 200
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class CheckedAdapter:
    """A config that passed every registration check, with resolved paths."""

    config: AdapterConfig
    data_rows: int
    total_steps: int | None  # None: unbounded (never happens today: a budget always applies)


def check_adapter_config(config: AdapterConfig, settings: ServiceSettings, capacity: SlotCapacity) -> CheckedAdapter:
    """All checks that need the filesystem or the service's limits; see the module doc."""
    if config.rank > capacity.max_rank:
        raise BadValue(
            f"rank {config.rank} is above the service's max rank {capacity.max_rank}; allowed: 1..{capacity.max_rank}",
            field="config.rank",
        )
    data_roots = list(settings.data_roots)
    model_roots = data_roots + [settings.state_dir]
    data_path = confine_path(config.data.path, data_roots, "config.data.path", want="file")
    rows = _check_data_file(data_path, config)
    update: dict = {"data": config.data.model_copy(update={"path": str(data_path)})}
    if config.init_from is not None:
        init_dir = confine_path(config.init_from, model_roots, "config.init_from", want="dir")
        _check_peft_folder(init_dir, config.rank)
        update["init_from"] = str(init_dir)
    if config.resume_from is not None:
        update["resume_from"] = str(confine_path(config.resume_from, model_roots, "config.resume_from", want="dir"))
    if config.reward is not None:
        _check_reward(config.reward.name, settings.reward_import_roots)
    checked = config.model_copy(update=update)
    if config.num_step is not None:
        total = config.num_step
    else:
        total = math.ceil(rows * (config.num_epoch or 1) / config.prompts_per_step)
    try:
        config.slot_hyper_params(total)  # the trainer's own checks, now rather than at slot init
    except ValidationError as e:
        raise BadValue(f"config does not fit the trainer ({total} steps): " + "; ".join(err["msg"] for err in e.errors()), field="config") from None
    return CheckedAdapter(config=checked, data_rows=rows, total_steps=total)


def confine_path(raw: str, roots: list[Path], field: str, *, want: str) -> Path:
    """The real path of `raw` if it lies inside one of `roots` (see the module doc); else BadValue."""
    allowed = ", ".join(str(r) for r in roots) or "(none configured: set LORAFLEET_DATA_ROOTS)"
    if not roots:
        raise BadValue(f"{field}: no data roots are configured, so no path is allowed; allowed roots: {allowed}", field=field)
    given = Path(raw)
    if ".." in given.parts:
        raise BadValue(f"{field}: '..' is not allowed in paths (got {raw!r}); give a path inside: {allowed}", field=field)
    path = given if given.is_absolute() else roots[0] / given
    abs_roots = [r.absolute() for r in roots]
    real_roots = [r.resolve() for r in roots]
    if not any(path.is_relative_to(r) for r in abs_roots + real_roots):
        raise BadValue(f"{field}: {raw!r} is outside the allowed roots; allowed: {allowed}", field=field)
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise BadValue(f"{field}: {raw!r} does not exist (looked at {path})", field=field) from None
    except (OSError, RuntimeError) as e:  # symlink loop, permission
        raise BadValue(f"{field}: {raw!r} cannot be resolved: {e}", field=field) from None
    if not any(real.is_relative_to(r) for r in real_roots):
        raise BadValue(
            f"{field}: {raw!r} leads outside the allowed roots through a symlink (to {real}); allowed: {allowed}",
            field=field,
        )
    if want == "file" and not real.is_file():
        raise BadValue(f"{field}: {raw!r} is not a regular file", field=field)
    if want == "dir" and not real.is_dir():
        raise BadValue(f"{field}: {raw!r} is not a folder", field=field)
    return real


def _check_data_file(path: Path, config: AdapterConfig) -> int:
    """Number of rows; BadValue when the file cannot serve this config (keys missing, not JSON, empty)."""
    keys = [config.data.input_key] + ([config.data.label_key] if config.data.label_key else [])
    field = "config.data.path"
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for parquet data

        try:
            meta = pq.ParquetFile(path)
        except Exception as e:
            raise BadValue(f"{field}: {path} is not a readable parquet file: {e}", field=field) from None
        columns = set(meta.schema_arrow.names)
        missing = [k for k in keys if k not in columns]
        if missing:
            raise BadValue(f"{field}: {path} lacks column(s) {missing}; it has {sorted(columns)}", field=field)
        rows = meta.metadata.num_rows
    else:
        rows = 0
        with path.open("rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rows += 1
                if rows > ROWS_CHECKED:
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise BadValue(f"{field}: line {line_no} of {path} is not JSON ({e})", field=field) from None
                if not isinstance(row, dict):
                    raise BadValue(f"{field}: line {line_no} of {path} is not a JSON object", field=field)
                missing = [k for k in keys if k not in row]
                if missing:
                    raise BadValue(
                        f"{field}: line {line_no} of {path} lacks key(s) {missing} (has {sorted(row)}); "
                        "set config.data.input_key / label_key to the keys your rows use",
                        field=field,
                    )
    if rows == 0:
        raise BadValue(f"{field}: {path} has no rows", field=field)
    return rows


def _check_peft_folder(folder: Path, rank: int) -> None:
    field = "config.init_from"
    missing = [n for n in PEFT_FILES if not (folder / n).is_file()]
    if missing:
        raise BadValue(f"{field}: {folder} is not a PEFT adapter folder: missing {missing}", field=field)
    try:
        peft_cfg = json.loads((folder / "adapter_config.json").read_text())
    except ValueError as e:
        raise BadValue(f"{field}: {folder}/adapter_config.json is not JSON ({e})", field=field) from None
    if peft_cfg.get("r") is not None and peft_cfg["r"] != rank:
        raise BadValue(f"{field}: the adapter in {folder} has rank {peft_cfg['r']} but config.rank is {rank}; make them equal", field=field)


def _check_reward(name: str, import_roots: list[str]) -> None:
    """Builtin names are always allowed; custom 'package.module:function' only under an import root."""
    field = "config.reward.name"
    if "." not in name and ":" not in name:
        known = builtin_reward_names()
        if name not in known:
            raise BadValue(f"{field}: unknown builtin reward {name!r}; builtins: {known}, or 'package.module:function'", field=field)
        return
    module_name, _, func_name = name.rpartition(":") if ":" in name else name.rpartition(".")
    roots = list(import_roots)
    if not any(module_name == r or module_name.startswith(r + ".") for r in roots):
        allowed = roots or "none configured (set LORAFLEET_REWARD_IMPORT_ROOTS)"
        raise BadValue(f"{field}: module {module_name!r} is not under an allowed reward import root; allowed: {allowed}", field=field)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise BadValue(f"{field}: cannot import {module_name!r}: {type(e).__name__}: {e}", field=field) from None
    if not callable(getattr(module, func_name, None)):
        raise BadValue(f"{field}: {module_name!r} has no callable {func_name!r}", field=field)


def builtin_reward_names() -> list[str]:
    """The builtin reward names, as the rollout side defines them (rollout.rewards.BUILTIN_REWARDS)."""
    try:
        from rollout import rewards  # the rollout side owns the builtin set
    except ImportError:  # TODO(reconcile): drop once rollout/rewards.py has landed
        return ["exact_match", "math", "target_share"]
    return sorted(rewards.BUILTIN_REWARDS)
