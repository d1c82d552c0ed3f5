"""Checkpoint folders (atomic commit, lookup, pruning, refusals), SFT sources (whole steps,
exact resume from a cursor) and the batch-mode summary (reward start/end windows)."""

from __future__ import annotations

import json
import re
import time

import pytest

from trainer.storage import layouts
from trainer.storage.local_store import LocalStore
from trainer.storage.run_checkpoints import (
    CheckpointError,
    PendingCheckpoint,
    RunState,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    write_checkpoint,
)
from trainer.storage.store import MANIFEST

pytestmark = pytest.mark.unit

CKPTS = layouts.run_checkpoints("a", "r1")


def _state(step: int, **over) -> RunState:
    return RunState(name="a", registration_id="r1", objective="sft", rank=4, step=step, samples_trained=4 * step,
                    data_cursor={"epoch": 0, "position": 4 * step, "pending": [], "consumed": 4 * step}, **over)


def _part(store, key: str, text: str) -> None:
    """What the trainer's rank 0 does for a checkpoint's part: a folder committed in the store."""
    with store.write_folder(key) as d:
        (d / "x").write_text(text)


def _write(store, step: int) -> None:
    with PendingCheckpoint(store, "a", "r1", step) as p:
        _part(store, p.adapter_key, str(step))
        _part(store, p.trainer_key, str(step))
        p.commit(_state(step))


def test_commit_is_atomic_and_lookup_finds_the_newest(tmp_path):
    store = LocalStore(tmp_path)
    _write(store, 3)
    _write(store, 6)
    # a crash mid-write: what was written goes, and lookups never see it
    with pytest.raises(RuntimeError):
        with PendingCheckpoint(store, "a", "r1", 9) as p:
            _part(store, p.adapter_key, "9")
            raise RuntimeError("killed")
    assert not (tmp_path / CKPTS / "step-000009").exists()
    # left by a SIGKILL: both parts committed, the step folder never was (no manifest of its own)
    _part(store, f"{CKPTS}/step-000012/adapter", "12")
    _part(store, f"{CKPTS}/step-000012/trainer", "12")
    (tmp_path / CKPTS / "step-000012" / "run_state.json").write_text("{}")
    assert latest_checkpoint(store, CKPTS).endswith("step-000006")
    run_dir = tmp_path / layouts.run_prefix("a", "r1")
    for where in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "step-000006"):
        ck = load_checkpoint(store, where)
        assert ck.state.step == 6 and ck.state.data_cursor["consumed"] == 24
        assert (store.get_folder(ck.adapter_key) / "x").read_text() == "6"
    assert load_checkpoint(store, tmp_path / CKPTS / "step-000003").state.step == 3


def _parts(calls: list):
    def write_parts(p: PendingCheckpoint) -> None:
        calls.append(p.step)
        _part(p.store, p.adapter_key, "a")
        _part(p.store, p.trainer_key, "t")
    return write_parts


class Killed(Exception):
    """Stands in for a kill -9 of the service while it writes a checkpoint's parts (the fault itself is
    tests/integration/test_service_scale.py's kill -9; here only its effect: the step's folder gone)."""


def _crash(p: PendingCheckpoint) -> None:
    raise Killed("killed mid-write (stand-in)")


def test_an_unchanged_runs_checkpoint_is_kept_and_a_changed_one_rewritten(tmp_path):
    """A run checkpointed at step 4 and checkpointed again with the same state (its final checkpoint
    right after its last periodic one) keeps the committed folder: nothing is deleted or written, so a
    crash then loses nothing. A changed state at the same step is written anew."""
    store = LocalStore(tmp_path)
    calls: list = []

    def same(a: RunState, b: RunState) -> bool:
        return a.model_dump(exclude={"created_at"}) == b.model_dump(exclude={"created_at"})

    first = write_checkpoint(store, _state(4), _parts(calls))
    assert calls == [4] and same(load_checkpoint(store, first.folder).state, _state(4))
    again = write_checkpoint(store, _state(4), _crash)  # the same state: the crash stand-in is never reached
    assert again.folder == first.folder and again.state == first.state == load_checkpoint(store, first.folder).state
    changed = _state(4, metrics={"loss": 1.5})
    with pytest.raises(Killed):  # a changed state is rewritten: a crash mid-write loses that write
        write_checkpoint(store, changed, _crash)
    assert same(write_checkpoint(store, changed, _parts(calls)).state, changed) and calls == [4, 4]
    assert same(load_checkpoint(store, first.folder).state, changed)


