"""The scheduler (service/scheduling/scheduler.py) over Tinker models: the rules of a round and of residency.

The trainer is a FAKE (`RecordingTrainer`): it records each round's work and each swap, and
answers every call; the rules under test are the scheduler's (which work goes in which round,
in which order; who is evicted, restored, who waits). The numerics of a mixed round are proven in
tests/integration/test_tinker_joined_step.py (against references) and the whole path over a
live service in tests/integration/test_scheduler_fleet.py. Real: the Scheduler, its SQLite
registry and the Tinker records beside it, a local store, TinkerModels and TinkerModel tenants,
their queues and done callbacks.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from service.config.durability import Durability
from service.registry.registry import Registry
from service.registry.tinker_records import TinkerRecords
from service.scheduling.residency import ResidencyKnobs
from service.scheduling.scheduler import Scheduler, round_wait
from service.tenants.tinker_lora import LoraSpec
from service.tenants.tinker_models import TinkerModels
from trainer.interface import WrittenFolder
from trainer.rounds import AdamStep, CallResult, Datum, RoundResult
from trainer.storage.local_store import LocalStore

pytestmark = pytest.mark.unit

IDLE_S = 60.0
DEADLINE_S = 60.0


class TrainerGone(RuntimeError):
    """FAKE: what a call to a trainer whose process died raises (in the fleet: Ray's RayActorError)."""


class RecordingTrainer:
    """FAKE trainer: records rounds (their calls' loss_fn as tags, optimizer steps by slot) and swaps;
    a call whose tag starts with "bad" gets an error, as a bad datum does. `lose_at` ("round" or
    "save"): that call finds the trainer gone (TrainerGone; the scheduler's is_lost says so)."""

    def __init__(self, num_slots: int) -> None:
        self.config = type("Cfg", (), {"num_slots": num_slots, "max_rank": 8, "dp": 1})
        self.rounds: list[dict] = []
        self.events: list[tuple] = []
        self.fail_swap_out = False
        self.fail_load = False
        self.lose_at: str | None = None
        self.hold_writes = False  # begin_save_slot_state answers a HeldWrite (below) instead of a written folder
        self.writes: list[HeldWrite] = []

    def run_round(self, work) -> RoundResult:
        if self.lose_at == "round":
            raise TrainerGone("the trainer's process died during the round (planted)")
        self.rounds.append({"calls": [c.loss_fn for c in work.calls], "forwards": [c.loss_fn for c in work.forwards],
                            "optim": [slot for slot, _ in work.optim]})
        calls = [CallResult(error="bad datum") if c.loss_fn.startswith("bad") else CallResult(metrics={"loss:sum": 1.0})
                 for c in work.calls]
        return RoundResult(calls=calls, forwards=[CallResult(metrics={"loss:sum": 2.0}) for _ in work.forwards],
                           optim=[{"grad_norm": 1.0, "step": 1.0} for _ in work.optim])

    def init_slot(self, slot, hyper, seed, init_from=None, registration=None):
        self.events.append(("init", slot, registration))

    def clear_slot(self, slot):
        self.events.append(("clear", slot))

    def save_slot_state(self, slot, folder):
        if self.lose_at == "save":
            raise TrainerGone("the trainer's process died before the save (planted)")
        self.events.append(("save", slot))

    def begin_save_slot_state(self, slot, folder):
        self.save_slot_state(slot, folder)
        if self.hold_writes:  # written in the background until the test ends it
            self.writes.append(HeldWrite(str(folder)))
            return self.writes[-1]
        return WrittenFolder(str(folder))

    def load_slot_state(self, slot, folder, registration=None):
        if self.fail_load:
            raise RuntimeError("StoreError: a file of the snapshot does not match its manifest (planted)")
        self.events.append(("load", slot, registration))

    def swap_out(self, slot, key):
        if self.fail_swap_out:
            raise RuntimeError("SwapError: no space left on device (planted)")
        self.events.append(("swap_out", slot, key))
        return {"seconds": 0.0}

    def swap_in(self, slot, key):
        self.events.append(("swap_in", slot, key))
        return {"seconds": 0.0}

    def drop_swapped(self, key):
        self.events.append(("drop", key))


class HeldWrite:
    """FAKE background write (trainer/interface.py PendingWrite) that the test ends (`state`: "writing",
    "written" or "failed"); `result()` while writing stands for the wait until it is written."""

    def __init__(self, folder: str) -> None:
        self.folder, self.state, self.waited = folder, "writing", False

    def done(self) -> bool:
        return self.state != "writing"

    def result(self) -> str:
        if self.state == "writing":
            self.waited, self.state = True, "written"
        if self.state == "failed":
            raise RuntimeError("OSError: no space left on device (planted)")
        return self.folder


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class World:
    def __init__(self, tmp_path, num_slots: int = 2, turn_steps: int = 4, durability: str = "interval:300") -> None:
        self.clock = Clock()
        self.trainer = RecordingTrainer(num_slots)
        self.registry = Registry(tmp_path / "reg.sqlite", num_slots)
        self.scheduler = Scheduler(self.registry, self.trainer, ResidencyKnobs(idle_evict_s=IDLE_S, turn_steps=turn_steps),
                                   window_s=0.0, clock=self.clock, is_lost=lambda e: isinstance(e, TrainerGone))
        self.records = TinkerRecords(self.registry.db_path)
        self.models = TinkerModels(self.scheduler, self.records, LocalStore(tmp_path / "store"), base_model="m",
                                   tokenizer_id="m", max_rank=8, durability=Durability.parse(durability))
        self.answers: dict[str, tuple] = {}  # tag -> (value, error)
        self.answered: Counter = Counter()  # request id -> how many times it was answered (call's futures)

    def done(self, tag: str):
        return lambda value, error: self.answers.__setitem__(tag, (value, error))

    def create(self, model_id: str) -> list:
        """A model created and one round run: `out` gets its creation's error (None: it holds a slot)."""
        out: list = []
        m = self.models.create(model_id, "alice", LoraSpec(rank=4, seed=1), "s1", lambda value, error: out.append(error))
        self.round()
        return m, out

    def place(self):
        events = self.scheduler.place()
        self.scheduler.run_unplaced()
        return events

    def fb(self, model, tag):
        model.forward_backward([Datum([1, 2], {})], tag, None, self.done(tag))

    def optim(self, model, tag):
        model.optim_step(AdamStep(learning_rate=0.1), self.done(tag))

    def call(self, model, rid: str, operation: str, *args) -> None:
        """An operation with a future, as the Tinker face submits it: its record first, its answer
        recorded when it comes (api/tinker/futures.py does both on the serving loop)."""
        self.records.add_future(rid, model.owner, model.key, "call")

        def done(value, error) -> None:
            self.answers[rid] = (value, error)
            self.answered[rid] += 1
            self.records.resolve(rid, "json", b"{}", keep_request=True)

        getattr(model, operation)(*args, done, request_id=rid)

    def rounds_until(self, condition, limit: int = 10) -> None:
        """Rounds as the loop runs them until `condition()` holds (a bounded number: a hang fails)."""
        for _ in range(limit):
            if condition():
                return
            self.round()
        assert condition(), f"not after {limit} rounds; answers: {sorted(self.answers)}"

    def round(self):
        """One round as the loop runs it: place, gather (the tenants with work), one trainer call."""
        self.place()
        ready = self.scheduler.gather(max_wait_s=0.0)
        return self.scheduler.run_round(ready)


def test_a_round_mixes_models_and_keeps_each_models_order(tmp_path):
    """Model a: fb, optim, fb; model b: fb, fb. Round 1 mixes a.fb1 + b.fb1 + b.fb2 and applies a's
    optim_step after the pass in the SAME trainer call; a.fb2 waits for round 2 (never overtakes the
    step it came after)."""
    w = World(tmp_path)
    a, _ = w.create("a")
    b, _ = w.create("b")
    w.fb(a, "a.fb1")
    w.optim(a, "a.optim")
    w.fb(a, "a.fb2")
    w.fb(b, "b.fb1")
    w.fb(b, "b.fb2")
    w.round()
    w.round()
    slot_a = w.scheduler.slot_of("a")
    assert w.trainer.rounds == [{"calls": ["a.fb1", "b.fb1", "b.fb2"], "forwards": [], "optim": [slot_a]},
                                {"calls": ["a.fb2"], "forwards": [], "optim": []}]
    assert set(w.answers) == {"a.fb1", "a.optim", "a.fb2", "b.fb1", "b.fb2"}
    assert w.answers["a.optim"] == ({"grad_norm": 1.0, "step": 1.0}, None)
    c = w.scheduler.counters
    assert c["mixed_steps"] == 2 and c["forward_backward_calls"] == 4 and w.models.stats()["coalescing_factor"] == 2.0


def test_an_operation_that_runs_alone_ends_its_models_part_of_the_round(tmp_path):
    """Model c's save runs alone after the round's trainer call (another model's calls go on in it);
    c's next call waits for the next round. A bad call fails only itself; a cancelled one never runs."""
    w = World(tmp_path)
    a, _ = w.create("a")
    c, _ = w.create("c")
    c.save_state(str(tmp_path / "store" / "ckpt"), w.done("c.save"))
    w.fb(c, "c.fb")
    w.fb(a, "bad.a")
    w.fb(a, "a.ok")
    a.forward([Datum([1, 2], {})], "a.fwd", None, w.done("a.fwd"))
    a.forward_backward([Datum([1, 2], {})], "a.cancelled", None, w.done("a.cancelled"), cancelled=lambda: True)
    w.round()
    assert w.trainer.rounds == [{"calls": ["bad.a", "a.ok"], "forwards": ["a.fwd"], "optim": []}]
    assert ("save", w.scheduler.slot_of("c")) in w.trainer.events and "c.fb" not in w.answers
    assert w.answers["bad.a"][0].error == "bad datum" and w.answers["a.ok"][0].error is None
    assert "a.cancelled" not in w.answers  # dropped unrun (M2)
    w.round()
    assert w.trainer.rounds[-1]["calls"] == ["c.fb"]


def test_a_submission_wakes_a_waiting_gather(tmp_path):
    """A Tinker call never waits on an idle loop: a gather waiting (here up to 10 minutes) for work
    returns once a call is queued, with that model's work."""
    w = World(tmp_path)
    a, _ = w.create("a")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(w.scheduler.gather(max_wait_s=600.0)))
    waiter.start()
    w.fb(a, "a.fb")
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive() and [t.key for t, _ in got[0]] == ["a"]


