"""The registry's views (service/registry/views.py) against the full records they summarize.

Real SQLite. Each view is checked against what it must equal when computed the slow way from
the registry's own complete reads (`list()`, `live()`: every ref built): pages concatenated are the
filtered list, counts are counts of refs, the loop's reads are the refs it used to build. A mix of
states, owners, slots, queued, evicted and re-registered names makes the cases differ.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from service.config.adapter import AdapterConfig
from service.errors import BadValue, QuotaExceeded
from service.registry.registry import AdapterState as S
from service.registry.registry import Registry
from service.registry.views import ListQuery, RunQuota

pytestmark = pytest.mark.unit

CONFIG = AdapterConfig.model_validate({"objective": "sft", "data": {"path": "/data/x.jsonl"}, "num_step": 3})
OWNERS = (None, "alice", "bob")


@pytest.fixture
def reg(tmp_path):
    """A registry of 3 slots and 40 names: 3 resident, the rest queued; some ACTIVE, some evicted,
    some ended, two names registered twice."""
    r = Registry(tmp_path / "reg.sqlite", num_slots=3)
    refs = [r.register(f"{'aB'[i % 2]}-run{i:02d}", CONFIG, total_steps=3, owner=OWNERS[i % 3]) for i in range(40)]
    for ref in refs[:3]:  # resident: trained, one step each
        r.mark_prepared(ref.registration_id, weight_version=r.next_version())
        r.record_step(ref.registration_id, step=1, samples=4, metrics={"loss": 1.0})
    r.release_slot(refs[0].registration_id, expect_slot=0)  # evicted: back in the queue, trained
    r.bind(refs[3].registration_id, 0)
    for ref in refs[10:14]:  # ended: one FAILED queued run, three retired while queued -> COMPLETED
        r.transition(ref.registration_id, S.FAILED if ref is refs[10] else S.RETIRING, reason="x" if ref is refs[10] else None)
    for ref in refs[11:14]:
        r.transition(ref.registration_id, S.CLEANUP)
        r.transition(ref.registration_id, S.COMPLETED)
    r.register(refs[11].name, CONFIG, total_steps=3, owner="alice")  # a name registered again (a new newest run)
    yield r
    r.close()


def _pages(reg, tenant=None, **query):
    """Every page of the query, by cursor; (names in order, totals seen)."""
    names, totals, cursor = [], set(), None
    while True:
        page = reg.list_page(ListQuery(cursor=cursor, **query), tenant)
        names += [r.name for r in page.refs]
        totals.add(page.total)
        if page.next_cursor is None:
            return names, totals
        cursor = page.next_cursor


@pytest.mark.parametrize("tenant", [None, "alice", "bob"])
@pytest.mark.parametrize("filters", [{}, {"state": S.PENDING}, {"state": S.COMPLETED}, {"name_contains": "A-RUN1"}, {"name_contains": "b-RUN0"},
                                     {"owner": "bob"}, {"owner": ""}])
@pytest.mark.parametrize("limit", [1, 7, 1000])
def test_pages_concatenated_are_the_filtered_list(reg, tenant, filters, limit):
    if tenant is not None and "owner" in filters:
        return  # a tenant's owner filter is the controller's to refuse (its own runs only)
    want = [r for r in reg.list(filters.get("state"), tenant)
            if ("name_contains" not in filters or filters["name_contains"].lower() in r.name.lower())
            and ("owner" not in filters or r.owner == (filters["owner"] or None))]
    names, totals = _pages(reg, tenant, limit=limit, **filters)
    assert names == [r.name for r in want] and totals == {len(want)}
    page = reg.list_page(ListQuery(limit=limit, offset=2, **filters), tenant)
    assert [r.name for r in page.refs] == [r.name for r in want][2: 2 + limit]


def test_a_page_has_the_refs_the_full_list_has(reg):
    full = {r.name: r for r in reg.list()}
    for ref in reg.list_page(ListQuery(limit=1000)).refs:
        assert ref == full[ref.name]  # queue positions, residency, config: the same ref


def test_counts_are_the_counts_of_the_refs(reg):
    assert reg.state_counts() == Counter(r.state for r in reg.list())
    assert reg.state_counts("alice") == Counter(r.state for r in reg.list(tenant="alice"))
    assert reg.residency_counts() == {"resident": 0, "queued": 0, "evicted": 0,
                                      **Counter(r.residency for r in reg.live() if r.residency)}
    assert reg.residency_counts()["evicted"] == 1 and reg.residency_counts()["resident"] == 3


def test_the_loops_reads_are_what_the_refs_say(reg):
    live = reg.live()
    assert reg.live_states() == {r.registration_id: r.state for r in live}
    assert reg.unqueued_live() == [r for r in live if not r.queued]
    for owner in OWNERS:
        mine = [r for r in live if r.owner == owner]
        assert reg.usage(owner) == (len(mine), sum(1 for r in mine if r.queued))


def test_recently_updated_names_are_the_newest_runs_by_update(reg):
    want = sorted(reg.list(), key=lambda r: (-r.updated_at, -r.slot_version))[:5]  # slot_version grows with run_id
    assert [r.name for r in reg.recently_updated(5)] == [r.name for r in want]
    assert len(reg.recently_updated(1000)) == len(reg.list())


@pytest.mark.parametrize("query, message", [
    ({"limit": 0}, "limit 0 is out of range: 1..1000"),
    ({"limit": 1001}, "limit 1001 is out of range"),
    ({"offset": -1}, "offset -1 is negative"),
    ({"cursor": "r3", "offset": 2}, "give a cursor or an offset, not both"),
    ({"cursor": "12"}, "cursor '12' is not one this service gave out"),
    ({"cursor": "r-1"}, "is not one this service gave out"),
])
def test_a_bad_query_is_refused_with_what_is_allowed(query, message):
    with pytest.raises(BadValue, match=message):
        ListQuery(**query)


def test_a_quota_refuses_with_the_quota_and_the_usage_and_records_nothing(reg):
    before = reg.live_states()
    live, waiting = reg.usage("alice")
    assert (live, waiting) == (12, 11)  # 13 registered, 2 ended, 1 registered again; one resident
    usage = rf"tenant 'alice' has {live} live run\(s\), {waiting} of them waiting for a slot"
    with pytest.raises(QuotaExceeded, match=rf"{usage}; its max_live_runs is {live} \(quotas.tenants.alice\)"):
        reg.register("new-a", CONFIG, total_steps=3, owner="alice", quota=RunQuota(live, None, "quotas.tenants.alice"))
    with pytest.raises(QuotaExceeded, match=rf"{usage}; its max_queued_runs is {waiting} \(quotas.default\), and every"):
        reg.register("new-a", CONFIG, total_steps=3, owner="alice", quota=RunQuota(None, waiting, "quotas.default"))
    assert reg.live_states() == before
    ok = reg.register("new-a", CONFIG, total_steps=3, owner="alice", quota=RunQuota(live + 1, waiting + 1))
    assert ok.queued and reg.usage("alice") == (live + 1, waiting + 1)


def test_concurrent_registrations_never_pass_a_quota_together(tmp_path):
    """8 threads register 10 runs each for one tenant whose quota is 25 live runs: exactly 25 are
    accepted (the check and the insert are one transaction), the rest refused with the quota."""
    r = Registry(tmp_path / "reg.sqlite", num_slots=4)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(10):
            try:
                r.register(f"t{w}-{i}", CONFIG, total_steps=3, owner="alice", quota=RunQuota(25, None))
                out = "ok"
            except QuotaExceeded as e:
                assert "max_live_runs is 25" in str(e)
                out = "refused"
            with lock:
                outcomes.append(out)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert Counter(outcomes) == {"ok": 25, "refused": 55} and r.usage("alice") == (25, 21)
    r.close()


def test_one_runs_queue_position_is_its_place_in_the_whole_queue(reg):
    """A single ref's queue position (one count in SQLite: the slot changes of every turn build
    one) equals its place in the queue read whole, for every run: queued, evicted (requeued
    behind the others), resident and ended ones (None), with equal queued_at times broken by
    run id."""
    evicted = reg.live()[1]
    assert evicted.slot is not None
    reg.release_slot(evicted.registration_id, expect_slot=evicted.slot)  # to the end of the queue
    with reg._lock:
        reg._db.execute("UPDATE runs SET queued_at = (SELECT MIN(queued_at) FROM runs WHERE slot IS NULL) "
                        "WHERE run_id IN (SELECT run_id FROM runs WHERE slot IS NULL ORDER BY run_id LIMIT 3 OFFSET 5)")
    with reg._lock:
        whole = reg._queue_positions()
    assert len(whole) > 30
    for ref in reg.list():
        assert reg.get_run(ref.registration_id).queue_position == whole.get(ref.registration_id), ref.name


def test_the_schedulers_reads_search_indexes_not_the_table(reg):
    """The reads a placement and a reconcile make every round (the slot record, the queue's head, a
    run's queue position when its slot changes, the unqueued live runs) each search an index: none
    scans the runs table or sorts it (SQLite's plan for each statement they run, captured as run).
    Issue 26: with 1,024 registered runs the planner's own choice for the queue read every live run
    and sorted them, 0.8 ms a read, several a round."""
    PARTIAL = ("runs_waiting", "runs_unqueued", "runs_holding")
    evicted = reg.live()[1]  # a resident run (listing every run is not a per-round read)
    statements: list[str] = []
    reg._db.set_trace_callback(statements.append)
    try:
        reg.slot_holders()
        reg.free_slots()
        reg.queue_heads(8, 0)
        reg.queue_heads(8, 8)
        reg.unqueued_live()
        reg.release_slot(evicted.registration_id, expect_slot=evicted.slot)  # builds the evicted run's ref: its position
    finally:
        reg._db.set_trace_callback(None)
    reads = [s for s in statements if s.lstrip().upper().startswith("SELECT") and " runs" in s]
    assert len(reads) >= 6, statements
    for sql in reads:
        with reg._lock:
            plan = [row[3] for row in reg._db.execute("EXPLAIN QUERY PLAN " + sql)]
        # a SCAN may walk only a partial index (whose rows are the waiting, unqueued or holding runs)
        scans = [p for p in plan if p.startswith("SCAN runs") and not any(f"INDEX {i}" in p for i in PARTIAL)
                 or "TEMP B-TREE FOR ORDER BY" in p or "runs_by_state" in p]  # by state: every live run
        assert not scans, (sql, plan)
