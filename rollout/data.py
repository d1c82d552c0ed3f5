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

Bounded reading: a JSONL file is streamed (an index of line offsets, rows read
when taken), and a line longer than cfg.max_row_bytes is skipped and counted
without being loaded. A Parquet file is streamed too (checked in record batches
at open; a taken row is read with its row group, at most two groups held). Rows over a token limit (prompt, completion, whole sample:
the model's context, the service's limits) are skipped and counted when first
taken, so one tenant's over-long rows never reach an engine or a train call.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from array import array
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, BinaryIO

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
    completion_ids: list[int] | None = None  # completion sources (SFT): the label's tokens + EOS
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
    exhausted: bool  # num_epochs done and nothing pending: this adapter's data is used up (never when unusable)
    skipped_too_long: int = 0  # rows over a token limit (cfg.max_*_tokens): never served
    skipped_oversized: int = 0  # lines over cfg.max_row_bytes: never loaded
    unusable: str | None = None  # set when every row is over a limit: why nothing can be served

    def skip_metrics(self) -> dict[str, float]:
        """The skip counts under the metric keys the adapter's record and step metrics use."""
        return {"rows_skipped_too_long": float(self.skipped_too_long), "rows_skipped_oversized": float(self.skipped_oversized)}


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_row(row: Any, cfg: DataConfig, where: str) -> dict[str, Any]:
    """`row` if it can serve `cfg` (an object with the input key, and the label key when one is set); else DataError."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if cfg.input_key not in row:
        raise DataError(f"{where}: missing input key {cfg.input_key!r} (keys: {sorted(row)})")
    value = row[cfg.input_key]
    if not (isinstance(value, str) or _is_messages(value)):
        raise DataError(
            f"{where}: {cfg.input_key!r} must be a string or a list of {{'role', 'content'}} messages, got {type(value).__name__}"
        )
    if cfg.label_key is not None and cfg.label_key not in row:
        raise DataError(f"{where}: missing label key {cfg.label_key!r} (keys: {sorted(row)})")
    if cfg.metadata_key is not None and row.get(cfg.metadata_key) is not None and not isinstance(row[cfg.metadata_key], dict):
        raise DataError(f"{where}: metadata key {cfg.metadata_key!r} must hold an object, got {type(row[cfg.metadata_key]).__name__}")
    return row


def read_line_bounded(f: BinaryIO, max_bytes: int | None) -> tuple[bytes | None, int]:
    """The next line of `f` and the bytes it spans. A line longer than `max_bytes` (newline not
    counted) is passed over in bounded chunks and returned as None: it is never held in memory.
    Returns (b"", 0) at the end of the file."""
    if max_bytes is None:
        line = f.readline()
        return line, len(line)
    line = f.readline(max_bytes + 1)
    if line.endswith(b"\n") or len(line) <= max_bytes:
        return line, len(line)
    span = len(line)
    while True:  # over the cap: skip to the end of the line without keeping it
        chunk = f.readline(1 << 16)
        span += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return None, span


class _JsonlRows:
    """A JSONL file as rows by index, streamed: one pass at open records where each usable line
    starts (8 bytes a row) and checks it; a row is read from disk again when it is taken. Lines
    over cfg.max_row_bytes are skipped and counted (`oversized`) without being loaded; blank
    lines are ignored. Row indices count the kept lines, so they are stable for a given cap."""

    def __init__(self, path: Path, cfg: DataConfig):
        self.path = path
        self.cfg = cfg
        self._offsets = array("q")
        self._lines = array("q")  # 1-based line numbers, for messages
        self.oversized = 0
        offset = 0
        with path.open("rb") as f:
            for lineno in itertools.count(1):
                line, span = read_line_bounded(f, cfg.max_row_bytes)
                if span == 0:
                    break
                if line is None:
                    self.oversized += 1
                elif line.strip():
                    self._parse(line, lineno)  # checked once here; the row is not kept
                    self._offsets.append(offset)
                    self._lines.append(lineno)
                offset += span
        self._file: BinaryIO | None = None

    def _parse(self, line: bytes, lineno: int) -> dict[str, Any]:
        where = f"data file {self.path}, line {lineno}"
        try:
            row = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            raise DataError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
        return check_row(row, self.cfg, where)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._file is None:
            self._file = self.path.open("rb")
        self._file.seek(self._offsets[index])
        line, _ = read_line_bounded(self._file, self.cfg.max_row_bytes)
        if not line:
            raise DataError(f"data file {self.path}, line {self._lines[index]}: changed since it was opened")
        return self._parse(line, self._lines[index])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _ParquetRows:
    """A Parquet file as rows by index, streamed: one pass at open checks every row in record
    batches (only the columns a source uses: input, label, metadata); a row is read again when
    it is taken, by reading its row group (those columns only). At most ``CACHED_GROUPS`` row
    groups are held at once, so memory is bounded by the row-group size, not the file size.
    Row indices are row numbers in the file (across row groups), as when the file was read
    whole: cursors keep their meaning."""

    CACHED_GROUPS = 2
    CHECK_BATCH_ROWS = 1024

    def __init__(self, path: Path, cfg: DataConfig):
        import pyarrow.parquet as pq

        self.path = path
        self.cfg = cfg
        self.oversized = 0  # (a Parquet row has no line to measure; cfg.max_row_bytes applies to JSONL)
        try:
            self._file = pq.ParquetFile(path)
            names = self._file.schema_arrow.names
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"data file {path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for key in (cfg.input_key, cfg.label_key):
            if key is not None and key not in names:
                raise DataError(f"data file {path}: no column {key!r}; columns: {names}")
        self._columns = [k for k in dict.fromkeys((cfg.input_key, cfg.label_key, cfg.metadata_key)) if k is not None and k in names]
        meta = self._file.metadata
        self._starts = [0]  # first row index of each row group, then the row count
        for g in range(meta.num_row_groups):
            self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        self._groups: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        index = 0
        try:
            for batch in self._file.iter_batches(batch_size=self.CHECK_BATCH_ROWS, columns=self._columns):
                for row in batch.to_pylist():
                    check_row(row, cfg, f"data file {path}, row {index}")
                    index += 1
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"data file {path}: not a readable Parquet file ({type(e).__name__}: {e})") from None

    def __len__(self) -> int:
        return self._starts[-1]

    def _group(self, g: int) -> list[dict[str, Any]]:
        rows = self._groups.get(g)
        if rows is None:
            rows = self._file.read_row_group(g, columns=self._columns).to_pylist()
            self._groups[g] = rows
            while len(self._groups) > self.CACHED_GROUPS:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(g)
        return rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        g = bisect.bisect_right(self._starts, index) - 1
        return self._group(g)[index - self._starts[g]]

    def close(self) -> None:
        self._groups.clear()


def open_rows(cfg: DataConfig) -> _JsonlRows | _ParquetRows:
    """The rows of cfg.path by index (streamed: _JsonlRows, _ParquetRows); DataError naming the file,
    row and key when it cannot serve."""
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist or is not a file")
    if path.suffix == ".jsonl":
        rows: _JsonlRows | _ParquetRows = _JsonlRows(path, cfg)
        if not len(rows) and rows.oversized:
            raise DataError(f"data file {path}: every line ({rows.oversized}) is longer than the {cfg.max_row_bytes} bytes a row may have")
    elif path.suffix == ".parquet":
        rows = _ParquetRows(path, cfg)
    else:
        raise DataError(f"data file {path}: unknown format; use .jsonl or .parquet")
    if not len(rows):
        raise DataError(f"data file {path} has no rows")
    return rows


class DataSource:
    """The prompts of one adapter. Not thread-safe; owned by one asyncio loop.

    Length limits (cfg.max_prompt_tokens, max_completion_tokens, max_sample_tokens): a row is
    measured in tokens when it is first taken; a row over a limit is skipped, counted, and never
    served again (`status().skipped_too_long`). With `completions=True` (SFT) the label is the
    completion: it is tokenized (plus EOS) and measured too. When every row is over a limit the
    source serves nothing and `status().unusable` says why."""

    RENDER_CACHE = 4096  # rendered rows kept (requeued rows come back soon; memory stays bounded)

    def __init__(self, cfg: DataConfig, tokenizer, cursor: DataCursor | None = None, *, completions: bool = False):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.completions = completions
        self._rows = open_rows(cfg)
        self._epoch = 0
        self._position = 0
        self._order = self._order_for(0)
        self._requeued: deque[tuple[int, int]] = deque()  # (index, epoch), served before fresh rows
        self._outstanding: dict[int, tuple[int, int]] = {}  # take serial -> (index, epoch): taken, not consumed/requeued
        self._serial = 0
        self._consumed = 0
        self._rendered: OrderedDict[int, tuple[str, list[int], list[int] | None]] = OrderedDict()
        self._too_long: dict[int, str] = {}  # row index -> which limit it broke (never served)
        if cursor is not None:
            self.restore(cursor)

    def __len__(self) -> int:
        return len(self._rows)

    def close(self) -> None:
        self._rows.close()

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self.cfg.shuffle_seed is not None:
            random.Random(f"{self.cfg.shuffle_seed}:{epoch}").shuffle(order)
        return order

    def _render(self, index: int, raw: dict[str, Any]) -> tuple[str, list[int], list[int] | None]:
        if index in self._rendered:
            self._rendered.move_to_end(index)
            return self._rendered[index]
        value = raw[self.cfg.input_key]
        if isinstance(value, str) and not self.cfg.apply_chat_template:
            text = value
            ids = self.tokenizer(text)["input_ids"]
        else:
            messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # The template already holds any special tokens: add none.
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = None
        if self.completions:
            completion = list(self.tokenizer(str(raw.get(self.cfg.label_key)), add_special_tokens=False)["input_ids"])
            if self.tokenizer.eos_token_id is not None:
                completion.append(self.tokenizer.eos_token_id)
        self._rendered[index] = (text, list(ids), completion)
        if len(self._rendered) > self.RENDER_CACHE:
            self._rendered.popitem(last=False)
        return self._rendered[index]

    def _over_limit(self, prompt: list[int], completion: list[int] | None) -> str | None:
        """Which limit the row breaks, or None."""
        cfg = self.cfg
        n_completion = len(completion or ())
        if cfg.max_prompt_tokens is not None and len(prompt) > cfg.max_prompt_tokens:
            return f"prompt of {len(prompt)} tokens > max_prompt_tokens {cfg.max_prompt_tokens}"
        if completion is not None and cfg.max_completion_tokens is not None and n_completion > cfg.max_completion_tokens:
            return f"completion of {n_completion} tokens > max_completion_tokens {cfg.max_completion_tokens}"
        if cfg.max_sample_tokens is not None and len(prompt) + n_completion > cfg.max_sample_tokens:
            return f"sample of {len(prompt) + n_completion} tokens > max_sample_tokens {cfg.max_sample_tokens}"
        return None

    def _row(self, index: int, epoch: int, serial: int) -> PromptRow | None:
        """The row, or None when it breaks a length limit (then recorded in _too_long)."""
        raw = self._rows[index]
        text, ids, completion = self._render(index, raw)
        problem = self._over_limit(ids, completion)
        if problem is not None:
            self._too_long[index] = problem
            self._rendered.pop(index, None)
            return None
        meta = raw.get(self.cfg.metadata_key) if self.cfg.metadata_key else None
        row = PromptRow(
            index=index,
            epoch=epoch,
            prompt=raw[self.cfg.input_key],
            prompt_text=text,
            input_ids=ids,
            label=raw.get(self.cfg.label_key) if self.cfg.label_key else None,
            metadata=meta,
            completion_ids=completion,
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

    def _next_fresh(self) -> tuple[int, int] | None:
        """The next fresh (index, epoch) not known to be too long; None when the data is used up."""
        while self._fresh_left() and self.unusable is None:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._order_for(self._epoch)
            index = self._order[self._position]
            self._position += 1
            if index not in self._too_long:
                return index, self._epoch
        return None  # used up, or every row is too long (another epoch would find none either)

    def take(self) -> PromptRow | None:
        """The next prompt: a re-queued one first, else the next fresh one within the length limits;
        None when the data is used up or no row fits (rows may still be pending: see status())."""
        while True:
            if self._requeued:
                index, epoch = self._requeued.popleft()
            else:
                nxt = self._next_fresh()
                if nxt is None:
                    return None
                index, epoch = nxt
            self._serial += 1
            row = self._row(index, epoch, self._serial)
            if row is not None:
                self._outstanding[self._serial] = (index, epoch)
                return row

    @property
    def unusable(self) -> str | None:
        """Why no row of the file can be served (every row breaks a length limit), or None."""
        if len(self._rows) and len(self._too_long) == len(self._rows):
            example = next(iter(self._too_long.values()))
            return (f"no usable rows: all {len(self._rows)} rows of {Path(self.cfg.path).name} are over a length limit "
                    f"(e.g. {example})")
        return None

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

    def drop(self, row: PromptRow) -> None:
        """The row's group was dropped for good (its rollout failed: rollout/worker.py): never served again
        this epoch, not counted as consumed. A row that fails every time cannot keep a run from ending."""
        self._pop_outstanding(row)

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
        unusable = self.unusable
        return DataStatus(
            rows=len(self._rows),
            epoch=self._epoch,
            position=self._position,
            pending=pending,
            consumed=self._consumed,
            # Data that cannot be used is not used up: such a run must fail (unusable says why), not complete.
            exhausted=unusable is None and not self._fresh_left() and pending == 0,
            skipped_too_long=len(self._too_long),
            skipped_oversized=self._rows.oversized,
            unusable=unusable,
        )
