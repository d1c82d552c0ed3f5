"""The scheduler's wait index (service/scheduling/wait_index.py) against its definition: the waiters
it gives are the evicted models whose `slot_wait()` is not None, sorted by it, as a scan of every
model would find them (the placement's order before the index, S2).

The models here are stand-ins (FAKE: a queue of arrival times, an eviction time, a resident flag)
that follow the rules a TinkerModel follows (W1: a queued call, an eviction, an unload taken touch
it; W2: a call taken or cancelled may not have touched it yet, its slot_wait only grows). A random
sequence of those changes, from a fixed seed, is checked against the scan after every change. The
real models and scheduler are checked in tests/unit/test_scheduler.py and test_scheduler_scale.py.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from service.scheduling.wait_index import WaitIndex

pytestmark = pytest.mark.unit


class Model:
    """FAKE Tinker model (module doc): `queue` of (arrival, needs_slot)."""

    def __init__(self, key: str, owner: str, index: WaitIndex) -> None:
        self.key, self.owner, self.index = key, owner, index
        self.queue: deque[tuple[float, bool]] = deque()
        self.evicted_at = 0.0
        self.resident = False

    def slot_wait(self) -> float | None:
        if not self.queue or not self.queue[0][1]:
            return None
        return max(self.queue[0][0], self.evicted_at)

    def submit(self, now: float, needs_slot: bool = True) -> None:
        self.queue.append((now, needs_slot))
        self.index.touch(self.key)  # W1

    def take_head(self, touch: bool) -> None:
        """Its head call is run or cancelled. A TinkerModel touches itself then (its unplaced run, a
        cancel) unless it is resident (its offer); W2 lets a waiting call's removal go untouched, but an
        unload's removal, after which a call behind it may wait, is always touched (offer_unplaced)."""
        if self.queue:
            _, needs_slot = self.queue.popleft()
            if touch or not needs_slot:
                self.index.touch(self.key)


def scan(models: dict[str, Model]) -> list[tuple[float, str]]:
    """The definition: every evicted model with a call waiting for a slot, by slot_wait."""
    return sorted((m.slot_wait(), k) for k, m in models.items() if not m.resident and m.slot_wait() is not None)


def look(index: WaitIndex, models: dict[str, Model], want: int, counts=lambda m: True) -> list[tuple[float, str]]:
    index.refresh(lambda k: models[k].resident)
    return [(since, m.key) for since, m in index.waiting(lambda k: models[k].resident, want, counts)]


def expected(models: dict[str, Model], want: int, counts=lambda m: True) -> list[tuple[float, str]]:
    out, counted = [], 0
    for since, key in scan(models):
        if counted >= want:
            break
        out.append((since, key))
        counted += counts(models[key])
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_waiters_are_those_a_scan_finds_in_the_same_order(seed):
    rng = random.Random(seed)
    models: dict[str, Model] = {}
    index = WaitIndex(models.get)
    now = 0.0
    for step in range(3000):
        now += 1.0
        action = rng.random()
        if action < 0.05 or not models:  # a new model: its creation is its first queued call
            m = models[f"m{len(models):04d}"] = Model(f"m{len(models):04d}", rng.choice("abc"), index)
            m.submit(now)
        else:
            m = models[rng.choice(sorted(models))]
            if action < 0.45:
                m.submit(now, needs_slot=rng.random() > 0.1)  # an unload now and then
            elif action < 0.65:
                m.take_head(touch=rng.random() < 0.5)
            elif action < 0.8 and not m.resident:  # placed: it holds a slot
                m.resident = True
            elif action < 0.95 and m.resident:  # evicted: W1
                m.resident, m.evicted_at = False, now
                index.touch(m.key)
            elif action >= 0.95:  # removed (unloaded, ended)
                del models[m.key]
        want = rng.choice([1, 3, 24])
        assert look(index, models, want) == expected(models, want), step
        over = lambda m: m.owner != "a"  # noqa: E731 - owner a is over its share: it does not count
        assert look(index, models, want, over) == expected(models, want, over), step
    assert look(index, models, 10**6) == scan(models)  # and all of them, when all are asked for


def test_a_model_whose_head_needs_no_slot_is_touched_again_for_its_unload():
    """W3: a call cancelled ahead of an unload (no touch): the look that finds the model no longer
    waiting hands it to take_unplaced at the next look."""
    models: dict[str, Model] = {}
    index = WaitIndex(models.get)
    m = models["m0"] = Model("m0", "a", index)
    m.submit(1.0)
    m.submit(2.0, needs_slot=False)  # the unload, behind the call
    assert look(index, models, 8) == [(1.0, "m0")]
    assert [x.key for x in index.take_unplaced()] == ["m0"] and index.take_unplaced() == []
    m.take_head(touch=False)  # the call is cancelled, its touch not yet made
    assert look(index, models, 8) == []
    index.refresh(lambda k: False)
    assert [x.key for x in index.take_unplaced()] == ["m0"]  # its head is now the unload: asked again


def test_the_newly_waiting_are_given_once_and_residents_never():
    models: dict[str, Model] = {}
    index = WaitIndex(models.get)
    a = models["a"] = Model("a", "x", index)
    b = models["b"] = Model("b", "x", index)
    b.resident = True
    a.submit(1.0)
    b.submit(2.0)
    index.refresh(lambda k: models[k].resident)
    assert [m.key for m in index.take_newly_waiting()] == ["a"]
    assert index.take_newly_waiting() == []
    assert look(index, models, 8) == [(1.0, "a")]
