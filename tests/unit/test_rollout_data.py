"""Data sources: formats, refusals naming file and key, deterministic order, cursor resume, epochs."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.config import DataConfig
from rollout.data import DataCursor, DataError, DataSource

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_world / "model")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows(n):
    return [{"prompt": f"p{i} ab 12", "label": "0123456789", "metadata": {"i": i}} for i in range(n)]


def take_all(src, k):
    out = []
    for _ in range(k):
        r = src.take()
        if r is None:
            break
        out.append(r)
    return out


def test_jsonl_rows_render_and_tokenize(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    src = DataSource(DataConfig(path=path, shuffle_seed=None), tokenizer)
    r = src.take()
    assert r.index == 0 and r.epoch == 0 and r.label == "0123456789" and r.metadata == {"i": 0}
    assert r.prompt_text == "<|user|>p0 ab 12\n<|assistant|>"
    assert r.input_ids == tokenizer(r.prompt_text, add_special_tokens=False)["input_ids"]
    plain = DataSource(DataConfig(path=path, shuffle_seed=None, apply_chat_template=False), tokenizer).take()
    assert plain.prompt_text == "p0 ab 12"


def test_message_list_uses_chat_template(tmp_path, tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": msgs, "label": "x"}])
    r = DataSource(DataConfig(path=path, apply_chat_template=False), tokenizer).take()
    assert r.prompt_text == "<|system|>be brief\n<|user|>ab\n<|assistant|>"


def test_parquet_matches_jsonl(tmp_path, tokenizer):
    data = rows(5)
    jpath = write_jsonl(tmp_path / "d.jsonl", data)
    ppath = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(data), ppath)
    a = take_all(DataSource(DataConfig(path=jpath, shuffle_seed=3), tokenizer), 5)
    b = take_all(DataSource(DataConfig(path=str(ppath), shuffle_seed=3), tokenizer), 5)
    assert [(r.index, r.prompt, r.label, r.metadata) for r in a] == [(r.index, r.prompt, r.label, r.metadata) for r in b]


@pytest.mark.parametrize(
    "content, cfg_kw, message",
    [
        ('{"prompt": "a", "label": "b"}\n{"label": "c"}\n', {}, "line 2: missing input key 'prompt'"),
        ('{"prompt": "a"}\n', {}, "line 1: missing label key 'label'"),
        ('{"q": "a", "label": "b"}\n', {"input_key": "question"}, "missing input key 'question'"),
        ('{"prompt": "a", "label": "b"}\nnot json\n', {}, "line 2: not valid JSON"),
        ('[1, 2]\n', {}, "line 1: expected a JSON object"),
        ('{"prompt": 5, "label": "b"}\n', {}, "'prompt' must be a string or a list"),
        ('{"prompt": "a", "label": "b", "metadata": 3}\n', {}, "metadata key 'metadata' must hold an object"),
        ("\n", {}, "has no rows"),
    ],
)
def test_bad_files_are_refused_naming_file_and_key(tmp_path, tokenizer, content, cfg_kw, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        DataSource(DataConfig(path=str(path), **cfg_kw), tokenizer)
    assert message in str(e.value) and str(path) in str(e.value)


def test_missing_file_and_parquet_column(tmp_path, tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        DataSource(DataConfig(path=str(tmp_path / "nope.jsonl")), tokenizer)
    ppath = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a", "label": "b"}]), ppath)
    with pytest.raises(DataError, match=r"no column 'prompt'; columns: \['text', 'label'\]"):
        DataSource(DataConfig(path=str(ppath)), tokenizer)


def test_suffix_is_checked_by_config():
    with pytest.raises(ValueError, match="must end in .jsonl or .parquet"):
        DataConfig(path="data.csv")


def test_shuffle_is_deterministic_and_differs_per_epoch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(20))
    def order(seed):
        src = DataSource(DataConfig(path=path, shuffle_seed=seed), tokenizer)
        return [r.index for r in take_all(src, 40)]
    o1, o2, o3 = order(7), order(7), order(8)
    assert o1 == o2 and o1 != o3
    assert sorted(o1[:20]) == list(range(20)) and sorted(o1[20:]) == list(range(20))
    assert o1[:20] != o1[20:]  # a new permutation each epoch
    assert [r.index for r in take_all(DataSource(DataConfig(path=path, shuffle_seed=None), tokenizer), 20)] == list(range(20))


def test_resume_from_cursor_gives_the_same_order(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    cfg = DataConfig(path=path, shuffle_seed=5)
    reference = DataSource(cfg, tokenizer)
    ref_order = []
    for r in take_all(reference, 25):
        reference.consume(r)
        ref_order.append((r.index, r.epoch))

    src = DataSource(cfg, tokenizer)
    got = []
    taken = take_all(src, 13)
    for r in taken[:10]:
        src.consume(r)
        got.append((r.index, r.epoch))
    # 3 rows taken but not consumed (in flight / buffered when the checkpoint is taken)
    cursor = DataCursor.model_validate_json(src.cursor().model_dump_json())
    assert cursor.pending == [(r.index, r.epoch) for r in taken[10:]]
    resumed = DataSource(cfg, tokenizer, cursor)
    for r in take_all(resumed, 15):
        resumed.consume(r)
        got.append((r.index, r.epoch))
    assert got == ref_order
    assert resumed.status().consumed == 25


def test_requeued_rows_come_back_first_and_do_not_count(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    src = DataSource(DataConfig(path=path, shuffle_seed=None), tokenizer)
    a, b = src.take(), src.take()
    src.requeue(b)
    assert src.status().consumed == 0 and src.status().pending == 2
    again = src.take()
    assert (again.index, again.epoch) == (b.index, b.epoch)
    src.consume(again)
    with pytest.raises(ValueError, match="already consumed"):
        src.consume(again)
    assert src.status().consumed == 1


def test_epochs_and_exhaustion(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3))
    src = DataSource(DataConfig(path=path, num_epochs=2, shuffle_seed=1), tokenizer)
    taken = take_all(src, 10)
    assert len(taken) == 6 and [r.epoch for r in taken] == [0, 0, 0, 1, 1, 1]
    st = src.status()
    assert st.epoch == 1 and not st.exhausted and st.pending == 6  # nothing consumed yet
    src.requeue(taken[-1])
    again = src.take()  # re-queued rows are served even after the last epoch
    assert again.index == taken[-1].index and src.take() is None
    for r in taken[:-1]:
        src.consume(r)
    assert not src.status().exhausted  # one row still pending
    src.consume(again)
    st = src.status()
    assert st.exhausted and st.consumed == 6 and st.pending == 0


# --- length limits and bounded reading (issue 14 F1, F4) ---------------------------------------------


def test_rows_over_a_token_limit_are_skipped_counted_and_never_served(tmp_path, tokenizer):
    data = rows(6)
    data[1]["prompt"] = data[4]["prompt"] = "ab 12 " * 200  # far over 40 tokens
    path = write_jsonl(tmp_path / "d.jsonl", data)
    limited = DataSource(DataConfig(path=path, shuffle_seed=None, num_epochs=2, max_prompt_tokens=40), tokenizer)
    taken = take_all(limited, 20)
    assert [(r.index, r.epoch) for r in taken] == [(i, e) for e in (0, 1) for i in (0, 2, 3, 5)]
    assert all(len(r.input_ids) <= 40 for r in taken)
    st = limited.status()
    assert (st.skipped_too_long, st.unusable, st.skip_metrics()["rows_skipped_too_long"]) == (2, None, 2.0)
    # The same order as an unlimited source, minus the two long rows; the cursor resumes it exactly.
    unlimited = [r.index for r in take_all(DataSource(DataConfig(path=path, shuffle_seed=None), tokenizer), 6)]
    assert [i for i in unlimited if i not in (1, 4)] == [r.index for r in taken[:4]]


def test_a_source_whose_every_row_is_too_long_is_unusable_and_serves_nothing(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x " * 5000, "label": "y"} for _ in range(3)])
    src = DataSource(DataConfig(path=path, num_epochs=None, max_sample_tokens=100), tokenizer)  # endless epochs: must not spin
    assert src.take() is None and src.take() is None
    st = src.status()
    assert st.unusable.startswith("no usable rows: all 3 rows of long.jsonl are over a length limit (e.g. sample of ")
    assert st.skipped_too_long == 3 and not st.exhausted  # not used up: the run must fail, not complete


def test_completion_sources_measure_the_completion_with_eos(tmp_path, tokenizer):
    data = [{"prompt": "ab", "completion": "cd 12"}, {"prompt": "ab", "completion": "cd 12 " * 50}]
    path = write_jsonl(tmp_path / "sft.jsonl", data)
    cfg = DataConfig(path=path, label_key="completion", shuffle_seed=None, num_epochs=1, max_completion_tokens=20)
    src = DataSource(cfg, tokenizer, completions=True)
    row = src.take()
    assert row.completion_ids == tokenizer("cd 12", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert src.take() is None and src.status().skipped_too_long == 1


def test_lines_over_max_row_bytes_are_skipped_without_loading_them(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    good = [json.dumps(r) + "\n" for r in rows(3)]
    path.write_text(good[0] + json.dumps({"prompt": "x" * (4 << 20), "label": "y"}) + "\n" + good[1] + "\n" + good[2])
    import tracemalloc

    tracemalloc.start()
    src = DataSource(DataConfig(path=str(path), shuffle_seed=None, num_epochs=1, max_row_bytes=4096), tokenizer)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (2 << 20), f"opening held {peak} bytes: the 4 MiB line was loaded"
    assert [(r.index, r.prompt) for r in take_all(src, 5)] == [(0, "p0 ab 12"), (1, "p1 ab 12"), (2, "p2 ab 12")]
    assert src.status().skipped_oversized == 1 and src.status().skip_metrics()["rows_skipped_oversized"] == 1.0
    with pytest.raises(DataError, match=r"every line \(1\) is longer than the 4096 bytes a row may have"):
        DataSource(DataConfig(path=write_jsonl(tmp_path / "all_big.jsonl", [{"prompt": "x" * 5000, "label": "y"}]), max_row_bytes=4096), tokenizer)
