"""Checkpoints of adapter runs: the on-disk format, atomic writes, lookup and pruning.

One checkpoint = one folder, everything needed to continue the run exactly:

    <run dir>/checkpoints/step-000012/
        adapter/          PEFT export of the slot (adapter_config.json + adapter_model.safetensors):
                          loadable by peft / SGLang as is, and the weights a resume starts from
        trainer/          the trainer's own slot state (trainer.save_slot_state): LoRA weights,
                          AdamW moments, step counter, schedule position, accumulated-gradient state
        run_state.json    `RunState`: step, samples, data cursor, seeds, the run's identity

Invariants:
  * A folder named step-NNNNNN is complete: it is written as `.step-NNNNNN.partial`
    and renamed into place only after every file (run_state.json last) is on disk
    (os.replace of a folder is atomic on one filesystem). A crash mid-write leaves
    only a `.partial` folder, which lookups ignore and the next write replaces.
  * `run_state.json` carries the format tag; a folder without it, or with another
    format, is refused with a message naming the folder.
  * The registry records a checkpoint (record_checkpoint) only after `commit` returned,
    so a recorded path always names a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

CHECKPOINT_FORMAT = "lorafleet-checkpoint-v1"
RUN_STATE_FILE = "run_state.json"
ADAPTER_SUBDIR = "adapter"
TRAINER_SUBDIR = "trainer"
CHECKPOINTS_SUBDIR = "checkpoints"
_PREFIX = "step-"


class CheckpointError(ValueError):
    """A folder that is not a usable lorafleet checkpoint; the message names it and why."""


class RunState(BaseModel):
    """What a checkpoint says about its run, besides the trainer's tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = CHECKPOINT_FORMAT
    name: str = Field(description="Adapter name of the run that wrote it.")
    registration_id: str = Field(description="Registration that wrote it (a resume under a new registration keeps training the same weights).")
    objective: str
    rank: int
    samples_per_step: int | None = Field(None, description="Samples in one optimizer step (the slot steps when it has them all).")
    step: int = Field(ge=0, description="Optimizer steps done.")
    samples_trained: int = Field(ge=0)
    weight_version: int | None = Field(None, description="Version the engines served when it was written (informational).")
    data_cursor: dict[str, Any] | None = Field(None, description="The data source's cursor (rollout data source / SFT source state).")
    rng: dict[str, Any] = Field(default_factory=dict, description="Seeds of the run's generators (data_shuffle_seed, slot_init_seed). No generator state is needed: the data order is a function of seed and epoch, the trainer draws no random numbers after init (tests/integration/test_trainer_resume.py), engine sampling is not seeded.")
    metrics: dict[str, float] = Field(default_factory=dict, description="The last committed step's metrics.")
    created_at: float = Field(default_factory=time.time)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    folder: Path
    state: RunState

    @property
    def adapter_dir(self) -> Path:
        return self.folder / ADAPTER_SUBDIR

    @property
    def trainer_dir(self) -> Path:
        return self.folder / TRAINER_SUBDIR


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_SUBDIR


def step_folder_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


class PendingCheckpoint:
    """A checkpoint being written: fill `adapter_dir` and `trainer_dir`, then `commit(state)`.

    Use as a context manager: leaving it without a commit (an exception) removes the
    partial folder."""

    def __init__(self, run_dir: Path, step: int) -> None:
        self.root = checkpoints_root(run_dir)
        self.final = self.root / step_folder_name(step)
        self.partial = self.root / f".{step_folder_name(step)}.partial"
        self.step = step
        self.committed: Checkpoint | None = None
        if self.partial.exists():  # left by a crash mid-write
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)

    @property
    def adapter_dir(self) -> Path:
        return self.partial / ADAPTER_SUBDIR

    @property
    def trainer_dir(self) -> Path:
        return self.partial / TRAINER_SUBDIR

    def commit(self, state: RunState) -> Checkpoint:
        if state.step != self.step:
            raise ValueError(f"checkpoint folder is for step {self.step}, run state says step {state.step}")
        for sub in (ADAPTER_SUBDIR, TRAINER_SUBDIR):
            if not (self.partial / sub).is_dir() or not any((self.partial / sub).iterdir()):
                raise CheckpointError(f"checkpoint {self.final}: {sub}/ was not written")
        _write_json_durably(self.partial / RUN_STATE_FILE, state.model_dump(mode="json"))
        if self.final.exists():  # same step written again (a drain right after a periodic save)
            shutil.rmtree(self.final)
        os.replace(self.partial, self.final)
        _fsync_dir(self.root)
        self.committed = Checkpoint(self.final, state)
        return self.committed

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is None:
            shutil.rmtree(self.partial, ignore_errors=True)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`: a step folder, or a run's folder / checkpoints folder
    (then its newest complete checkpoint). CheckpointError when there is none."""
    path = Path(path)
    if (path / RUN_STATE_FILE).is_file():
        return _read(path)
    for candidate in (path, path / CHECKPOINTS_SUBDIR):
        newest = latest_checkpoint_folder(candidate)
        if newest is not None:
            return _read(newest)
    raise CheckpointError(
        f"{path} is not a lorafleet checkpoint: no {RUN_STATE_FILE} in it and no complete "
        f"{_PREFIX}NNNNNN folder below it (a checkpoint folder holds {RUN_STATE_FILE}, {ADAPTER_SUBDIR}/ and {TRAINER_SUBDIR}/)"
    )


def latest_checkpoint_folder(root: Path) -> Path | None:
    """The complete step folder with the highest step under `root`, if any."""
    if not root.is_dir():
        return None
    steps = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / RUN_STATE_FILE).is_file()),
        key=lambda p: p.name,
    )
    return steps[-1] if steps else None


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints of a run (and stale partials)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    complete = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))
    stale = [p for p in root.iterdir() if p.name.endswith(".partial")]
    doomed = (complete[:-keep] if keep > 0 else complete) + stale
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _read(folder: Path) -> Checkpoint:
    try:
        raw = json.loads((folder / RUN_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: cannot read {RUN_STATE_FILE}: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != CHECKPOINT_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"checkpoint {folder}: format {got!r} is not {CHECKPOINT_FORMAT!r}")
    try:
        state = RunState.model_validate(raw)
    except ValidationError as e:
        raise CheckpointError(f"checkpoint {folder}: {RUN_STATE_FILE} is invalid: {e}") from None
    for sub in (ADAPTER_SUBDIR, TRAINER_SUBDIR):
        if not (folder / sub).is_dir():
            raise CheckpointError(f"checkpoint {folder}: {sub}/ is missing")
    return Checkpoint(folder, state)


def link_folder(src: Path, dst: Path) -> Path:
    """`dst` becomes a folder holding the files of `src` as hard links (a copy where the two are on
    different filesystems), so a final export is the final checkpoint's PEFT folder, not a second
    write of the same weights. Replaces whatever `dst` held."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


def _write_json_durably(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