def test_a_tinker_round_runs_once_every_resident_is_ready_not_after_its_window(tmp_path):
    """G1 (round_wait): with a 10-minute window, a gather with A's call waits for B (resident, not
    ready); B's call wakes it and every resident is now ready: it returns with both at once rather
    than at the window's end. Before the rule a lone or complete round still waited its window."""
    w = World(tmp_path)
    a, _ = w.create("a")
    b, _ = w.create("b")
    w.scheduler.window_s = 600.0
    w.fb(a, "a.fb")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(w.scheduler.gather(max_wait_s=600.0)), daemon=True)
    waiter.start()
    w.fb(b, "b.fb")
    waiter.join(DEADLINE_S)
    assert not waiter.is_alive() and sorted(t.key for t, _ in got[0]) == ["a", "b"]


def _tenant(key: str, expects_work: bool) -> SimpleNamespace:
    return SimpleNamespace(key=key, expects_work=lambda: expects_work)


@pytest.mark.parametrize("ready, residents, waited, tinker, expect", [
    # every resident ready (a lone model; all of them): runs now, whatever kind
    ("a", "a", 0.0, True, 0.0),
    ("ab", "ab", 0.0, True, 0.0),
    ("ab", "ab", 0.0, False, 0.0),
    # a Tinker call among the ready: at most the window (0.06) from the first ready, never past max_wait
    ("a", "ab", 0.0, True, 0.06),
    ("a", "ab", 0.05, True, 0.01),
    ("a", "ab", 0.07, True, -0.01),
    # dataset runs only: every run that expects work; an idle model (expects none) is not waited for
    ("r", "rm", 0.0, False, 0.0),
    ("r", "rs", 0.0, False, 1.0),
    ("r", "rs", 0.4, False, 0.6),
])
def test_round_wait_is_g1s_rule(ready, residents, waited, tinker, expect):
    kinds = {"a": True, "b": True, "r": True, "s": True, "m": False}  # m: a Tinker model (expects no work)
    pool = {k: (_tenant(k, kinds[k]), i) for i, k in enumerate("abrsm")}
    got = round_wait([pool[k] for k in ready], [pool[k] for k in residents], waited, tinker, window_s=0.06, max_wait_s=1.0)
    assert got == pytest.approx(expect)
    # max_wait bounds the Tinker window too
    if tinker and ready != residents:
        assert round_wait([pool[k] for k in ready], [pool[k] for k in residents], waited, tinker, 0.06, 0.02) \
            == pytest.approx(0.02 - waited)


