"""Registry scenario tables: each scenario is a sequence of calls on a real SQLite
registry with the expected outcome of each (a state/slot, or an error class and
message substring). `restart` closes the file and opens it again."""

from __future__ import annotations

import pytest

from service.config.adapter import AdapterConfig
from service.errors import Conflict, NoFreeSlot, NotFound
from service.registry.registry import AdapterState as S
from service.registry.registry import Registry

pytestmark = pytest.mark.unit

CONFIG = AdapterConfig(data={"path": "x.jsonl"}, reward={"name": "target_share"}, num_step=5)


def bind_queued(reg: Registry) -> list:
    """The free slots (lowest first) to the runs at the head of the queue, in queue order, each by
    the registry's own `bind` (the scheduler's one slot change); the refs of the runs bound."""
    return [reg.bind(run.registration_id, slot) for run, slot in zip(reg.queued(), reg.free_slots())]


class Scenario:
    """Runs rows against one registry; remembers every registration id per name."""

    def __init__(self, tmp_path, num_slots: int, max_live_runs: int | None = None) -> None:
        self.path = tmp_path / "registry.sqlite3"
        self.num_slots = num_slots
        self.max_live_runs = max_live_runs
        self.reg = Registry(self.path, num_slots, max_live_runs)
        self.ids: dict[str, list[str]] = {}

    def rid(self, name: str, which: int = -1) -> str:
        return self.ids[name][which]

    def do(self, op: str, *args):
        r = self.reg
        if op == "register":
            ref = r.register(args[0], CONFIG, total_steps=5)
            self.ids.setdefault(args[0], []).append(ref.registration_id)
            return ref
        if op == "to":  # to(name, state[, reason])
            return r.transition(self.rid(args[0]), args[1], reason=args[2] if len(args) > 2 else None)
        if op == "to_old":  # a transition on the name's previous registration
            return r.transition(self.rid(args[0], -2), args[1])
        if op == "prepared":
            return r.mark_prepared(self.rid(args[0]), weight_version=r.next_version())
        if op == "step":  # step(name, step, samples)
            return r.record_step(self.rid(args[0]), step=args[1], samples=args[2], metrics={"loss": 1.0 / args[1], "reward_mean": 0.1 * args[1]})
        if op == "step_old":
            return r.record_step(self.rid(args[0], -2), step=args[1], samples=args[2], metrics={})
        if op == "get":
            return r.get(args[0])
        if op == "restart":
            r.close()
            self.reg = Registry(self.path, self.num_slots, self.max_live_runs)
            return None
        if op == "bind":  # bind() -> the names bound, in order, with their slots
            return [(b.name, b.slot) for b in bind_queued(r)]
        if op == "evict":  # evict(name, slot)
            return r.release_slot(self.rid(args[0]), expect_slot=args[1])
        raise AssertionError(op)


