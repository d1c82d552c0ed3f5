"""retrieve_futures, the batched poll of tinker 0.38's sampling clients (api/tinker/completions.py Q1-Q5),
over the FutureStore and real records (SQLite): what the SDK's own wire types read from the answers, the
long poll, the cursor and its acknowledgements, ownership, the bound, a restart. The SDK against a live
service: tests/integration/test_tinker_fleet_64.py."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.unit

S1, S2 = ("s-alice", 0), ("s-alice", 3)  # a sampling session and a clone of it (seq_id // 1e9 == 3)


def _store(tmp_path, **kw):
    from api.tinker.futures import FutureStore
    from service.registry.tinker_records import TinkerRecords

    return FutureStore(TinkerRecords(tmp_path / "records.sqlite"), **kw)


def _sdk(answer: dict):
    """The answer as the SDK's poller reads it (tinker.types.FuturesRetrieveResponse)."""
    from tinker.types import FuturesRetrieveResponse

    return FuturesRetrieveResponse.model_validate(answer)


async def _yield(n: int = 20) -> None:
    for _ in range(n):  # let the loop run what is ready (a condition, not a wait for time)
        await asyncio.sleep(0)


def test_the_sdk_request_is_read_and_a_seq_id_names_its_clone():
    from tinker._compat import model_dump  # how the SDK encodes the body (tinker/resources/futures.py)
    from tinker.types.futures_retrieve_request import FuturesRetrieveRequest, SamplingSessionFuturesTarget

    from api.tinker.completions import target_of
    from api.tinker.wire import FuturesRequest

    sdk = FuturesRetrieveRequest(target=SamplingSessionFuturesTarget(sampling_session_id="s-1", cloned_sampler_id=7),
                                 prev_cursor=42, timeout=0, retrieved_request_ids=["a", "b"])
    ours = FuturesRequest.model_validate(model_dump(sdk, exclude_unset=False, exclude_none=True, mode="json"))
    assert (ours.target.sampling_session_id, ours.target.cloned_sampler_id, ours.prev_cursor, ours.timeout,
            ours.retrieved_request_ids) == ("s-1", 7, 42, 0, ["a", "b"])
    long_poll = FuturesRequest.model_validate(model_dump(
        FuturesRetrieveRequest(target=SamplingSessionFuturesTarget(sampling_session_id="s-1")), exclude_unset=False,
        exclude_none=True, mode="json"))
    assert long_poll.timeout is None and long_poll.prev_cursor == 0
    for bad in ({"target": {"type": "training_run", "sampling_session_id": "s"}}, {"target": {"sampling_session_id": "s"}, "prev_cursor": -1},
                {"target": {"sampling_session_id": "s"}, "timeout": -1}):
        with pytest.raises(ValueError):
            FuturesRequest.model_validate(bad)
    assert target_of("s-1", 3_000_000_017) == ("s-1", 3) and target_of("s-1", 5) == ("s-1", 0)
    assert target_of(None, 5) is None and target_of("s-1", None) is None


def test_long_poll_answers_when_a_sample_completes_with_cursor_and_acks(tmp_path):
    from api.tinker.futures import Outcome, user_error

    async def scenario():
        store = _store(tmp_path, poll_s=30.0)
        c = store.completions
        first = await c.poll("alice", S1, 0, 0)  # the SDK's first poll: nothing yet, a cursor of this process
        assert _sdk(first).completions == [] and c.known(first["cursor"])
        r1 = store.create("alice", None, kind="sample", target=S1)
        r2 = store.create("alice", None, kind="sample", target=S1)
        waiting = asyncio.ensure_future(c.poll("alice", S1, first["cursor"], None))  # the long poll
        await _yield()
        assert not waiting.done()  # nothing completed: it waits (up to 30 s)
        store.resolve(r1, Outcome(proto=b"\x01\x02\x03"))
        got = await asyncio.wait_for(waiting, 5)
        sdk = _sdk(got)
        assert [(x.state, x.request_id, x.response_payload_uncompressed_size) for x in sdk.completions] == [("finished", r1, 3)]
        assert got["cursor"] > first["cursor"]
        store.resolve(r2, user_error("bad prompt"))
        again = await c.poll("alice", S1, got["cursor"], None)  # r1 acknowledged: only r2, at once
        assert [(x.state, x.request_id) for x in _sdk(again).completions] == [("failed", r2)]
        assert c.size() == 1  # r1 dropped (acknowledged by the cursor)
        quiet = await c.poll("alice", S1, again["cursor"], 0)  # an ack-only poll
        assert quiet == {"completions": [], "cursor": again["cursor"]} and c.size() == 0
        # a clone is a target of its own; retrieve_future of a result drops its completion (a client without the poller)
        r3 = store.create("alice", None, kind="sample", target=S2)
        store.resolve(r3, Outcome(json={"type": "sample"}))
        assert (await c.poll("alice", S1, quiet["cursor"], 0))["completions"] == []
        assert c.size() == 1
        assert (await store.retrieve("alice", r3)).json == {"type": "sample"} and c.size() == 0
        # named in retrieved_request_ids: dropped before the answer is built
        r4 = store.create("alice", None, kind="sample", target=S2)
        store.resolve(r4, Outcome(json={"type": "sample"}))
        assert (await c.poll("alice", S2, quiet["cursor"], 0, retrieved=[r4]))["completions"] == []
        store.records.close()

    asyncio.run(scenario())