def test_commit_refuses_incomplete_or_mismatched(tmp_path):
    store = LocalStore(tmp_path)
    with PendingCheckpoint(store, "a", "r1", 2) as p:
        _part(store, p.adapter_key, "1")
        with pytest.raises(CheckpointError, match="trainer/ was not written"):
            p.commit(_state(2))
        _part(store, p.trainer_key, "1")
        with pytest.raises(ValueError, match="for step 2, run state says step 5"):
            p.commit(_state(5))
    assert latest_checkpoint(store, CKPTS) is None


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda d: (d / "run_state.json").write_text(json.dumps({"format": "other-v9"})), "run_state.json does not match its manifest"),
        (lambda d: (d / MANIFEST).unlink(), "is not a lorafleet checkpoint"),
        (lambda d: (d / "trainer" / MANIFEST).unlink(), "its sub-folders ['trainer'] are not committed"),
        (lambda d: (d / "trainer" / "x").write_text("flipped"), None),  # the trainer verifies its own part when it loads it
    ],
)
def test_load_refuses_broken_checkpoints(tmp_path, mutate, expected):
    store = LocalStore(tmp_path)
    _write(store, 1)
    folder = tmp_path / CKPTS / "step-000001"
    mutate(folder)
    if expected is None:
        ck = load_checkpoint(store, folder)
        with pytest.raises(ValueError, match="x does not match its manifest"):
            store.get_folder(ck.trainer_key)
        return
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load_checkpoint(store, folder)


def test_a_folder_written_before_the_store_still_loads(tmp_path):
    """No manifests (an upgrade from a version without the store): complete when run_state.json,
    adapter/ and trainer/ are there; a wrong format is still refused."""
    store = LocalStore(tmp_path)
    folder = tmp_path / CKPTS / "step-000004"
    for sub in ("adapter", "trainer"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "x").write_text("4")
    (folder / "run_state.json").write_text(json.dumps(_state(4).model_dump(mode="json")))
    assert load_checkpoint(store, tmp_path / layouts.run_prefix("a", "r1")).state.step == 4
    (folder / "run_state.json").write_text(json.dumps({"format": "other-v9"}))
    with pytest.raises(CheckpointError, match="format 'other-v9' is not 'lorafleet-checkpoint-v1'"):
        load_checkpoint(store, folder)


def test_load_refuses_a_folder_without_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="is not a lorafleet checkpoint"):
        load_checkpoint(LocalStore(tmp_path), tmp_path)


def test_prune_keeps_the_newest(tmp_path):
    store = LocalStore(tmp_path)
    for step in (1, 2, 3, 4):
        _write(store, step)
    _part(store, f"{CKPTS}/step-000002x/adapter", "left by a crash")  # never completed, older than the newest
    (tmp_path / CKPTS / "step-000002x").rename(tmp_path / CKPTS / "step-0000025")
    gone = prune_checkpoints(store, CKPTS, keep=2)
    assert sorted(k.rsplit("/", 1)[-1] for k in gone) == ["step-000001", "step-000002", "step-0000025"]
    assert sorted(p.name for p in (tmp_path / CKPTS).iterdir()) == ["step-000003", "step-000004"]


# --- SFT source -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_world / "model")


def _source(tiny_world, tokenizer, cursor=None, rows_path=None, per_step=3):
    from rollout.config import DataConfig
    from service.tenants.sft_source import SftSource

    cfg = DataConfig(path=str(rows_path or tiny_world / "data" / "echo_sft.jsonl"), label_key="completion", shuffle_seed=5, num_epochs=1)
    return SftSource(cfg, tokenizer, slot=2, registration_id="reg", samples_per_step=per_step, cursor=cursor)


