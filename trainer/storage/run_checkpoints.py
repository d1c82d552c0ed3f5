"""Checkpoints of dataset runs in the one store: the format, the atomic commit, lookup and pruning.

One checkpoint = one folder of the store (trainer/storage/layouts.py ``run_checkpoint``), everything
needed to continue the run exactly:

    runs/<name>-<registration>/checkpoints/step-000012/
        adapter/          PEFT export of the slot (adapter_config.json + adapter_model.safetensors):
                          loadable by peft / SGLang as is, and the weights a resume starts from
        trainer/          the trainer's own slot state (TrainerInterface.save_slot_state): LoRA weights,
                          AdamW moments, step counter, schedule position, accumulated-gradient state
        run_state.json    `RunState`: step, samples, data cursor, seeds, the run's identity

Invariants:
  * ``adapter/`` and ``trainer/`` are committed by the trainer's rank 0, each on its own; the step
    folder is committed last by the coordinator, its manifest naming both (store.py S4). So a
    step folder is complete only when all three are, whoever crashed when (store.py S1, S2).
  * `run_state.json` carries the format tag; a folder without it, or with another format, is refused
    with a message naming the folder.
  * The registry records a checkpoint (record_checkpoint) only after `commit` returned, so a
    recorded reference always names a complete checkpoint.
  * Folders written before the store (no manifest, ``run_state.json`` written last into a folder
    renamed into place) are read as complete when they hold all three parts (an upgrade resumes);
    they exist only in local stores (an object store was only ever written through the store).
  * Works on every backend: everything goes through the store's interface (the step folders below a
    prefix, committed or not: `CheckpointStore.folders`); only folders written before the store are
    looked for on a local disk.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.storage import layouts
from trainer.storage.locations import locate
from trainer.storage.store import CheckpointStore, StoreError

CHECKPOINT_FORMAT = "lorafleet-checkpoint-v1"
RUN_STATE_FILE = "run_state.json"
PARTS = (layouts.ADAPTER_PART, layouts.TRAINER_PART)
log = logging.getLogger(__name__)


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


class StepFolder:
    """A checkpoint's step folder (``key``) and its two parts' keys: the trainer's slot state and the
    adapter (layouts.TRAINER_PART, ADAPTER_PART)."""

    key: str

    @property
    def trainer_key(self) -> str:
        return f"{self.key}/{layouts.TRAINER_PART}"

    @property
    def adapter_key(self) -> str:
        return f"{self.key}/{layouts.ADAPTER_PART}"


@dataclass(frozen=True)
class Checkpoint(StepFolder):
    """A complete checkpoint in the store."""

    store: CheckpointStore
    key: str
    state: RunState

    @property
    def folder(self) -> str:
        """Its reference (a local path, or an s3:// URL): what the registry records."""
        return self.store.url(self.key)


class PendingCheckpoint(StepFolder):
    """A checkpoint being written: the trainer commits `trainer_key` and `adapter_key`, then
    `commit(state)` commits the step folder. Use as a context manager: leaving it without a commit
    (an exception) removes what was written."""

    def __init__(self, store: CheckpointStore, name: str, registration_id: str, step: int) -> None:
        self.store = store
        self.key = layouts.run_checkpoint(name, registration_id, step)
        self.step = step
        self.committed: Checkpoint | None = None
        # a previous write of this step: a crash mid-write, or a run's state that changed since its step's
        # checkpoint (an RL run's aborted prompts back in its cursor); write_checkpoint never gets here
        # for a checkpoint of the same state, which stays as it is
        store.delete(self.key)

    def commit(self, state: RunState) -> Checkpoint:
        if state.step != self.step:
            raise ValueError(f"checkpoint folder is for step {self.step}, run state says step {state.step}")
        for part in PARTS:
            if not self.store.complete(f"{self.key}/{part}"):
                raise CheckpointError(f"checkpoint {self.store.url(self.key)}: {part}/ was not written")
        with self.store.write_folder(self.key, children=PARTS) as tmp:
            (tmp / RUN_STATE_FILE).write_text(json.dumps(state.model_dump(mode="json"), indent=2, sort_keys=True))
        self.committed = Checkpoint(self.store, self.key, state)
        return self.committed

    def __enter__(self) -> PendingCheckpoint:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.committed is None:
            try:
                self.store.delete(self.key)
            except StoreError as e:  # the store is unreachable: what was written stays uncommitted (store.py S2)
                if exc_type is None:
                    raise
                log.warning("checkpoint %s: removing the unfinished write failed (%s); it stays uncommitted, and "
                            "the next write of this step replaces it", self.store.url(self.key), e)


def write_checkpoint(store: CheckpointStore, state: RunState, write_parts: Callable[[PendingCheckpoint], None]) -> Checkpoint:
    """The run's checkpoint of `state`: `write_parts(pending)` commits its trainer and adapter parts,
    then the step folder is committed. Unless the step's folder is already a complete checkpoint of
    exactly `state` (nothing changed since: a run's final checkpoint right after its last periodic
    one): that one is returned as it is. Rewriting it would delete it first (PendingCheckpoint), and a
    crash before the new commit would lose the checkpoint the registry records (seen: a kill -9 while
    a retiring run rewrote its step 4, and its restart refused the half-written folder)."""
    key = layouts.run_checkpoint(state.name, state.registration_id, state.step)
    try:
        existing = _read(store, key)  # the step folder's own files only (run_state.json), not its parts
    except CheckpointError:  # none, or not complete: written anew
        existing = None
    if existing is not None and _same_run_state(existing.state, state):
        return existing
    with PendingCheckpoint(store, state.name, state.registration_id, state.step) as pending:
        write_parts(pending)
        return pending.commit(state)


def _same_run_state(a: RunState, b: RunState) -> bool:
    """The same state of the run, whenever each was written (created_at apart)."""
    return a.model_dump(exclude={"created_at"}) == b.model_dump(exclude={"created_at"})


def load_checkpoint(store: CheckpointStore, reference: str | Path) -> Checkpoint:
    """The checkpoint `reference` names: a step folder, or a run's folder or checkpoints folder
    (then its newest complete checkpoint). A reference outside `store` (a resume_from in a data
    root) is read from the local filesystem. CheckpointError when there is none."""
    store, key = locate(store, reference)  # a reference outside this store: an absolute path on this machine
    if _has_run_state(store, key) and (store.manifest(key) is not None or _legacy(store, key)):
        return _read(store, key)
    for candidate in (key, f"{key}/{layouts.CHECKPOINTS}"):
        newest = latest_checkpoint(store, candidate)
        if newest is not None:
            return _read(store, newest)
    raise CheckpointError(
        f"{reference} is not a lorafleet checkpoint: no {RUN_STATE_FILE} in it and no complete "
        f"{layouts.STEP_PREFIX}NNNNNN folder below it (a checkpoint folder holds {RUN_STATE_FILE}, "
        f"{layouts.ADAPTER_PART}/ and {layouts.TRAINER_PART}/)"
    )


def latest_checkpoint(store: CheckpointStore, prefix: str) -> str | None:
    """The complete step folder with the highest step under `prefix`, if any."""
    steps = [k for k in _step_folders(store, prefix) if _complete(store, k)]
    return steps[-1] if steps else None


def prune_checkpoints(store: CheckpointStore, prefix: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints under `prefix` (and incomplete ones
    older than the newest complete: writes that did not finish)."""
    folders = _step_folders(store, prefix)
    complete = [k for k in folders if _complete(store, k)]
    kept = set(complete[-keep:]) if keep > 0 else set()
    newest = complete[-1] if complete else None
    doomed = [k for k in folders if k not in kept and (k in complete or (newest is not None and k < newest))]
    for key in doomed:
        store.delete(key)
    return doomed


def _step_folders(store: CheckpointStore, prefix: str) -> list[str]:
    """Every step folder under `prefix`, committed or not, in step order (a write cut short leaves
    one without a manifest, which `store.list` would not show and pruning must see)."""
    return sorted(k for k in store.folders(prefix) if k.rsplit("/", 1)[-1].startswith(layouts.STEP_PREFIX))


def _has_run_state(store: CheckpointStore, key: str) -> bool:
    m = store.manifest(key)
    if m is not None:
        return RUN_STATE_FILE in m.files
    folder = store.legacy_folder(key)  # written before the store
    return folder is not None and (folder / RUN_STATE_FILE).is_file()


def _complete(store: CheckpointStore, key: str) -> bool:
    """Committed with both parts (store.py S4), or a folder written before the store with all three."""
    if store.manifest(key) is not None:
        return store.complete(key)
    return _legacy(store, key)


def _legacy(store: CheckpointStore, key: str) -> bool:
    """A folder written before the store: all three parts there and no manifest anywhere in it (a write
    of this version cut short has manifests in its parts: it is incomplete, never legacy)."""
    folder = store.legacy_folder(key)
    return (folder is not None and (folder / RUN_STATE_FILE).is_file() and all((folder / p).is_dir() for p in PARTS)
            and not any(store.manifest(f"{key}/{p}") is not None for p in PARTS))


def _read(store: CheckpointStore, key: str) -> Checkpoint:
    where = store.url(key)
    if store.manifest(key) is not None:
        try:
            folder = store.get_folder(key)
        except StoreError as e:
            raise CheckpointError(f"checkpoint {e}") from None
    elif _legacy(store, key):  # written before the store (module doc): a local folder
        folder = store.legacy_folder(key)
    else:
        raise CheckpointError(f"checkpoint {where} is not complete (a write that did not finish): no manifest")
    try:
        raw = json.loads((folder / RUN_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {where}: cannot read {RUN_STATE_FILE}: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != CHECKPOINT_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"checkpoint {where}: format {got!r} is not {CHECKPOINT_FORMAT!r}")
    try:
        state = RunState.model_validate(raw)
    except ValidationError as e:
        raise CheckpointError(f"checkpoint {where}: {RUN_STATE_FILE} is invalid: {e}") from None
    for part in PARTS:
        if not _part_present(store, f"{key}/{part}", folder / part):
            raise CheckpointError(f"checkpoint {where}: {part}/ is missing")
    return Checkpoint(store, key, state)


def _part_present(store: CheckpointStore, key: str, local: Path) -> bool:
    return store.complete(key) if store.manifest(key) is not None else local.is_dir()