def test_another_tenant_never_sees_nor_acknowledges_a_completion(tmp_path):
    from api.tinker.futures import Outcome

    async def scenario():
        store = _store(tmp_path, poll_s=30.0)
        c = store.completions
        mine = store.create("alice", None, kind="sample", target=S1)
        store.resolve(mine, Outcome(json={"type": "sample"}))
        theirs = await c.poll("bob", S1, 0, 0)  # the same target's name, another tenant's key
        assert theirs["completions"] == []
        await c.poll("bob", S1, 0, 0, retrieved=[mine])  # bob cannot drop alice's completion
        waiting = asyncio.ensure_future(c.poll("bob", S1, theirs["cursor"], None))
        other = store.create("alice", None, kind="sample", target=S1)
        store.resolve(other, Outcome(json={"type": "sample"}))
        await _yield()
        assert not waiting.done()  # alice's completion does not wake bob's poll
        waiting.cancel()
        got = await c.poll("alice", S1, 0, 0)
        assert [x["request_id"] for x in got["completions"]] == [mine, other]
        store.records.close()

    asyncio.run(scenario())


def test_queues_are_bounded_and_forgotten_when_empty(tmp_path):
    from api.tinker.futures import Outcome

    async def scenario():
        store = _store(tmp_path, poll_s=30.0)
        store.completions.max_per_target = 8
        ids = []
        for _ in range(20):
            ids.append(store.create("alice", None, kind="sample", target=S1))
            store.resolve(ids[-1], Outcome(json={"type": "sample"}))
        got = await store.completions.poll("alice", S1, 0, 0)
        assert [x["request_id"] for x in got["completions"]] == ids[-8:]  # the newest 8 kept
        await store.completions.poll("alice", S1, got["cursor"], 0)
        assert store.completions.size() == 0 and store.completions._queues == {}
        store.records.close()

    asyncio.run(scenario())


def test_a_sample_in_flight_at_a_restart_reaches_the_pollers_of_its_tenant(tmp_path):
    """The target of a sample of an earlier process is not recorded: its tenant's pollers that come from
    before the restart (a cursor this process never gave out) are told it failed; its fetch answers 410
    and the SDK sends it again (tests/unit/test_tinker_wire.py: the 410 itself)."""
    from api.tinker.futures import gone

    async def before():
        store = _store(tmp_path, poll_s=30.0)
        rid = store.create("alice", None, kind="sample", target=S1)
        answer = await store.completions.poll("alice", S1, 0, 0)
        await store.durable()
        store.records.close()
        return rid, answer["cursor"]

    rid, old_cursor = asyncio.run(before())

    async def after():
        store = _store(tmp_path, poll_s=30.0)  # the next process over the same records
        assert not store.completions.known(old_cursor)
        row = store.records.future(rid)
        store.adopt(rid, row.tenant, row.model_id)  # what TinkerService.revive does
        store.resolve(rid, gone("the service restarted while this request ran; send it again"))
        assert (await store.completions.poll("bob", ("s-bob", 0), old_cursor, 0))["completions"] == []
        got = await store.completions.poll("alice", S1, old_cursor, None)  # answered at once: the orphan
        assert [(x.state, x.request_id) for x in _sdk(got).completions] == [("failed", rid)]
        assert (await store.completions.poll("alice", S1, got["cursor"], 0))["completions"] == []  # told once per poller
        assert (await store.retrieve("alice", rid)).status == 410 and store.completions.size() == 0
        store.records.close()

    asyncio.run(after())


def test_the_poll_hold_is_at_least_tinkers_and_under_both_sdk_timeouts():
    """POLL_HOLD_S (api/tinker/futures.py): a held poll must answer before the SDK gives up on it, with
    room for the round trip, for retrieve_futures (the session poller's timeout) and retrieve_future
    (a literal in the SDK's _fetch_via_rest, read from its source); the store and the service hold it."""
    import inspect
    import re

    from tinker.lib import api_future_impl, session_futures_poller

    from api.tinker.futures import POLL_HOLD_S
    from api.tinker.service import TinkerService

    (retrieve_timeout,) = re.findall(r"timeout=(\d+)", inspect.getsource(api_future_impl._APIFuture._fetch_via_rest))
    for sdk_timeout in (session_futures_poller._POLL_HTTP_TIMEOUT_SEC, float(retrieve_timeout)):
        assert POLL_HOLD_S + 10 <= sdk_timeout, (POLL_HOLD_S, sdk_timeout)
    assert POLL_HOLD_S >= 30  # at least Tinker's own hold (session_futures_poller: "The server long-polls up to ~30s")
    assert inspect.signature(TinkerService).parameters["poll_s"].default == POLL_HOLD_S


def test_a_pending_retrieve_is_held_for_the_hold_and_answers_at_once_when_done(tmp_path):
    async def go():
        store = _store(tmp_path)
        from api.tinker.futures import POLL_HOLD_S, Outcome

        assert store.poll_s == POLL_HOLD_S and store.completions.long_poll_s == POLL_HOLD_S
        store.poll_s = 0.05  # a pending one answers try again (None) after the hold
        rid = store.create("alice", "m1")
        assert await store.retrieve("alice", rid) is None
        store.poll_s = POLL_HOLD_S
        held = asyncio.ensure_future(store.retrieve("alice", rid))
        await asyncio.sleep(0)
        store.resolve(rid, Outcome(json={"ok": 1}))
        assert (await asyncio.wait_for(held, 5)).json == {"ok": 1}
        store.records.close()

    asyncio.run(go())