def test_creation_waits_for_a_slot_and_is_never_refused_for_room(tmp_path):
    """One slot: B's creation waits while A was called recently (A keeps its slot; B's future has no
    answer and B says why it waits); once A is idle, B evicts it (swapped out, lease released) and
    its slot is filled from its seeded init: its creation is answered."""
    w = World(tmp_path, num_slots=1)
    a, done_a = w.create("a")
    assert done_a == [None] and ("init", 0, "a") in w.trainer.events
    w.fb(a, "a.fb")
    w.round()
    b, done_b = w.create("b")
    assert done_b == [] and w.registry.leases() == {"a": (0, "alice")}
    assert b.waiting_reason is not None and "waiting for a trainer slot" in b.waiting_reason
    w.clock.now += 2 * IDLE_S
    w.round()
    assert done_b == [None] and w.registry.leases() == {"b": (0, "alice")} and ("init", 0, "b") in w.trainer.events
    assert ("swap_out", 0, "a") in w.trainer.events and w.models.stats()["models_evicted"] == 1


def test_an_evicted_models_calls_wait_with_the_reason_then_bring_it_back(tmp_path):
    """Evicted A's call waits in its queue (its waiting_reason says why) while B is busy or recent;
    once B is idle, the next placement evicts B and swaps A back in, and A's call runs."""
    w = World(tmp_path, num_slots=1)
    a, _ = w.create("a")
    w.clock.now += 2 * IDLE_S
    b, _ = w.create("b")  # A idle: evicted for B
    w.fb(b, "b.fb")
    w.fb(a, "a.fb")
    w.round()
    assert "a.fb" not in w.answers and "b.fb" in w.answers
    assert a.waiting_reason is not None and "waiting for a trainer slot" in a.waiting_reason
    w.clock.now += 2 * IDLE_S  # B idle now (A still waits, with a call queued)
    w.round()
    assert "a.fb" in w.answers and a.waiting_reason is None
    assert [e for e in w.trainer.events if e[0] in ("swap_out", "swap_in")] == [
        ("swap_out", 0, "a"), ("swap_out", 0, "b"), ("swap_in", 0, "a")]
    assert w.scheduler.counters["evictions"] == 2 and w.scheduler.counters["restores"] == 1


def test_turns_rotate_models_that_keep_working(tmp_path):
    """Turns are the same rule for models as for runs: a resident that took turn_steps optimizer steps
    gives its slot to a waiting tenant at the next placement, even if it has calls queued."""
    w = World(tmp_path, num_slots=1, turn_steps=2)
    a, _ = w.create("a")
    w.clock.now += 2 * IDLE_S
    b, _ = w.create("b")  # a evicted (idle)
    w.fb(a, "a.fb")  # a waits
    for i in range(2):
        w.fb(b, f"b.fb{i}")
        w.optim(b, f"b.optim{i}")
        w.round()
    assert "a.fb" not in w.answers  # b's turn not used up until its second step was taken
    w.fb(b, "b.fb2")  # b still has work: evicted for its turn all the same
    w.round()
    assert "a.fb" in w.answers and "b.fb2" not in w.answers and w.scheduler.slot_of("a") == 0


def test_a_failed_swap_out_leaves_the_model_resident(tmp_path):
    w = World(tmp_path, num_slots=1)
    a, _ = w.create("a")
    w.clock.now += 2 * IDLE_S
    w.trainer.fail_swap_out = True
    b, done_b = w.create("b")
    assert done_b == [] and w.registry.leases() == {"a": (0, "alice")}  # B waits; A is not moved
    w.fb(a, "a.fb")
    w.round()
    assert w.answers["a.fb"][0].error is None  # C3: a unchanged and still served