# Each row: (op, args, expect). expect: dict of AdapterRef attributes, or (ErrorClass, substring).
SCENARIOS = {
    "full lifecycle then re-register the name": (2, [
        ("register", ("a",), {"state": S.PENDING, "slot": 0, "slot_version": 1, "step": 0}),
        ("prepared", ("a",), {"state": S.ACTIVE, "weight_version": 2}),
        ("step", ("a", 1, 8), {"step": 1, "samples_trained": 8, "last_metrics": {"loss": 1.0, "reward_mean": 0.1}}),
        ("step", ("a", 2, 8), {"step": 2, "samples_trained": 16}),
        ("to", ("a", S.RETIRING), {"state": S.RETIRING, "slot": 0}),
        ("step", ("a", 3, 4), {"step": 3, "samples_trained": 20}),  # the in-flight train call still commits
        ("to", ("a", S.CLEANUP), {"state": S.CLEANUP, "slot": 0}),
        ("to", ("a", S.COMPLETED), {"state": S.COMPLETED, "slot": None}),
        ("register", ("a",), {"state": S.PENDING, "slot": 0, "slot_version": 3, "step": 0, "samples_trained": 0}),
        ("step_old", ("a", 4, 1), (Conflict, "progress is recorded only for ACTIVE or RETIRING")),
        ("to_old", ("a", S.ACTIVE), (Conflict, "final state")),
    ]),
    "name conflicts while live, retry message while retiring": (3, [
        ("register", ("a",), {"state": S.PENDING}),
        ("register", ("a",), (Conflict, "in use by a live run (state PENDING)")),
        ("prepared", ("a",), {"state": S.ACTIVE}),
        ("register", ("a",), (Conflict, "in use by a live run (state ACTIVE)")),
        ("to", ("a", S.RETIRING), {"state": S.RETIRING}),
        ("register", ("a",), (Conflict, "still retiring (state RETIRING); retry")),
        ("to", ("a", S.CLEANUP), {"state": S.CLEANUP}),
        ("register", ("a",), (Conflict, "still retiring (state CLEANUP); retry")),
        ("to", ("a", S.COMPLETED), {"state": S.COMPLETED}),
        ("register", ("a",), {"state": S.PENDING}),
    ]),
    "slots run out: registrations queue FIFO, a freed slot goes to the head of the queue": (2, [
        ("register", ("a",), {"slot": 0, "slot_version": 1, "queue_position": None}),
        ("register", ("b",), {"slot": 1, "slot_version": 2}),
        ("register", ("c",), {"state": S.PENDING, "slot": None, "queue_position": 1, "slot_version": 3}),
        ("register", ("d",), {"slot": None, "queue_position": 2}),
        ("prepared", ("c",), (Conflict, "holds no slot (queued)")),
        ("to", ("a", S.FAILED, "NaN loss"), {"state": S.FAILED, "slot": None, "failure_reason": "NaN loss", "queue_position": None}),
        # a newcomer never overtakes the queue, even with a slot free
        ("register", ("e",), {"slot": None, "queue_position": 3}),
        ("bind", (), [("c", 0)]),
        ("get", ("c",), {"slot": 0, "queue_position": None, "state": S.PENDING}),
        ("get", ("d",), {"slot": None, "queue_position": 1}),
        ("get", ("e",), {"slot": None, "queue_position": 2}),
        ("bind", (), []),
        ("to", ("d", S.RETIRING), {"state": S.RETIRING, "queue_position": None}),  # never trained: leaves the queue
        ("get", ("e",), {"queue_position": 1}),
        ("to", ("b", S.FAILED, "x"), {"slot": None}),
        ("bind", (), [("e", 1)]),
    ]),
    "the live-run bound refuses with the bound in the message and consumes nothing": (1, [
        ("register", ("a",), {"slot": 0, "slot_version": 1}),
        ("register", ("b",), {"slot": None, "queue_position": 1}),
        ("register", ("c",), (NoFreeSlot, "2 registered runs are live and max_live_runs is 2")),
        ("to", ("b", S.FAILED, "gone"), {"state": S.FAILED}),
        # the refused registration above did not consume a version (the transaction rolled back)
        ("register", ("c",), {"slot": None, "queue_position": 1, "slot_version": 3}),
    ]),
    "an evicted run gives its slot back and waits at the end of the queue": (1, [
        ("register", ("a",), {"slot": 0}),
        ("evict", ("a", 0), (Conflict, "only a trained ACTIVE or RETIRING run can be evicted")),
        ("prepared", ("a",), {"state": S.ACTIVE}),
        ("register", ("b",), {"queue_position": 1}),
        ("evict", ("a", 1), (Conflict, "holds slot 0, not 1")),
        ("evict", ("a", 0), {"state": S.ACTIVE, "slot": None, "queue_position": 2}),
        ("step", ("a", 1, 1), {"step": 1}),  # a train call in flight when it was evicted still commits
        ("bind", (), [("b", 0)]),
        ("get", ("a",), {"queue_position": 1}),
        ("restart", (), None),
        ("get", ("a",), {"state": S.ACTIVE, "slot": None, "queue_position": 1}),
        ("to", ("b", S.FAILED, "x"), {}),
        ("bind", (), [("a", 0)]),
        ("get", ("a",), {"state": S.ACTIVE, "slot": 0, "queue_position": None}),
    ]),
    "illegal transitions are refused and change nothing": (1, [
        ("register", ("a",), {"state": S.PENDING}),
        ("to", ("a", S.CLEANUP), (Conflict, "cannot go from PENDING to CLEANUP; allowed from PENDING: ACTIVE, FAILED, RETIRING")),
        ("to", ("a", S.COMPLETED), (Conflict, "cannot go from PENDING to COMPLETED")),
        ("to", ("a", S.FAILED), (ValueError, "needs a reason")),
        ("get", ("a",), {"state": S.PENDING, "slot": 0}),
        ("step", ("a", 1, 1), (Conflict, "PENDING; progress is recorded only")),
        ("prepared", ("a",), {"state": S.ACTIVE}),
        ("step", ("a", 1, 1), {"step": 1}),
        ("step", ("a", 1, 1), (Conflict, "step 1 is not after the committed step 1")),
        ("to", ("a", S.PENDING), (Conflict, "cannot go from ACTIVE to PENDING")),
        ("get", ("zz",), (NotFound, "no adapter named 'zz'")),
    ]),
    "retired while being prepared: stays RETIRING, marked trained": (1, [
        ("register", ("a",), {"state": S.PENDING, "activated_at": None}),
        ("to", ("a", S.RETIRING), {"state": S.RETIRING}),
        ("prepared", ("a",), {"state": S.RETIRING, "weight_version": 2}),
    ]),
    "restart keeps everything, versions keep growing": (2, [
        ("register", ("a",), {"slot_version": 1}),
        ("prepared", ("a",), {"weight_version": 2}),
        ("step", ("a", 1, 8), {"step": 1}),
        ("register", ("b",), {"slot": 1, "slot_version": 3}),
        ("restart", (), None),
        ("get", ("a",), {"state": S.ACTIVE, "slot": 0, "step": 1, "samples_trained": 8, "weight_version": 2}),
        ("get", ("b",), {"state": S.PENDING, "slot": 1}),
        ("register", ("c",), {"slot": None, "queue_position": 1, "slot_version": 4}),
        ("to", ("c", S.FAILED, "x"), {}),
        ("to", ("b", S.RETIRING), {"state": S.RETIRING}),
        ("restart", (), None),
        ("register", ("b",), (Conflict, "still retiring")),
        ("to", ("b", S.CLEANUP), {}),
        ("to", ("b", S.COMPLETED), {"slot": None}),
        ("restart", (), None),
        ("register", ("c",), {"slot": 1, "slot_version": 5}),
    ]),
}


