"""service/registry/tinker_records.py: a registry file written before sessions had their client's
metadata and finish reason, and checkpoints their ``public`` flag, opens with them added (the rows it
holds keep their values; the new columns read as unset), and the records of issue 42's calls work on it:
published checkpoints, sessions with metadata, join_sampling_session's counter across a reopen."""

from __future__ import annotations

import sqlite3
import time

import pytest

from service.registry.tinker_records import TinkerRecords

pytestmark = pytest.mark.unit

# The two tables as the file of commit 06f608d (issue 40) wrote them, written here by hand.
OLD = """
CREATE TABLE tinker_sessions (session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, ended_at REAL);
CREATE TABLE tinker_checkpoints (tenant TEXT NOT NULL, run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL, user_metadata TEXT, PRIMARY KEY (tenant, run_id, kind, name));
CREATE INDEX tinker_checkpoints_expiring ON tinker_checkpoints(expires_at) WHERE expires_at IS NOT NULL;
INSERT INTO tinker_sessions VALUES ('s-old', 'alice', 1.0, NULL);
INSERT INTO tinker_checkpoints VALUES ('alice', 's-old:train:0', 'weights', 'w1', 2.0, NULL, '{"k": "v"}');
"""


def test_an_old_file_gets_the_new_columns_and_keeps_its_rows(tmp_path):
    path = tmp_path / "registry.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD)
    records = TinkerRecords(path)
    try:
        (old,) = records.sessions_of("alice")
        assert (old["session_id"], old["created_at"], old["ended_at"], old["finish_reason"], old["display_name"]) == \
            ("s-old", 1.0, None, None, None)
        (ckpt,) = records.checkpoints("alice")
        assert (ckpt["name"], ckpt["user_metadata"], ckpt["public"]) == ("w1", '{"k": "v"}', 0)
        assert records.live_sessions() == [("s-old", "alice")]

        records.set_checkpoint_public("alice", "s-old:train:0", "weights", "w1", True)
        records.add_session("s-new", "alice", user_metadata={"team": "a"}, display_name="nightly", project_id="p")
        records.add_checkpoint("alice", "s-new:train:0", "weights", "w2", None, None)
        records.end_session("s-old", "errored", "oom")
        records.end_session("s-old", "success", None)  # the first reason stands
        records.flush()
        assert records.published("s-old:train:0", "weights", "w1")["tenant"] == "alice"
        assert records.published("s-new:train:0", "weights", "w2") is None  # not published
        assert records.published_runs() == [("alice", "s-old:train:0")]
        new, old = records.sessions_of("alice")
        assert (new["display_name"], new["project_id"], new["user_metadata"]) == ("nightly", "p", '{"team": "a"}')
        assert (old["finish_reason"], old["finish_detail"]) == ("errored", "oom") and old["ended_at"] >= time.time() - 60
        assert records.session_of("bob", "s-new") is None and records.sessions_of("bob") == []
        assert [records.next_clone("samp-1") for _ in range(2)] == [1, 2]
    finally:
        records.close()
    reopened = TinkerRecords(path)  # a restart: the columns are there, the counter goes on
    try:
        assert reopened.next_clone("samp-1") == 3 and reopened.next_clone("samp-2") == 1
        assert reopened.checkpoints("alice", "s-old:train:0")[0]["public"] == 1
    finally:
        reopened.close()
