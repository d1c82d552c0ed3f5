"""trainer/export/export_writer.py on its own (no model, no Ray): order of writes, the memory bound, waits
before the submission, failures, and the all-or-nothing folder. Every check waits on a condition
the writer exposes, never on time."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.trainer_probes import hold_writer
from tests.waiting import wait_until
from trainer.export.export_writer import ExportWriter, remove_partial_writes, replace_folder_atomically

DEADLINE_S = 30.0


def _recorder():
    written: list[str] = []

    def write(folder: str, payload) -> None:
        if payload == "boom":
            raise OSError(f"cannot write {folder}")
        written.append(folder)

    return written, write


def test_writes_in_submission_order_and_wait_may_come_first():
    written, write = _recorder()
    w = ExportWriter(write)
    hold_writer(w, True)
    early = {}
    waiter = threading.Thread(target=lambda: early.setdefault("v1", w.wait("v1")))
    waiter.start()  # waits before v1 is even submitted (the export group may run first)
    for name in ("v1", "v2", "v3"):
        w.submit(name, name, nbytes=1)
    assert written == [] and w.pending() == 3
    hold_writer(w, False)
    assert [w.wait("v3"), w.wait("v2")] == ["v3", "v2"]
    waiter.join(DEADLINE_S)
    assert early == {"v1": "v1"} and written == ["v1", "v2", "v3"]


def test_a_new_snapshot_waits_for_room_within_the_bound():
    written, write = _recorder()
    w = ExportWriter(write, max_pending_bytes=100)
    hold_writer(w, True)
    w.submit("a", "a", nbytes=60)
    blocked = threading.Thread(target=lambda: w.submit("b", "b", nbytes=60))
    blocked.start()
    wait_until(lambda: w.room_waiters == 1, "the second submit to wait for room", DEADLINE_S)
    assert w.pending() == 1  # b is not queued: 60 + 60 > 100 bytes
    hold_writer(w, False)
    blocked.join(DEADLINE_S)
    assert not blocked.is_alive()
    w.wait("a"), w.wait("b")
    assert written == ["a", "b"]
    # one snapshot larger than the whole bound is still admitted when nothing is queued
    w.submit("big", "big", nbytes=1000)
    assert w.wait("big") == "big"


def test_failures_are_raised_by_wait_and_the_writer_goes_on():
    written, write = _recorder()
    w = ExportWriter(write)
    w.submit("bad", "boom", nbytes=1)
    with pytest.raises(OSError, match="cannot write bad"):
        w.wait("bad")
    w.fail("never-queued", RuntimeError("slot 3 is not initialized"))
    with pytest.raises(RuntimeError, match="slot 3"):
        w.wait("never-queued")
    w.submit("good", "good", nbytes=1)
    assert w.wait("good") == "good" and written == ["good"]
    with pytest.raises(ValueError, match="already queued"):
        hold_writer(w, True)
        w.submit("twice", "x", nbytes=1)
        w.submit("twice", "x", nbytes=1)
    hold_writer(w, False)


def test_folder_appears_whole_or_not_at_all(tmp_path: Path):
    def write_two(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a").write_text("1")
        (tmp / "b").write_text("2")

    dest = replace_folder_atomically(write_two, tmp_path / "h" / "v1")
    assert sorted(p.name for p in dest.iterdir()) == ["a", "b"]

    def half_then_fail(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a").write_text("1")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_folder_atomically(half_then_fail, tmp_path / "h" / "v2")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["v1"]  # no v2, no temporary


def test_partial_writes_of_a_killed_writer_are_removed(tmp_path: Path, monkeypatch):
    """Named fault: a writer process killed mid-write. Stood for by a write that raises SystemExit
    while rmtree does nothing (a dead process cleans nothing up); then the publish's failure path
    (rollout.engines.weights.PendingFolder.ready) calls remove_partial_writes."""
    import shutil

    def killed_midway(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a").write_text("1")
        raise SystemExit

    real_rmtree = shutil.rmtree
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(SystemExit):
            replace_folder_atomically(killed_midway, tmp_path / "v1")
    assert shutil.rmtree is real_rmtree
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".v1.writing-")
    (tmp_path / "v10").mkdir()  # another version: not a temporary of v1
    remove_partial_writes(tmp_path / "v1")
    assert [p.name for p in tmp_path.iterdir()] == ["v10"]


def test_several_threads_write_at_once_and_each_wait_gets_its_folder():
    """threads=2: a write that is stuck (its gate closed) does not hold back the next folder, and
    each wait returns its own folder; the memory bound counts both."""
    gate = threading.Event()
    started: list[str] = []
    cond = threading.Condition()

    def write(folder: str, payload) -> None:
        with cond:
            started.append(folder)
            cond.notify_all()
        if payload == "stuck":
            gate.wait(DEADLINE_S)

    w = ExportWriter(write, threads=2, max_pending_bytes=100)
    w.submit("slow", "stuck", nbytes=40)
    with cond:
        cond.wait_for(lambda: started == ["slow"], DEADLINE_S)
    w.submit("fast", "ok", nbytes=40)
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("fast", w.wait("fast")), daemon=True)
    waiter.start()
    waiter.join(DEADLINE_S)  # returns at once unless "fast" waits behind "slow" (one thread)
    try:
        assert got == {"fast": "fast"} and w.pending() == 1  # written while "slow" is still being written
    finally:
        gate.set()
    assert w.wait("slow") == "slow" and w.pending() == 0
    with pytest.raises(ValueError, match="threads must be at least 1"):
        ExportWriter(write, threads=0)