@pytest.mark.parametrize("title", list(SCENARIOS))
def test_registry_scenario(tmp_path, title):
    num_slots, rows = SCENARIOS[title]
    sc = Scenario(tmp_path, num_slots, max_live_runs=2 if "bound" in title else None)
    try:
        for i, (op, args, expect) in enumerate(rows):
            where = f"row {i}: {op}{args}"
            if isinstance(expect, tuple):
                cls, text = expect
                with pytest.raises(cls) as err:
                    sc.do(op, *args)
                assert text in str(err.value), f"{where}: {err.value}"
                continue
            ref = sc.do(op, *args)
            if isinstance(expect, list):
                assert ref == expect, f"{where}: {ref!r}, want {expect!r}"
                continue
            for key, want in (expect or {}).items():
                assert getattr(ref, key) == want, f"{where}: {key} = {getattr(ref, key)!r}, want {want!r}"
    finally:
        sc.reg.close()


def test_metrics_series_and_list_survive_restart(tmp_path):
    sc = Scenario(tmp_path, 2)
    sc.do("register", "a")
    sc.do("prepared", "a")
    for step in (1, 2, 3):
        sc.do("step", "a", step, 4)
    sc.do("restart")
    registration_id, steps = sc.reg.metrics("a")
    assert registration_id == sc.rid("a")
    assert [s.step for s in steps] == [1, 2, 3]
    assert [s.samples for s in steps] == [4, 4, 4]
    assert steps[2].metrics == pytest.approx({"loss": 1 / 3, "reward_mean": 0.3})
    assert [r.name for r in sc.reg.list()] == ["a"]
    assert sc.reg.list(S.PENDING) == []
    assert [r.state for r in sc.reg.list(S.ACTIVE)] == [S.ACTIVE]
    sc.reg.close()