def test_sft_samples_learn_the_completion_and_eos(tiny_world, tokenizer):
    src = _source(tiny_world, tokenizer)
    rows, samples = src.take_step()
    s, row = samples[0], rows[0]
    completion = tokenizer(row.label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert s.tokens == row.input_ids + completion
    assert s.loss_mask == [0] * len(row.input_ids) + [1] * len(completion)
    assert (s.slot, s.registration) == (2, "reg")


def test_sft_resume_from_cursor_gives_the_same_steps(tiny_world, tokenizer):
    a = _source(tiny_world, tokenizer)
    for _ in range(2):
        rows, _ = a.take_step()
        a.commit(rows)
    taken, _ = a.take_step()  # in flight when the checkpoint is written: must come back first
    cursor = a.cursor()
    a.give_back(taken)
    expected = [[x.tokens for x in a.take_step()[1]] for _ in range(3)]
    b = _source(tiny_world, tokenizer, cursor=cursor)
    assert [[x.tokens for x in b.take_step()[1]] for _ in range(3)] == expected


def test_sft_tail_shorter_than_a_step_is_dropped(tiny_world, tokenizer, tmp_path):
    rows_path = tmp_path / "seven.jsonl"
    rows_path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f" c{i}"}) + "\n" for i in range(7)))
    src = _source(tiny_world, tokenizer, rows_path=rows_path, per_step=3)
    for _ in range(2):
        rows, _ = src.take_step()
        src.commit(rows)
    assert not src.exhausted
    assert src.take_step() is None  # 1 row left < 3
    assert src.exhausted


# --- summary ----------------------------------------------------------------------------------


def test_summary_reward_windows():
    from service.config.adapter import AdapterConfig
    from service.loop.progress import summarize
    from service.registry.registry import AdapterRef, AdapterState, StepRecord

    cfg = AdapterConfig(data={"path": "/d/x.jsonl"}, reward={"name": "target_share"})
    ref = AdapterRef("a", "r", AdapterState.COMPLETED, None, 1, cfg, 12, 12, 96, 5, {}, None, "/e", None, None,
                     time.time(), time.time(), time.time(), time.time())
    steps = [StepRecord(i, 8, None, {"reward_mean": 0.1 * i, "loss": 1.0}, 0.0) for i in range(1, 13)]
    s = summarize(ref, steps)
    assert s.reward_start == pytest.approx(0.3)  # mean of steps 1..5
    assert s.reward_end == pytest.approx(1.0)  # mean of steps 8..12
    assert (s.steps, s.total_steps, s.export_path) == (12, 12, "/e")


def test_progress_view_rows_and_rate_and_quiet_without_tty():
    import io

    from rich.console import Console

    from service.config.adapter import AdapterConfig
    from service.loop.progress import ProgressView
    from service.registry.registry import AdapterRef, AdapterState

    cfg = AdapterConfig(data={"path": "/d/x.jsonl"}, reward={"name": "target_share"})

    def ref(step: int, samples: int) -> AdapterRef:
        return AdapterRef("digits", "r", AdapterState.ACTIVE, 0, 1, cfg, 30, step, samples, 5,
                          {"reward_mean": 0.25, "loss": -0.01}, None, None, None, None, 0.0, 0.0, 0.0, None)

    buf = io.StringIO()
    view = ProgressView(Console(file=buf, force_terminal=True, width=100))
    assert view.enabled
    view.render([ref(2, 64)], now=100.0)
    out = io.StringIO()
    Console(file=out, width=100).print(view.render([ref(4, 128)], now=104.0))
    text = out.getvalue()
    assert "digits" in text and "ACTIVE" in text and "4/30" in text and "0.250" in text and "16.0" in text  # 64 samples / 4 s
    quiet = ProgressView(Console(file=io.StringIO(), force_terminal=False))
    assert not quiet.enabled
    with quiet:
        quiet.update([ref(1, 32)])  # nothing drawn, nothing raised