def test_unload_needs_no_slot(tmp_path):
    """Unloading an evicted model forgets its swapped-out state and takes no slot."""
    w = World(tmp_path, num_slots=1)
    a, _ = w.create("a")
    w.clock.now += 2 * IDLE_S
    b, _ = w.create("b")
    a.unload(w.done("a.unload"))
    w.place()
    assert w.answers["a.unload"] == (None, None) and ("drop", "a") in w.trainer.events
    assert w.models.get("a") is None and w.registry.leases() == {"b": (0, "alice")}
    w.fb(a, "a.late")  # a call after the unload is refused
    assert isinstance(w.answers["a.late"][1], ValueError)


def test_an_unload_behind_a_cancelled_call_runs_at_the_next_placement_however_many_wait(tmp_path):
    """Evicted A has a call waiting for a slot and an unload behind it, and five models have waited
    longer: A is far from the head of the queue, where a placement looks (service/scheduling/wait_index.py).
    Its call is cancelled (the Tinker face's cancel touches the model: api/tinker/futures.py on_cancel,
    TinkerService._model_changed): the next placement runs the unload; nothing else moved."""
    w = World(tmp_path, num_slots=1)
    a, _ = w.create("a")
    w.clock.now += 2 * IDLE_S
    b, _ = w.create("b")  # A idle: evicted for B, which stays (recent, its turn not used)
    waiting = [w.models.create(f"c{i}", "alice", LoraSpec(rank=4, seed=1), "s1", w.done(f"c{i}.create")) for i in range(5)]
    cancelled = [False]
    a.forward_backward([Datum([1, 2], {})], "a.fb", None, w.done("a.fb"), cancelled=lambda: cancelled[0])
    a.unload(w.done("a.unload"))
    w.place()
    assert "a.unload" not in w.answers and a.waiting_reason is not None
    cancelled[0] = True
    a.changed()  # what the cancel's hook does
    w.place()
    assert w.answers["a.unload"] == (None, None) and w.models.get("a") is None
    assert w.registry.leases() == {"b": (0, "alice")} and not any(f"c{i}.create" in w.answers for i in range(5))
    assert all(m.waiting_reason is not None for m in waiting)


def test_a_lost_trainer_keeps_the_models_and_brings_them_back_from_their_durable_state(tmp_path):
    """The trainer restarted (its slots and swap store gone): the models stay (their leases freed), their
    queued calls wait unanswered, and at the next placement each is filled from its durable state (here its
    seeded init: it never took a snapshot), then its calls run."""
    w = World(tmp_path)
    a, _ = w.create("a")
    w.fb(a, "a.queued")
    assert w.scheduler.clear() == [] and w.registry.leases() == {} and w.models.get("a") is a
    assert "a.queued" not in w.answers
    before = len(w.trainer.events)
    w.round()
    assert ("init", w.scheduler.slot_of("a"), "a") in w.trainer.events[before:] and w.answers["a.queued"][1] is None


def test_the_tenants_of_a_kind_are_those_a_scan_of_every_tenant_finds(tmp_path):
    """Scheduler.tenants(*kinds) answers from its index by kind (the loop asks for the dataset runs every
    round beside a thousand models); it must name exactly the tenants of those kinds that a scan of
    every tenant finds, through adds (one key added again as another kind), removes and a lost trainer
    (clear keeps only the models)."""
    from service.scheduling.tenant import TenantKind

    w = World(tmp_path, num_slots=4)
    a, _ = w.create("a")
    runs = {key: SimpleNamespace(key=key, kind=kind, name=key) for key, kind in
            (("sft-1", TenantKind.SFT), ("rl-1", TenantKind.RL), ("sft-2", TenantKind.SFT), ("rl-2", TenantKind.RL))}
    for run in runs.values():
        w.scheduler.add(run)
    b, _ = w.create("b")

    def agrees() -> None:
        every = w.scheduler.tenants()
        for kinds in ((TenantKind.SFT,), (TenantKind.RL,), (TenantKind.TINKER,), (TenantKind.SFT, TenantKind.RL)):
            assert sorted(t.key for t in w.scheduler.tenants(*kinds)) == sorted(t.key for t in every if t.kind in kinds), kinds

    agrees()
    assert [t.key for t in w.scheduler.tenants(TenantKind.SFT)] == ["sft-1", "sft-2"]  # in the order added
    assert w.scheduler.remove("rl-1") is runs["rl-1"] and w.scheduler.remove("rl-1") is None
    w.scheduler.add(SimpleNamespace(key="sft-2", kind=TenantKind.RL, name="sft-2"))  # the same key, now another kind
    agrees()
    assert [t.key for t in w.scheduler.tenants(TenantKind.RL)] == ["rl-2", "sft-2"]
    assert sorted(t.key for t in w.scheduler.clear()) == ["rl-2", "sft-1", "sft-2"]
    agrees()
    assert {t.key for t in w.scheduler.tenants(TenantKind.TINKER)} == {"a", "b"} and w.scheduler.tenants(TenantKind.RL) == []