def test_list_shows_newest_run_per_name_and_live_shows_live_only(tmp_path):
    sc = Scenario(tmp_path, 3)
    sc.do("register", "a")
    sc.do("to", "a", S.FAILED, "bad data")
    sc.do("register", "b")
    sc.do("register", "a")
    assert [(r.name, r.state) for r in sc.reg.list()] == [("b", S.PENDING), ("a", S.PENDING)]
    assert [r.registration_id for r in sc.reg.live()] == [sc.rid("b"), sc.rid("a")]
    assert sc.reg.free_slots() == [2]
    assert sc.reg.get_run(sc.rid("a", 0)).failure_reason == "bad data"
    sc.reg.close()


def test_versions_never_repeat(tmp_path):
    sc = Scenario(tmp_path, 1)
    seen = []
    for round_ in range(5):
        seen.append(sc.do("register", "a").slot_version)
        seen.append(sc.reg.next_version())
        sc.do("to", "a", S.FAILED, f"round {round_}")
        sc.do("restart")
    assert seen == sorted(seen) and len(set(seen)) == len(seen) == 10


def test_one_writer_per_file(tmp_path):
    first = Registry(tmp_path / "r.sqlite3", 1)
    try:
        with pytest.raises(RuntimeError, match="already open in another process"):
            Registry(tmp_path / "r.sqlite3", 1)
    finally:
        first.close()
    Registry(tmp_path / "r.sqlite3", 1).close()  # free again once closed


def test_slot_leases_share_the_slot_count_with_runs(tmp_path):
    """I7: a Tinker model's lease holds a slot like a live run; release frees it; a restart drops leases."""
    sc = Scenario(tmp_path, 3)
    assert sc.do("register", "a").slot == 0
    assert sc.reg.lease_slot("s-1:train:0", "alice") == 1
    with pytest.raises(Conflict, match="already holds a trainer slot"):
        sc.reg.lease_slot("s-1:train:0", "alice")
    assert sc.do("register", "b").slot == 2
    assert sc.reg.free_slots() == []
    queued = sc.do("register", "c")  # every slot held, one by a lease: c waits in the queue
    assert queued.slot is None and queued.queue_position == 1
    with pytest.raises(NoFreeSlot, match=r"all 3 slots are held by adapter runs or Tinker models"):  # holders unnamed (I8)
        sc.reg.lease_slot("s-2:train:0", "bob")
    assert bind_queued(sc.reg) == []  # the leased slot is not free for the queue
    assert sc.reg.leases() == {"s-1:train:0": (1, "alice")}
    assert sc.reg.release_lease("s-1:train:0") == 1
    assert sc.reg.release_lease("s-1:train:0") is None  # twice: nothing more to free
    assert [r.name for r in bind_queued(sc.reg)] == ["c"] and sc.reg.get("c").slot == 1
    sc.do("to", "a", S.FAILED, "x")
    assert sc.reg.lease_slot("s-2:train:0", "bob") == 0
    sc.do("restart")  # the models lived in the old process's memory: their leases go with it
    assert sc.reg.leases() == {} and sc.reg.free_slots() == [0]
    sc.reg.close()
