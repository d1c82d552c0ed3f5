"""Per-adapter prompt datasets: JSONL or Parquet, deterministic per-epoch order, resumable cursor.

A row goes through three states: *fresh* (not yet taken this epoch), *pending*
(taken: in flight, buffered, or re-queued) and *consumed* (handed to
training). Only `consume` makes progress; aborted or dropped work is
`requeue`d and served again before any fresh row. The cursor records the epoch,
the position in that epoch's order, and the pending rows, so a run restored
from it sees exactly the rows it had not trained on, in the same order.

Order: epoch e visits rows in the permutation drawn by
``random.Random(f"{shuffle_seed}:{e}")`` (file order when shuffle_seed is
None): the same for every run with the same seed, different per epoch.
"""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rollout.config import DataConfig


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, and the row and key where relevant."""


class PromptRow(BaseModel):
    """One prompt ready to generate from."""

    model_config = ConfigDict(frozen=True)

    index: int  # row number in the file (0-based)
    epoch: int  # epoch in which it was first taken
    prompt: Any  # the raw input (string or message list)
    prompt_text: str  # what the model sees (after the chat template)
    input_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] | None = None
    # Which take() produced this row (for consume/requeue); private, not serialized.
    _serial: int = PrivateAttr(0)


class DataCursor(BaseModel):
    """Where a data source stands; enough to resume it exactly."""

    model_config = ConfigDict(frozen=True)

    epoch: int = 0
    position: int = 0  # rows of this epoch's order already taken
    pending: list[tuple[int, int]] = Field(default_factory=list)  # (row index, epoch) taken but not consumed, in serve order
    consumed: int = 0  # rows consumed so far, all epochs


class DataStatus(BaseModel):
    model_config = ConfigDict(frozen=True)

    rows: int
    epoch: int
    position: int
    pending: int
    consumed: int
    exhausted: bool  # num_epochs done and nothing pending: this adapter's data is used up


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def read_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """Read and validate every row; refuse with a message naming the file, the row and the key."""
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist or is not a file")
    rows: list[dict[str, Any]] = []
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"data file {path}, line {lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"data file {path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        where = lambda i: f"data file {path}, line {i + 1}"  # noqa: E731 (blank lines aside)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"data file {path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for key in (cfg.input_key, cfg.label_key):
            if key is not None and key not in table.column_names:
                raise DataError(f"data file {path}: no column {key!r}; columns: {table.column_names}")
        rows = table.to_pylist()
        where = lambda i: f"data file {path}, row {i}"  # noqa: E731
    else:
        raise DataError(f"data file {path}: unknown format; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"data file {path} has no rows")
    for i, row in enumerate(rows):
        if cfg.input_key not in row:
            raise DataError(f"{where(i)}: missing input key {cfg.input_key!r} (keys: {sorted(row)})")
        value = row[cfg.input_key]
        if not (isinstance(value, str) or _is_messages(value)):
            raise DataError(
                f"{where(i)}: {cfg.input_key!r} must be a string or a list of {{'role', 'content'}} messages, got {type(value).__name__}"
            )
        if cfg.label_key is not None and cfg.label_key not in row:
            raise DataError(f"{where(i)}: missing label key {cfg.label_key!r} (keys: {sorted(row)})")
        if cfg.metadata_key is not None and row.get(cfg.metadata_key) is not None and not isinstance(row[cfg.metadata_key], dict):
            raise DataError(f"{where(i)}: metadata key {cfg.metadata_key!r} must hold an object, got {type(row[cfg.metadata_key]).__name__}")
    return rows


class DataSource:
    """The prompts of one adapter. Not thread-safe; owned by one asyncio loop."""

    def __init__(self, cfg: DataConfig, tokenizer, cursor: DataCursor | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._rows = read_rows(cfg)
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)
        self._requeued: deque[tuple[int, int]] = deque()  # (index, epoch), served before fresh rows
        self._outstanding: dict[int, tuple[int, int]] = {}  # take serial -> (index, epoch): taken, not consumed/requeued
        self._serial = 0
        self._consumed = 0
        self._rendered: dict[int, tuple[str, list[int]]] = {}
        if cursor is not None:
            self.restore(cursor)

    def __len__(self) -> int:
        return len(self._rows)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self.cfg.shuffle_seed is not None:
            random.Random(f"{self.cfg.shuffle_seed}:{epoch}").shuffle(order)
        return order

    def _render(self, index: int) -> tuple[str, list[int]]:
        if index not in self._rendered:
            value = self._rows[index][self.cfg.input_key]
            if isinstance(value, str) and not self.cfg.apply_chat_template:
                text = value
                ids = self.tokenizer(text)["input_ids"]
            else:
                messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                # The template already holds any special tokens: add none.
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._rendered[index] = (text, list(ids))
        return self._rendered[index]

    def _row(self, index: int, epoch: int, serial: int) -> PromptRow:
        raw = self._rows[index]
        text, ids = self._render(index)
        meta = raw.get(self.cfg.metadata_key) if self.cfg.metadata_key else None
        row = PromptRow(
            index=index,
            epoch=epoch,
            prompt=raw[self.cfg.input_key],
            prompt_text=text,
            input_ids=ids,
            label=raw.get(self.cfg.label_key) if self.cfg.label_key else None,
            metadata=meta,
        )
        row._serial = serial
        return row

    def _fresh_left(self) -> bool:
        """Rows not yet taken remain in this epoch, or another epoch is allowed."""
        return (
            self._position < len(self._order)
            or self.cfg.num_epochs is None
            or self._epoch + 1 < self.cfg.num_epochs
        )

    def take(self) -> PromptRow | None:
        """The next prompt: a re-queued one first, else the next fresh one; None when the data is used up
        (rows may still be pending: see status().exhausted)."""
        if self._requeued:
            index, epoch = self._requeued.popleft()
        else:
            if not self._fresh_left():
                return None
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._order_for(self._epoch)
            index, epoch = self._order[self._position], self._epoch
            self._position += 1
        self._serial += 1
        self._outstanding[self._serial] = (index, epoch)
        return self._row(index, epoch, self._serial)

    def _pop_outstanding(self, row: PromptRow) -> tuple[int, int]:
        serial = row._serial
        if serial not in self._outstanding:
            raise ValueError(f"row {row.index} was not taken from this data source, or was already consumed/re-queued")
        return self._outstanding.pop(serial)

    def requeue(self, row: PromptRow) -> None:
        """Give a taken row back (its group was aborted, failed or dropped): it is served again next."""
        self._requeued.appendleft(self._pop_outstanding(row))

    def consume(self, row: PromptRow) -> None:
        """The row's group went to training: it counts as progress and is never served again this epoch."""
        self._pop_outstanding(row)
        self._consumed += 1

    def cursor(self) -> DataCursor:
        """Resume point: rows taken but not consumed come back first, in the order they were taken."""
        pending = [self._outstanding[s] for s in sorted(self._outstanding)] + list(self._requeued)
        return DataCursor(epoch=self._epoch, position=self._position, pending=pending, consumed=self._consumed)

    def restore(self, cursor: DataCursor) -> None:
        if cursor.position > len(self._rows) or any(not 0 <= i < len(self._rows) for i, _ in cursor.pending):
            raise DataError(f"data file {self.cfg.path}: cursor does not fit this file ({len(self._rows)} rows)")
        self._epoch = cursor.epoch
        self._order = self._order_for(cursor.epoch)
        self._position = cursor.position
        self._requeued = deque((int(i), int(e)) for i, e in cursor.pending)
        self._outstanding.clear()
        self._consumed = cursor.consumed

    def status(self) -> DataStatus:
        pending = len(self._outstanding) + len(self._requeued)
        fresh_left = self._fresh_left()
        return DataStatus(
            rows=len(self._rows),
            epoch=self._epoch,
            position=self._position,
            pending=pending,
            consumed=self._consumed,
            exhausted=not fresh_left and pending == 0,
        )