def _one_step(w: World, model, tag: str) -> None:
    w.call(model, f"{tag}.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.call(model, f"{tag}.optim", "optim_step", AdamStep(learning_rate=0.1))
    w.round()
    assert w.answers[f"{tag}.fb"][1] is None and w.answers[f"{tag}.optim"][1] is None


def test_under_interval_a_lost_step_is_named_and_calls_that_changed_nothing_are_not(tmp_path):
    """Policy interval: requests are not logged, so after the trainer's loss a model whose state
    changed after its snapshot (here: a step after its creation) answers every later call with the
    step it was restored to; one that only ran calls that change nothing (forward, save_state) since
    its snapshot carries on."""
    w = World(tmp_path)
    a, _ = w.create("a")
    b, _ = w.create("b")
    _one_step(w, a, "a1")
    w.call(b, "b.forward", "forward", [Datum([1, 2], {})], "cross_entropy", None)
    w.call(b, "b.save", "save_state", "file:///nowhere/b-save")
    w.round()
    w.records.flush()
    w.scheduler.clear()  # the trainer is lost
    w.call(a, "a2.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.call(b, "b2.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.rounds_until(lambda: {"a2.fb", "b2.fb"} <= set(w.answers))
    error = w.answers["a2.fb"][1]
    assert error is not None and "model a was restored to step 0" in str(error) and "1 call(s)" not in str(error), error
    assert "2 call(s) it answered after that are lost" in str(error)  # its forward_backward and optim_step
    assert w.answers["b2.fb"][1] is None  # b lost nothing


def test_under_step_the_calls_after_the_snapshot_are_replayed(tmp_path):
    """Policy step: every request is logged, and an optim_step is acknowledged after its snapshot; a
    forward_backward after it is replayed into the restored slot (its answer stands), then the queued
    calls run."""
    w = World(tmp_path, durability="step")
    a, _ = w.create("a")
    _one_step(w, a, "a1")  # snapshot before the optim_step's answer
    w.call(a, "a2.fb", "forward_backward", [Datum([1, 2], {})], "replayed", None)
    w.round()
    w.records.flush()
    w.scheduler.clear()
    w.call(a, "a3.optim", "optim_step", AdamStep(learning_rate=0.1))
    before = len(w.trainer.rounds)
    w.rounds_until(lambda: "a3.optim" in w.answers)
    assert w.answers["a3.optim"][1] is None
    replayed = w.trainer.rounds[before:]
    assert replayed and replayed[0]["calls"] == ["replayed"] and replayed[0]["optim"], replayed


def _fb(w: World, model, rid: str) -> None:
    """A forward_backward whose loss_fn is its request id: the trainer's rounds name it."""
    w.call(model, rid, "forward_backward", [Datum([1, 2], {})], rid, None)


def test_a_round_the_trainer_dies_in_runs_again_once_the_model_is_restored(tmp_path):
    """Policy step, the trainer lost during a round (the node-loss drill's path, tests/integration/
    test_multinode.py), then lost again in the round that replays: the round's calls are not
    answered; they go back to the model's queue, and after the scheduler's clear they run on the
    restored model: its snapshot, the forward_backward answered after it replayed first (its answer
    stands; once, however many losses), then the round's calls, each answered once."""
    w = World(tmp_path, durability="step")
    a, _ = w.create("a")
    _one_step(w, a, "a1")
    _fb(w, a, "a2.fb1")
    w.round()  # answered: a gradient no snapshot covers
    _fb(w, a, "a2.fb2")
    w.call(a, "a2.optim", "optim_step", AdamStep(learning_rate=0.1))
    w.trainer.lose_at = "round"
    with pytest.raises(TrainerGone):
        w.round()
    assert "a2.fb2" not in w.answers and "a2.optim" not in w.answers
    w.records.flush()  # the answers' records committed (in the fleet: long before a loss is detected)
    w.scheduler.clear()
    with pytest.raises(TrainerGone):  # the restored model's first round: the replay and the round's calls
        w.round()
    w.scheduler.clear()
    w.trainer.lose_at = None
    before = (len(w.trainer.rounds), len(w.trainer.events))
    w.rounds_until(lambda: "a2.optim" in w.answers)
    slot = w.scheduler.slot_of("a")
    assert ("load", slot, "a") in w.trainer.events[before[1]:]  # from its snapshot of step 1
    assert w.trainer.rounds[before[0]:] == [{"calls": ["a2.fb1", "a2.fb2"], "forwards": [], "optim": [slot]}]
    assert {r: w.answered[r] for r in ("a2.fb1", "a2.fb2", "a2.optim")} == {"a2.fb1": 1, "a2.fb2": 1, "a2.optim": 1}
    assert w.answers["a2.fb2"][1] is None and w.answers["a2.optim"][1] is None and a.step == 2


def test_a_snapshot_the_trainer_dies_in_acknowledges_nothing_and_runs_again(tmp_path):
    """Policy step, the trainer lost after a round's pass, in model a's snapshot of its optim_step: the
    step is not durable, so nothing of a's part of the round is answered (its forward_backward
    neither), nor of model b's, settled after a; after the scheduler's clear both models' calls run
    again on their restored states, each answered once. (Before: a's optim_step and b's call were
    taken and never answered nor run again; an SDK client waited on them until its progress timeout.)"""
    w = World(tmp_path, durability="step")
    a, _ = w.create("a")
    b, _ = w.create("b")
    _one_step(w, a, "a1")
    _fb(w, a, "a2.fb")
    w.call(a, "a2.optim", "optim_step", AdamStep(learning_rate=0.1))
    _fb(w, b, "b.fb")
    w.trainer.lose_at = "save"
    with pytest.raises(TrainerGone):
        w.round()
    assert not {"a2.fb", "a2.optim", "b.fb"} & set(w.answers), w.answers  # acknowledged only once durable
    w.scheduler.clear()
    w.trainer.lose_at = None
    before = len(w.trainer.rounds)
    w.rounds_until(lambda: {"a2.optim", "b.fb"} <= set(w.answers))
    assert w.trainer.rounds[before:] == [{"calls": ["a2.fb", "b.fb"], "forwards": [], "optim": [w.scheduler.slot_of("a")]}]
    assert {r: w.answered[r] for r in ("a2.fb", "a2.optim", "b.fb")} == {"a2.fb": 1, "a2.optim": 1, "b.fb": 1}
    assert all(w.answers[r][1] is None for r in ("a2.fb", "a2.optim", "b.fb")) and a.step == 2


def test_a_durable_state_that_cannot_be_read_is_told_not_waited_on(tmp_path):
    """A snapshot the trainer cannot load (a FAKE fault: a corrupted file) is tried at RESTORE_TRIES
    placements, then the model's queued calls and its later ones are answered with why; the slot
    is free again and another model trains."""
    from service.tenants.tinker_model import RESTORE_TRIES

    w = World(tmp_path, durability="step")
    a, _ = w.create("a")
    _one_step(w, a, "a1")
    w.records.flush()
    w.scheduler.clear()
    w.trainer.fail_load = True
    w.call(a, "a2.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.rounds_until(lambda: "a2.fb" in w.answers, limit=2 * RESTORE_TRIES)
    error = w.answers["a2.fb"][1]
    assert error is not None and "durable state could not be restored" in str(error) and "planted" in str(error), error
    w.call(a, "a3.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    assert "durable state could not be restored" in str(w.answers["a3.fb"][1])
    assert w.scheduler.slot_of("a") is None
    b, out = w.create("b")
    _one_step(w, b, "b1")


def test_a_creation_past_the_quota_is_refused_naming_quota_and_usage_and_changes_nothing(tmp_path):
    """Admission never refuses for room, only for a quota: alice's quota counts her runs and models;
    the refused creation leaves no model, no record and no queued work; another tenant is not bound."""
    from service.config.quotas import Quotas
    from service.errors import QuotaExceeded

    w = World(tmp_path, num_slots=1)
    w.models.quotas = Quotas(tenants={"alice": {"max_live_runs": 1}})
    a, _ = w.create("a")
    with pytest.raises(QuotaExceeded, match=r"holds 0 adapter run\(s\) and 1 Tinker model\(s\).*quotas.tenants.alice.max_live_runs is 1"):
        w.models.create("a2", "alice", LoraSpec(rank=4, seed=2), "s1", w.done("a2"))
    w.records.flush()
    assert w.models.get("a2") is None and "a2" not in {r.model_id for r in w.records.live_models()}
    b = w.models.create("b", "bob", LoraSpec(rank=4, seed=3), "s2", w.done("b.create"))  # waits for the one slot
    assert w.models.get("b") is b and "b.create" not in w.answers


def test_a_tenant_that_cannot_offer_loses_no_other_tenants_work(tmp_path, monkeypatch):
    """A tenant whose offer raises (a FAKE fault: a bug in one tenant's code) fails the round, and the
    work the round had already taken from the other tenants runs in the next round, answered once."""
    w = World(tmp_path)
    a, _ = w.create("a")
    b, _ = w.create("b")
    assert (w.scheduler.slot_of("a"), w.scheduler.slot_of("b")) == (0, 1)  # a offers first
    w.fb(a, "a.fb")
    w.fb(b, "b.fb")

    def broken(slot):
        raise RuntimeError("a bug in b's offer (planted)")

    monkeypatch.setattr(b, "offer", broken)
    with pytest.raises(RuntimeError, match="planted"):
        w.round()
    assert "a.fb" not in w.answers
    monkeypatch.undo()
    w.rounds_until(lambda: {"a.fb", "b.fb"} <= set(w.answers))
    assert w.answers["a.fb"][1] is None and w.answers["b.fb"][1] is None
    assert sum(r["calls"].count("a.fb") for r in w.trainer.rounds) == 1  # a's call ran once


def test_a_model_whose_calls_cannot_be_built_answers_them(tmp_path, monkeypatch):
    """A fault while a model builds its round's calls (a FAKE one: Call raising, as a half-updated
    tree once did) answers the calls it took off its queue with the error instead of dropping them."""
    import service.tenants.tinker_model as tinker_model

    w = World(tmp_path)
    a, _ = w.create("a")
    w.fb(a, "a.fb")

    def broken(*args, **kwargs):
        raise TypeError("Call() takes 4 positional arguments (planted)")

    monkeypatch.setattr(tinker_model, "Call", broken)
    with pytest.raises(TypeError, match="planted"):
        w.round()
    value, error = w.answers["a.fb"]
    assert value is None and "could not run this call" in str(error) and "planted" in str(error)


def test_an_evicted_model_joins_the_end_of_the_queue(tmp_path):
    """First come, first served counts from when a tenant BEGAN to wait (docs/concepts.md "Fair turns":
    a just-evicted tenant joins the end). A's next call was queued while it held the slot, before C2
    came; A is evicted (its turn used) after C2 began to wait: C2 gets the slot before A. (Seen with 64
    SDK tenants through 4 slots: a model waited 62 grants for its first slot against the bound of 60.)"""
    w = World(tmp_path, num_slots=1, turn_steps=1)
    a, _ = w.create("a")
    w.fb(a, "a.fb0")
    w.optim(a, "a.optim0")
    w.fb(a, "a.fb1")  # queued while A is resident
    c1, _ = w.create("c1")  # waits; the round runs A's step: its turn is used
    c2, _ = w.create("c2")  # waits; this round's placement evicts A for C1 (A now waits, behind C2)
    assert w.scheduler.slot_of("c1") == 0 and "a.fb1" not in w.answers
    w.fb(c1, "c1.fb")
    w.optim(c1, "c1.optim")
    w.round()  # C1's step: its turn is used
    w.round()  # C1 evicted: the slot goes to C2, who began to wait before A did
    assert w.scheduler.slot_of("c2") == 0 and "a.fb1" not in w.answers


def _snapshot_row(w: World, model_id: str):
    w.records.flush()
    return next(r for r in w.records.live_models() if r.model_id == model_id)


def _make_due(model) -> None:
    model.journal.snapshot_at -= 400  # its last snapshot older than the policy's 300 s


def _snapshot_being_written(tmp_path):
    """A world whose trainer holds background writes, and its model a, one step in, whose periodic
    snapshot has just been taken (its write held: w.trainer.writes[0])."""
    w = World(tmp_path)
    w.trainer.hold_writes = True
    a, _ = w.create("a")
    _one_step(w, a, "a1")
    _make_due(a)
    w.round()
    return w, a


def test_a_periodic_snapshot_is_written_while_rounds_go_on_and_recorded_once_written(tmp_path):
    """Policy interval: a due snapshot is taken at once and written in the background. Until it is
    written the record names the previous snapshot (here the seeded init) and no second one begins;
    the model's calls go on meanwhile; once written, the next round records it, covering what ran
    before it was taken (not the step after)."""
    w, a = _snapshot_being_written(tmp_path)
    covers, step = a.applied_seq, a.step  # what it covers: nothing ran since it was taken
    assert len(w.trainer.writes) == 1 and a.journal.writing is not None and not a.dirty
    assert _snapshot_row(w, "a").snapshot is None  # the seeded init still
    _one_step(w, a, "a2")  # goes on while it is written
    _make_due(a)
    w.round()
    assert len(w.trainer.writes) == 1, "a second snapshot began while one was written"
    w.trainer.writes[0].state = "written"
    w.round()
    row = _snapshot_row(w, "a")
    assert (row.snapshot, row.snapshot_seq, row.snapshot_step) == (w.trainer.writes[0].folder, covers, step)
    assert a.journal.writing is None and a.dirty and a.step == step + 1  # a2's step is after it
    counts = w.models.snapshots
    assert (counts.taken, counts.recorded, counts.failed) == (1, 1, 0) and counts.background_seconds >= 0.0


def test_a_failed_background_snapshot_leaves_the_previous_one_and_the_model_dirty(tmp_path):
    """The write failed (a FAKE fault: the disk is full): the record keeps the previous snapshot, the
    model is dirty again and, its last snapshot as old as before, the next round takes another."""
    w, a = _snapshot_being_written(tmp_path)
    w.trainer.writes[0].state = "failed"
    w.round()  # settles it (failed), then takes the next one: due at once
    assert _snapshot_row(w, "a").snapshot is None
    assert len(w.trainer.writes) == 2 and a.journal.writing is not None
    w.trainer.writes[1].state = "written"
    w.round()
    assert _snapshot_row(w, "a").snapshot == w.trainer.writes[1].folder and not a.dirty
    assert (w.models.snapshots.taken, w.models.snapshots.recorded, w.models.snapshots.failed) == (2, 1, 1)
    assert w.models.stats()["snapshots_failed"] == 1


def test_a_snapshot_that_waits_records_the_one_being_written_first(tmp_path):
    """A graceful stop's snapshot (it waits for its write) while a periodic one is written: the
    periodic one is waited for and recorded first, then the stop's, so the record never goes back
    to an older state."""
    w, a = _snapshot_being_written(tmp_path)
    _one_step(w, a, "a2")
    url = a.snapshot(w.scheduler.slot_of("a"))  # as fleet_runtime's drain does
    assert w.trainer.writes[0].waited
    row = _snapshot_row(w, "a")
    assert row.snapshot == url != w.trainer.writes[0].folder and row.snapshot_step == a.step == 2


def test_a_snapshot_being_written_when_the_trainer_is_lost_is_never_recorded(tmp_path):
    """The trainer lost while a periodic snapshot is written: the model comes back from its recorded
    state (its seeded init here; policy interval, so its step after it is named lost) and the write,
    even if it ends, is not recorded."""
    w, a = _snapshot_being_written(tmp_path)
    w.scheduler.clear()  # the trainer is lost
    w.trainer.writes[0].state = "written"
    _fb(w, a, "a2.fb")
    w.rounds_until(lambda: "a2.fb" in w.answers)
    assert _snapshot_row(w, "a").snapshot is None and a.journal.writing is None
    error = w.answers["a2.fb"][1]
    assert error is not None and "model a was restored to step 0" in str(error), error


def test_each_part_of_a_round_is_timed_for_metrics(tmp_path):
    """scheduler.seconds (/metrics lorafleet_coordinator_seconds{part}): a round's offer, trainer call and
    settle add time, and a gather that finds nothing ready adds its wait."""
    w = World(tmp_path)
    a, _ = w.create("a")
    before = dict(w.scheduler.seconds)
    _one_step(w, a, "a1")
    spent = {k: w.scheduler.seconds[k] - before[k] for k in before}
    assert set(spent) == {"place", "gather", "gather_window", "offer", "train", "settle", "single"}
    assert all(spent[k] > 0 for k in ("place", "offer", "train", "settle")), spent
    assert 0 <= spent["gather_window"] <= spent["gather"], spent
    waited, in_window = w.scheduler.seconds["gather"], w.scheduler.seconds["gather_window"]
    assert w.scheduler.gather(max_wait_s=0.05) == []
    assert w.scheduler.seconds["gather"] - waited >= 0.05
    assert w.scheduler.seconds["gather_window"] == in_window  # nothing was ready: no window was waited


def test_the_window_part_of_a_gather_is_the_wait_after_its_first_ready_call(tmp_path):
    """gather_window: with a 0.2 s window, A's call ready and B resident but idle, the gather waits the
    window out after A's call was ready (at least 0.2 s of gather_window, all within gather)."""
    w = World(tmp_path)
    a, _ = w.create("a")
    w.create("b")
    w.scheduler.window_s = 0.2
    w.fb(a, "a.fb")
    gathered, in_window = w.scheduler.seconds["gather"], w.scheduler.seconds["gather_window"]
    assert [t.key for t, _ in w.scheduler.gather(max_wait_s=5.0)] == ["a"]
    window = w.scheduler.seconds["gather_window"] - in_window
    assert 0.2 <= window <= w.scheduler.seconds["gather"] - gathered


def test_a_stop_saves_the_queue_of_a_model_whose_state_is_durable_without_swapping_it_in(tmp_path):
    """A graceful stop's drain: a model whose state is its durable snapshot (here after the trainer's loss;
    likewise revived after a restart) and that has not had a slot since is handed over with slot None
    (its queued calls are what to save), not swapped in: it has nothing in the swap store. (Before, its
    swap-in failed, was logged as an error, and its queued calls were not kept for the restart.)"""
    w = World(tmp_path, durability="interval:300")
    a, _ = w.create("a")
    b, _ = w.create("b")
    w.scheduler.clear()  # the trainer is lost: both come back from their durable state when they next run
    w.call(a, "a.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    assert a.durable() and b.durable()
    saved: list = []
    before = len(w.trainer.events)
    out = w.scheduler.drain(lambda tenant, slot: saved.append((tenant.key, slot)) or "kept")
    assert sorted(saved) == [("a", None), ("b", None)] and out == {"a": "kept", "b": "kept"}
    assert not [e for e in w.trainer.events[before:] if e[0] in ("swap_in", "clear")]


def test_a_due_snapshot_is_taken_as_the_model_leaves_its_slot_and_its_next_turn_begins_with_its_calls(tmp_path):
    """M7 (issue 41): model a, one step in and its snapshot due, is evicted for b (one slot, turns of one
    step): its snapshot is taken from the slot before the swap-out, covering that step. When a is back,
    its first round runs its queued call (no snapshot first: nothing changed since) and the snapshot is
    recorded. A model evicted with no snapshot due takes none then."""
    w = World(tmp_path, num_slots=1, turn_steps=1)
    a, _ = w.create("a")
    _one_step(w, a, "a1")
    covers, step = a.applied_seq, a.step
    _make_due(a)
    b, _ = w.create("b")  # waits; the placement evicts a (its turn used) for b
    slot = w.scheduler.slot_of("b")
    assert slot is not None and w.scheduler.slot_of("a") is None
    i = w.trainer.events.index(("swap_out", slot, "a"))
    assert w.trainer.events[i - 1] == ("save", slot) and not a.dirty  # taken from a's slot, before it left
    assert w.models.snapshots.taken == 1
    _one_step(w, b, "b1")
    w.call(a, "a2.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.rounds_until(lambda: "a2.fb" in w.answers)  # b's turn used: a is back, its call in its first round
    assert w.trainer.events.count(("save", w.scheduler.slot_of("a"))) <= 1 and w.models.snapshots.taken == 1
    row = _snapshot_row(w, "a")
    assert (row.snapshot_seq, row.snapshot_step) == (covers, step)  # what ran before it left, not a2
    assert ("swap_out", slot, "b") in w.trainer.events and w.models.snapshots.taken == 1  # b: none due, none taken


def _contended_world(tmp_path, turn_steps: int = 2):
    """One slot: model a resident, one step in; model b's creation queued behind it (the placement
    leaves a tenant waiting: contended)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    w = World(tmp_path, num_slots=1, turn_steps=turn_steps)
    a, _ = w.create("a")
    _one_step(w, a, "a1")
    b = w.models.create("b", "alice", LoraSpec(rank=4, seed=2), "s1", w.done("b.create"))
    w.round()
    assert w.scheduler.contended and w.scheduler.slot_of("a") is not None and w.scheduler.slot_of("b") is None
    return w, a, b


def test_while_others_wait_a_due_snapshot_is_left_to_the_eviction(tmp_path):
    """M7 (issue 41): with b waiting, a's snapshot falls due after its first step (its last one older
    than the interval, as after a long wait between turns). a's next step runs in one round with no
    snapshot before it; the snapshot is taken as a leaves its slot at its turn's end (2 steps),
    before the swap-out, and covers both steps. Before, a's next offer was the snapshot: a round of its own."""
    w, a, b = _contended_world(tmp_path)
    _make_due(a)
    taken = w.models.snapshots.taken
    _one_step(w, a, "a2")  # one round: its calls (a snapshot first would leave them unanswered)
    assert w.models.snapshots.taken == taken and a.dirty
    covers, step = a.applied_seq, a.step
    slot = w.scheduler.slot_of("a")
    w.rounds_until(lambda: w.scheduler.slot_of("b") is not None)  # a's turn used: evicted for b
    i = w.trainer.events.index(("swap_out", slot, "a"))
    assert w.trainer.events[i - 1] == ("save", slot) and w.models.snapshots.taken == taken + 1 and not a.dirty
    assert (covers, step) == (a.applied_seq, 2)


def test_while_others_wait_a_change_older_than_the_interval_is_snapshotted_at_the_next_offer(tmp_path):
    """M7's bound: the deferral holds only while the oldest change not in a snapshot is younger than
    the policy's interval (300 s); an older one is snapshotted as the next offer, as when nobody waits."""
    w, a, _ = _contended_world(tmp_path)
    _make_due(a)
    a._dirty_since -= 400  # a1's change 400 s old
    taken = w.models.snapshots.taken
    w.call(a, "a2.fb", "forward_backward", [Datum([1, 2], {})], "cross_entropy", None)
    w.round()
    assert w.models.snapshots.taken == taken + 1 and "a2.fb" not in w.answers  # the snapshot's round first
    w.rounds_until(lambda: "a2.fb" in w.answers)
