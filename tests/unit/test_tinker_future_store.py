"""The Tinker futures' memory bound (api/tinker/futures.py FutureStore._trim), over real records (SQLite):
finished futures leave memory oldest first once the entries pass `keep` by an eighth, pending ones never
do, and a finished one that left is still answered from the records."""

from __future__ import annotations

import asyncio

from api.tinker.futures import FutureStore, user_error
from service.registry.tinker_records import TinkerRecords

KEEP = 16


def test_finished_futures_leave_oldest_first_pending_never_and_the_records_still_answer(tmp_path):
    async def scenario() -> None:
        store = FutureStore(TinkerRecords(tmp_path / "records.sqlite"), poll_s=0.01, keep=KEEP)
        made, pending = [], set()
        for i in range(200):
            rid = store.create("alice", "m-1")
            made.append(rid)
            if i % 10 == 0:
                pending.add(rid)  # never resolved: a call waiting for its slot
            else:
                store.resolve(rid, user_error(f"call {i}"))
            kept = [r for r in made if store.entry(r) is not None]
            assert pending <= set(kept), "a pending future left memory"
            assert len(kept) <= KEEP + KEEP // 8 + len(pending), (i, len(kept))
        kept = [r for r in made if store.entry(r) is not None]
        finished_kept = [r for r in kept if r not in pending]
        finished = [r for r in made if r not in pending]
        assert finished_kept == finished[len(finished) - len(finished_kept):], "not the oldest finished that left"
        assert len(kept) > KEEP  # the bound is reached, not undercut: no scan at every create
        await store.durable()
        gone = finished[0]
        assert store.entry(gone) is None
        outcome = await store.retrieve("alice", gone)  # from the records
        assert outcome is not None and outcome.json["error"] == "call 1"
        assert await store.retrieve("alice", sorted(pending)[0]) is None  # still running: try again

    asyncio.run(scenario())


def test_a_cancel_tells_the_model_of_the_call_once(tmp_path):
    """A cancelled call's model is told (`on_cancel`: the scheduler's wait index looks at it again,
    service/scheduling/wait_index.py); a cancel of a finished call, or of a call with no model, is not."""
    async def scenario() -> None:
        store = FutureStore(TinkerRecords(tmp_path / "records.sqlite"), poll_s=0.01)
        told: list[str] = []
        store.on_cancel = told.append
        waiting, finished, modelless = store.create("alice", "m-1"), store.create("alice", "m-2"), store.create("alice", None)
        store.resolve(finished, user_error("done"))
        assert store.cancel("alice", waiting) and not store.cancel("alice", finished) and store.cancel("alice", modelless)
        assert not store.cancel("alice", waiting)  # already answered
        assert told == ["m-1"]

    asyncio.run(scenario())
