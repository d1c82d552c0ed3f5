"""Registration-time checks of an adapter config against the filesystem and the service.

`check_adapter_config` is the one function the controller calls before it
registers a run. It raises `BadValue` (HTTP 400) naming the field, what was
wrong and what is allowed, and returns the config with every path replaced by
its resolved real path, so later readers never follow a symlink that was
swapped after the check.

Path confinement (the security boundary for tenant-supplied paths):
  * no `..` component anywhere in the given path;
  * relative paths are taken relative to the first allowed root they exist under
    (else the first root);
  * the path must lie inside an allowed root lexically AND after resolving
    every symlink (a symlink inside a root that points outside is refused);
  * the lexical check comes first, so a refused path outside the roots does not
    reveal whether it exists.
`init_from` / `resume_from` may instead name a folder of the service's object storage by its s3://
URL: it stays a URL, checked in the store (service/control/ownership.py check_store_start).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from rollout.config import RolloutSpec
from rollout.data import read_line_bounded
from rollout.rewards import RewardLoadError, load_reward
from rollout.rollouts import RolloutLoadError, load_rollout
from service.config.adapter import AdapterConfig
from service.config.job import SlotCapacity
from service.config.settings import ServiceSettings
from service.control.ownership import check_store_start, is_store_url
from service.errors import BadValue
from trainer.storage.locations import open_store

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
    if config.objective == "rl" and config.lora_experts and not capacity.rl_expert_lora:
        raise BadValue(
            "lora_experts: true on an rl adapter trains expert LoRA, which this service's engines cannot serve "
            "(an MoE base on a cpu placement: SGLang serves expert LoRA only on CUDA); allowed: lora_experts: false "
            "(LoRA on attention only) for rl, or objective sft",
            field="config.lora_experts",
        )
    untrainable = [g for g in config.target_modules if g not in capacity.target_groups]
    if untrainable:
        raise BadValue(f"target_modules {untrainable} cannot be trained here: this service's trainer has LoRA layers "
                       f"for {list(capacity.target_groups)} (unembed needs output_layer in trainer.target_modules); "
                       f"allowed: a non-empty subset of {list(capacity.target_groups)}", field="config.target_modules")
    if config.objective == "rl" and "unembed" in config.target_modules and not capacity.rl_unembed_lora:
        raise BadValue("target_modules unembed on an rl adapter trains LoRA on lm_head, which this service's engines do "
                       "not load (engines.lora_target_modules has neither all nor lm_head); allowed for rl: attention, "
                       "mlp (or objective sft)", field="config.target_modules")
    data_roots = list(settings.data_roots)
    model_roots = data_roots + [settings.state_dir]
    data_path = confine_path(config.data.path, data_roots, "config.data.path", want="file")
    budget = _rollout_budget(config, settings, capacity) if config.rollout is not None else None
    # A trajectory's token budget is its context: rows are read with limits that leave it room for a turn.
    limits = row_limits(config, settings, capacity if budget is None else capacity.model_copy(update={"context_tokens": budget}))
    rows = _check_data_file(data_path, config, settings, limits["max_row_bytes"])
    update: dict = {"data": config.data.model_copy(update={"path": str(data_path), **limits})}
    if config.init_from is not None:  # a local folder, or a URL of the service's object storage (ownership.py)
        if is_store_url(config.init_from):
            init_dir = check_store_start(config.init_from, open_store(settings.storage_location), "config.init_from",
                                         peft_marker=PEFT_FILES[0])
        else:
            init_dir = confine_path(config.init_from, model_roots, "config.init_from", want="dir")
        _check_peft_folder(init_dir, config.rank, config.target_modules)
        update["init_from"] = config.init_from if is_store_url(config.init_from) else str(init_dir)
    if config.resume_from is not None:
        if is_store_url(config.resume_from):
            check_store_start(config.resume_from, open_store(settings.storage_location), "config.resume_from", peft_marker=None)
        else:
            update["resume_from"] = str(confine_path(config.resume_from, model_roots, "config.resume_from", want="dir"))
    if config.reward is not None:
        try:
            load_reward(config.reward, settings.reward_import_roots)
        except RewardLoadError as e:
            raise BadValue(f"config.reward.name: {e}", field="config.reward.name") from None
    if config.rollout is not None:
        update["rollout"] = _check_rollout(config, settings, budget)
    checked = config.model_copy(update=update)
    total = planned_steps(config, rows)
    if total == 0:
        raise no_step_refusal(config, rows, data_path.name)
    try:
        config.slot_hyper_params(total)  # the trainer's own checks, now rather than at slot init
    except ValidationError as e:
        raise BadValue(f"config does not fit the trainer ({total} steps): " + "; ".join(err["msg"] for err in e.errors()), field="config") from None
    return CheckedAdapter(config=checked, data_rows=rows, total_steps=total)


def planned_steps(config: AdapterConfig, rows: int) -> int:
    """The optimizer steps a run of `config` over a data file of `rows` rows takes (its total_steps: the
    progress it shows and the length of its learning-rate schedule). The one home of the rule:

      * num_step given: exactly num_step (the data repeats, epoch after epoch, until then);
      * else steps = (rows x epochs) // prompts_per_step, epochs = num_epoch (default 1). The data
        source serves the rows of all epochs as one stream (epoch e+1 follows epoch e inside a step),
        a step takes prompts_per_step of them, and a final part shorter than a step is dropped, never
        trained: SftSource.take_step (SFT) and FleetRuntime.exhausted_runs (RL) drop it.

    `rows` counts what the data source serves: non-blank lines within max_row_bytes (JSONL), every row
    (Parquet). Rows over a token limit are only found when a run first takes them (measuring them needs
    the tokenizer), so a run with such rows takes fewer steps than planned (its rows_skipped_too_long
    metric counts them); a file larger than data_check_bytes has its rows estimated from its size at
    registration, and the runtime makes the total exact when the run opens its data (FleetRuntime.prepare_adapter)."""
    if config.num_step is not None:
        return config.num_step
    epochs = config.data_config().num_epochs  # the data source's own epoch count (one home for its default)
    return rows * epochs // config.prompts_per_step


def no_step_refusal(config: AdapterConfig, rows: int, file_name: str) -> BadValue:
    """The refusal of a run whose data gives no whole step (planned_steps == 0): at registration, and
    when the run opens its data and finds fewer rows than registration estimated (service/fleet/fleet_runtime.py)."""
    epochs = config.data_config().num_epochs
    return BadValue(
        f"config.prompts_per_step: a step takes {config.prompts_per_step} rows (prompts_per_step) but {file_name} has "
        f"{rows} row(s) x {epochs} epoch(s) (num_epoch) = {rows * epochs}, so the run would end without a single step; "
        f"allowed: prompts_per_step at most {rows * epochs}, or add rows, raise num_epoch, or set num_step (the data "
        "then repeats until that many steps)",
        field="config.prompts_per_step",
    )


def row_limits(config: AdapterConfig, settings: ServiceSettings, capacity: SlotCapacity) -> dict[str, int | None]:
    """The length limits the run's rows are read with (DataSpec.max_*): the tenant's where lower, else the
    service's and the model's context. BadValue when the config cannot fit them: a tenant limit above the
    service's, an rl completion budget that leaves no room for a prompt, or a step that could exceed the
    per-step token budget (max_step_tokens)."""
    data = config.data
    context = capacity.context_tokens

    def lowest(field: str, given: int | None, service: int | None, what: str) -> int | None:
        if given is not None and service is not None and given > service:
            raise BadValue(f"config.data.{field} {given} is above the service's limit of {service} ({what}); allowed: 1..{service}",
                           field=f"config.data.{field}")
        return given if given is not None else service

    row_bytes = lowest("max_row_bytes", data.max_row_bytes, settings.max_row_bytes, "max_row_bytes")
    if config.objective == "rl":
        completion = config.sampling.max_new_tokens
        if completion > settings.max_completion_tokens:
            raise BadValue(f"config.sampling.max_new_tokens {completion} is above the service's limit of "
                           f"{settings.max_completion_tokens} (max_completion_tokens); allowed: 1..{settings.max_completion_tokens}",
                           field="config.sampling.max_new_tokens")
        if context is not None and completion >= context:
            raise BadValue(f"config.sampling.max_new_tokens {completion} leaves no room for a prompt in the model's context of "
                           f"{context} tokens; allowed: 1..{context - 1}", field="config.sampling.max_new_tokens")
        room = None if context is None else context - completion  # SGLang: prompt + max_new_tokens <= context
        prompt = lowest("max_prompt_tokens", data.max_prompt_tokens, min(settings.max_prompt_tokens, room or settings.max_prompt_tokens),
                        "max_prompt_tokens, and the model's context minus sampling.max_new_tokens")
        sample = lowest("max_sample_tokens", data.max_sample_tokens, prompt + completion, "max_prompt_tokens + sampling.max_new_tokens")
        prompt = min(prompt, sample - completion)
        if prompt < 1:
            raise BadValue(f"config.data.max_sample_tokens {sample} leaves no room for a prompt next to sampling.max_new_tokens {completion}",
                           field="config.data.max_sample_tokens")
        completion_limit = None
    else:
        prompt = lowest("max_prompt_tokens", data.max_prompt_tokens, settings.max_prompt_tokens, "max_prompt_tokens")
        completion_limit = lowest("max_completion_tokens", data.max_completion_tokens, settings.max_completion_tokens, "max_completion_tokens")
        most = prompt + completion_limit if context is None else min(context, prompt + completion_limit)
        sample = lowest("max_sample_tokens", data.max_sample_tokens, most, "the model's context and max_prompt_tokens + max_completion_tokens")
    step_tokens = config.samples_per_step * sample
    if step_tokens > settings.max_step_tokens:
        knobs = "prompts_per_step, sampling.n_samples_per_prompt, sampling.max_new_tokens" if config.objective == "rl" else "prompts_per_step"
        raise BadValue(
            f"a step of this adapter may hold {config.samples_per_step} samples of up to {sample} tokens = {step_tokens} tokens, "
            f"above the service's per-step budget of {settings.max_step_tokens} tokens (max_step_tokens); lower {knobs}, "
            "or config.data.max_sample_tokens / max_prompt_tokens",
            field="config.prompts_per_step",
        )
    return {"max_row_bytes": row_bytes, "max_prompt_tokens": prompt, "max_completion_tokens": completion_limit, "max_sample_tokens": sample}


def confine_path(raw: str, roots: list[Path], field: str, *, want: str) -> Path:
    """The real path of `raw` if it lies inside one of `roots` (see the module doc); else BadValue."""
    allowed = ", ".join(str(r) for r in roots) or "(none configured: set LORAFLEET_DATA_ROOTS)"
    if not roots:
        raise BadValue(f"{field}: no data roots are configured, so no path is allowed; allowed roots: {allowed}", field=field)
    given = Path(raw)
    if ".." in given.parts:
        raise BadValue(f"{field}: '..' is not allowed in paths (got {raw!r}); give a path inside: {allowed}", field=field)
    # A relative path is taken against the first root it exists under (else the first root): records show
    # paths relative to their root (api.public_paths), so a checkpoint shown as "runs/<run>/checkpoints/..."
    # under the state dir is given back as it is shown.
    path = given if given.is_absolute() else next((r / given for r in roots if (r / given).exists()), roots[0] / given)
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


class _BoundedReader:
    """`readline` over a file that stops (returns b"") once `max_bytes` are read or `deadline` has
    passed; `cut` says so. Registration reads data files through it: bounded memory and time."""

    def __init__(self, f, max_bytes: int, deadline: float) -> None:
        self._f, self._left, self._deadline = f, max_bytes, deadline
        self.read = 0
        self.cut = False

    def readline(self, limit: int = -1) -> bytes:
        if self._left <= 0 or time.monotonic() > self._deadline:
            self.cut = True
            return b""
        size = self._left if limit < 0 else min(limit, self._left)
        line = self._f.readline(size)
        self._left -= len(line)
        self.read += len(line)
        if self._left <= 0 and not line.endswith(b"\n"):
            self.cut = True  # the budget ended inside a line
        return line


def _check_data_file(path: Path, config: AdapterConfig, settings: ServiceSettings, max_row_bytes: int) -> int:
    """Number of rows (estimated from the file size beyond the checked prefix); BadValue when the file
    cannot serve this config (keys missing, not JSON, no usable row in the prefix). Reads at most
    settings.data_check_bytes for at most settings.data_check_s (issue 14, F4)."""
    keys = [config.data.input_key] + ([config.data.label_key] if config.data.label_key else [])
    field = "config.data.path"
    name = path.name
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for parquet data

        try:
            meta = pq.ParquetFile(path)
        except Exception as e:
            raise BadValue(f"{field}: {name} is not a readable parquet file: {e}", field=field) from None
        columns = set(meta.schema_arrow.names)
        missing = [k for k in keys if k not in columns]
        if missing:
            raise BadValue(f"{field}: {name} lacks column(s) {missing}; it has {sorted(columns)}", field=field)
        rows = meta.metadata.num_rows
    else:
        rows = oversized = 0
        with path.open("rb") as raw:
            f = _BoundedReader(raw, settings.data_check_bytes, time.monotonic() + settings.data_check_s)
            for line_no in itertools.count(1):
                line, span = read_line_bounded(f, max_row_bytes)
                if span == 0:  # end of the file, or of the checked prefix
                    break
                if line is None:  # over max_row_bytes (its rest skipped, not kept)
                    oversized += 1
                    continue
                if f.cut and not line.endswith(b"\n"):
                    break  # a line the prefix ends inside: not judged
                if not line.strip():
                    continue
                rows += 1
                if rows > ROWS_CHECKED:
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise BadValue(f"{field}: line {line_no} of {name} is not JSON ({e})", field=field) from None
                if not isinstance(row, dict):
                    raise BadValue(f"{field}: line {line_no} of {name} is not a JSON object", field=field)
                missing = [k for k in keys if k not in row]
                if missing:
                    raise BadValue(
                        f"{field}: line {line_no} of {name} lacks key(s) {missing} (has {sorted(row)}); "
                        "set config.data.input_key / label_key to the keys your rows use",
                        field=field,
                    )
            size = path.stat().st_size
        if rows == 0 and oversized:
            where = f"the first {f.read} bytes" if f.cut else "any of its lines"
            raise BadValue(
                f"{field}: no usable row in {where} of {name}: {oversized} line(s) longer than the {max_row_bytes} bytes a row may "
                f"have (max_row_bytes; registration checks at most {settings.data_check_bytes} bytes, data_check_bytes, "
                f"in {settings.data_check_s:g} s, data_check_s)",
                field=field,
            )
        if rows and f.cut and f.read < size:  # the rest is counted from its size, not read
            rows = math.ceil(rows * size / f.read)
    if rows == 0:
        raise BadValue(f"{field}: {name} has no rows", field=field)
    return rows


# HF module names of a PEFT folder -> the target group that trains them (AdapterConfig.target_modules).
HF_MODULE_GROUPS = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention",
                    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "lm_head": "unembed"}


def _check_peft_folder(folder: Path, rank: int, targets: list[str]) -> None:
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
    modules = peft_cfg.get("target_modules")
    if isinstance(modules, list):
        off = sorted({m for m in modules if HF_MODULE_GROUPS.get(m, targets[0]) not in targets})
        if off:
            need = sorted({HF_MODULE_GROUPS[m] for m in off})
            raise BadValue(f"{field}: the adapter in {folder} has LoRA on {off}, which config.target_modules {targets} "
                           f"does not train; add {need} to target_modules", field=field)


def _rollout_budget(config: AdapterConfig, settings: ServiceSettings, capacity: SlotCapacity) -> int:
    """The token budget of one trajectory (RolloutSpec.max_tokens; default: the model's context): within the
    context, with room for one turn of sampling.max_new_tokens after a prompt."""
    field = "config.rollout.max_tokens"
    context = capacity.context_tokens
    most = context if context is not None else settings.max_prompt_tokens + settings.max_completion_tokens
    budget = config.rollout.max_tokens if config.rollout.max_tokens is not None else most
    least = config.sampling.max_new_tokens + 1  # a one-token prompt and a whole turn
    if not least <= budget <= most:
        within = "the model's context" if context is not None else "max_prompt_tokens + max_completion_tokens"
        raise BadValue(f"{field} {budget} does not fit: a trajectory must hold a prompt and one turn of sampling.max_new_tokens "
                       f"({config.sampling.max_new_tokens}) and stay within {within} ({most}); allowed: {least}..{most}", field=field)
    return budget


def _check_rollout(config: AdapterConfig, settings: ServiceSettings, budget: int) -> RolloutSpec:
    """The run's rollout with its token budget filled in, resolved the way the rollout worker will resolve it
    (rollout.rollouts.load_rollout: import root, kind, kwargs); a step of trajectories of up to `budget`
    tokens must stay within max_step_tokens."""
    spec = config.rollout
    try:
        load_rollout(spec, settings.rollout_import_roots)
    except RolloutLoadError as e:
        field = f"config.rollout.{e.field}"
        raise BadValue(f"{field}: {e}", field=field) from None
    step_tokens = config.samples_per_step * budget
    if step_tokens > settings.max_step_tokens:
        raise BadValue(
            f"a step of this adapter may hold {config.samples_per_step} trajectories of up to {budget} tokens = {step_tokens} "
            f"tokens, above the service's per-step budget of {settings.max_step_tokens} tokens (max_step_tokens); lower "
            "config.rollout.max_tokens, prompts_per_step or sampling.n_samples_per_prompt",
            field="config.rollout.max_tokens",
        )
    return spec.model_copy(update={"max_tokens": budget})
