"""Latest-wins publishing in trainer/export/export_writer.py (issue 28): a queued, unwritten export of a
key is superseded by a newer one of the same key. Checked on the writer alone (no model): which
folders are written and in what order, what each waiter gets, that a job being written is never
superseded, that superseding frees room under the memory bound, and that every job's release
runs exactly once. Every check waits on a condition the writer exposes, never on time."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from tests.trainer_probes import hold_writer
from tests.waiting import wait_until
from trainer.export.export_writer import ExportWriter, Superseded

pytestmark = pytest.mark.unit

DEADLINE_S = 30.0


def _recorder(gate: threading.Event | None = None):
    written: list[str] = []
    started: list[str] = []

    def write(folder: str, payload) -> None:
        started.append(folder)
        if gate is not None and payload == "gated":
            gate.wait(DEADLINE_S)
        written.append(folder)

    return written, started, write


def test_a_burst_of_one_key_writes_only_the_newest_and_the_others_learn_they_were_superseded():
    written, _, write = _recorder()
    released = Counter()
    w = ExportWriter(write)
    hold_writer(w, True)
    early = {}
    waiter = threading.Thread(target=lambda: early.setdefault("a-v1", w.wait("a-v1")))
    waiter.start()  # waits before a-v1 is submitted
    for folder, key in (("a-v1", "a"), ("b-v1", "b"), ("a-v2", "a"), ("plain-1", None), ("a-v3", "a"), ("plain-2", None)):
        w.submit(folder, folder, nbytes=1, key=key, release=lambda f=folder: released.update([f]))
    assert w.pending() == 4 and w.superseded == 2  # a-v1 and a-v2 left the queue at once
    assert released == Counter({"a-v1": 1, "a-v2": 1})  # their memory went back before any write
    hold_writer(w, False)
    assert w.wait("a-v3") == "a-v3" and w.wait("b-v1") == "b-v1"
    assert w.wait("plain-1") == "plain-1" and w.wait("plain-2") == "plain-2"
    assert w.wait("a-v2") == Superseded("a-v2", by="a-v3")
    waiter.join(DEADLINE_S)
    assert early == {"a-v1": Superseded("a-v1", by="a-v2")}  # not an error: wait returned
    assert written == ["b-v1", "plain-1", "a-v3", "plain-2"]  # submission order of what is left
    assert released == Counter({f: 1 for f in ("a-v1", "a-v2", "a-v3", "b-v1", "plain-1", "plain-2")})


def test_a_job_being_written_is_never_superseded_and_keyless_jobs_never_are():
    gate = threading.Event()
    written, started, write = _recorder(gate)
    w = ExportWriter(write)
    w.submit("v1", "gated", nbytes=1, key="a")
    wait_until(lambda: started == ["v1"], "v1 to start writing", DEADLINE_S)
    w.submit("v2", "v2", nbytes=1, key="a")  # queued behind v1
    w.submit("k1", "k1", nbytes=1)
    w.submit("k2", "k2", nbytes=1)  # no key: both stay
    w.submit("v3", "v3", nbytes=1, key="a")  # supersedes the queued v2, not v1 (being written)
    assert w.superseded == 1
    gate.set()
    assert [w.wait(f) for f in ("v1", "k1", "k2", "v3")] == ["v1", "k1", "k2", "v3"]
    assert w.wait("v2") == Superseded("v2", by="v3")
    assert written == ["v1", "k1", "k2", "v3"]


def test_superseding_frees_room_under_the_bound_before_the_newer_snapshot_is_counted():
    written, _, write = _recorder()
    w = ExportWriter(write, max_pending_bytes=100)
    hold_writer(w, True)
    w.submit("a-v1", "a-v1", nbytes=60, key="a")
    w.submit("a-v2", "a-v2", nbytes=60, key="a")  # 60 + 60 > 100, but a-v1 is gone first: no wait
    assert w.room_waiters == 0 and w.pending() == 1
    blocked = threading.Thread(target=lambda: w.submit("b-v1", "b-v1", nbytes=60, key="b"))
    blocked.start()  # another key: it must wait for room like any snapshot
    wait_until(lambda: w.room_waiters == 1, "b-v1 to wait for room", DEADLINE_S)
    # an explicit supersede (what the trainer calls before it takes host memory) makes the room
    assert w.supersede("a", by="a-v3") == ["a-v2"]
    blocked.join(DEADLINE_S)
    assert not blocked.is_alive() and w.pending() == 1
    hold_writer(w, False)
    assert w.wait("b-v1") == "b-v1" and w.wait("a-v2") == Superseded("a-v2", by="a-v3")
    assert w.wait("a-v1") == Superseded("a-v1", by="a-v2")
    assert written == ["b-v1"]


def test_a_failed_write_is_an_error_and_a_superseded_one_is_not():
    def write(folder: str, payload) -> None:
        raise OSError(f"cannot write {folder}")

    w = ExportWriter(write)
    hold_writer(w, True)
    w.submit("v1", "x", nbytes=1, key="a")
    w.submit("v2", "x", nbytes=1, key="a")
    hold_writer(w, False)
    assert isinstance(w.wait("v1"), Superseded)
    with pytest.raises(OSError, match="cannot write v2"):
        w.wait("v2")
