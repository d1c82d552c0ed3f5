"""Parquet data is streamed (issue 14 item 2): rows are checked in record batches at open and
read back by row group when taken, at most two row groups held; indices, order and cursors are
those of the whole-file reading, so a checkpointed cursor resumes exactly.

The independent reference is pyarrow's own whole-file read (``pq.read_table(...).to_pylist()``)
and the same rows as JSONL (streamed by line offsets since before)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.config import DataConfig
from rollout.data import DataError, DataSource, _ParquetRows
from tests.unit.test_rollout_data import rows, take_all, tokenizer, write_jsonl  # noqa: F401 (fixture)

pytestmark = pytest.mark.unit

N, GROUP = 37, 5  # 8 row groups, the last one short


def _files(tmp_path, n=N):
    data = rows(n)
    ppath = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(data), ppath, row_group_size=GROUP)
    assert pq.ParquetFile(ppath).metadata.num_row_groups == -(-n // GROUP)
    return data, str(ppath), write_jsonl(tmp_path / "d.jsonl", data)


def _key(r):
    return (r.index, r.epoch, r.prompt, r.label, r.metadata, r.input_ids)


def test_rows_by_index_equal_the_whole_file_read_and_few_groups_are_held(tmp_path, tokenizer):
    _, ppath, _ = _files(tmp_path)
    whole = pq.read_table(ppath).to_pylist()
    streamed = _ParquetRows(pq_path := __import__("pathlib").Path(ppath), DataConfig(path=ppath))
    assert len(streamed) == N and pq_path.is_file()
    for i in [0, 36, 5, 4, 17, 33, 1, 20, 36, 0]:  # across row groups, back and forth
        assert streamed[i] == {k: whole[i][k] for k in ("prompt", "label", "metadata")}, i
        assert len(streamed._groups) <= _ParquetRows.CACHED_GROUPS
    with pytest.raises(IndexError):
        streamed[N]


def test_shuffled_epochs_match_jsonl_and_a_cursor_resumes_exactly(tmp_path, tokenizer):
    _, ppath, jpath = _files(tmp_path)
    cfg = dict(shuffle_seed=7, num_epochs=2)
    want = [_key(r) for r in take_all(DataSource(DataConfig(path=jpath, **cfg), tokenizer), 2 * N + 1)]
    src = DataSource(DataConfig(path=ppath, **cfg), tokenizer)
    got = take_all(src, 2 * N + 1)
    assert [_key(r) for r in got] == want and len(want) == 2 * N  # two epochs, then used up

    interrupted = DataSource(DataConfig(path=ppath, **cfg), tokenizer)
    first = take_all(interrupted, 30)
    for r in first[:26]:
        interrupted.consume(r)
    interrupted.requeue(first[27])  # given back; 26, 28, 29 still out
    resumed = DataSource(DataConfig(path=ppath, **cfg), tokenizer, cursor=interrupted.cursor())
    again = [_key(r) for r in take_all(resumed, 2 * N)]
    # the rows not consumed come first (taken ones in take order, then the given-back one) ...
    assert again[:4] == [want[26], want[28], want[29], want[27]]
    # ... then exactly where the uninterrupted order stood
    assert again[4:] == want[30:]


def test_a_bad_row_in_a_later_row_group_is_refused_naming_it(tmp_path, tokenizer):
    data = rows(12)
    data[11] = {"prompt": 5, "label": "x", "metadata": None}
    path = tmp_path / "bad.parquet"
    table = pa.Table.from_pylist([{**r, "prompt": str(r["prompt"]) if i != 11 else None} for i, r in enumerate(data)])
    pq.write_table(table, path, row_group_size=4)
    with pytest.raises(DataError, match=r"bad.parquet, row 11: 'prompt' must be a string"):
        DataSource(DataConfig(path=str(path)), tokenizer)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        DataSource(DataConfig(path=str(tmp_path / "junk.parquet")), tokenizer)
