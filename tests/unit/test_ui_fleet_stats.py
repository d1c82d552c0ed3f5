"""service.loop.fleet_stats: totals, windowed rates and time split of training-loop rounds."""

from __future__ import annotations

import threading

import pytest

from service.loop.fleet_stats import FleetStats, batch_token_counts

pytestmark = pytest.mark.unit


class Clock:
    """A settable clock (the recorder takes one so that rates are exact, not timing-dependent)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rates_are_sums_over_the_window_divided_by_its_span():
    clock = Clock()
    stats = FleetStats(window_s=60.0, clock=clock)
    clock.t = 1010.0  # round 1: 4 s (collect 3, train 1), ended at 1010 -> started at 1006
    stats.record_round(collect_s=3.0, train_s=1.0, steps=2, samples=16, rollout_tokens=100, trained_tokens=120)
    clock.t = 1016.0  # round 2: 6 s
    stats.record_round(collect_s=2.0, train_s=2.0, publish_s=1.5, checkpoint_s=0.5, steps=3, samples=24,
                       rollout_tokens=200, trained_tokens=260)
    snap = stats.snapshot()
    span = 1016.0 - 1006.0
    assert snap["rounds"] == 2 and snap["steps"] == 5 and snap["samples"] == 40
    assert snap["steps_per_min"] == pytest.approx(60.0 * 5 / span)
    assert snap["rollout_tokens_per_s"] == pytest.approx(300 / span)
    assert snap["trained_tokens_per_s"] == pytest.approx(380 / span)
    assert snap["seconds"] == {"collect": 5.0, "train": 3.0, "publish": 1.5, "checkpoint": 0.5}
    assert snap["fractions"] == pytest.approx({"collect": 0.5, "train": 0.3, "publish": 0.15, "checkpoint": 0.05})
    assert [r["steps"] for r in snap["recent"]] == [2, 3]

    clock.t = 1016.0 + 61.0  # both rounds left the window: no rate, totals stay
    later = stats.snapshot()
    assert later["steps_per_min"] == 0.0 and later["rollout_tokens_per_s"] == 0.0
    assert later["steps"] == 5 and later["seconds"] == snap["seconds"]


def test_recent_keeps_the_newest_rounds_but_totals_count_all():
    stats = FleetStats(max_rounds=3, clock=Clock())
    for i in range(5):
        stats.record_round(collect_s=0.1, train_s=0.2, steps=i, samples=0)
    snap = stats.snapshot()
    assert snap["rounds"] == 5 and snap["steps"] == sum(range(5))
    assert [r["steps"] for r in snap["recent"]] == [2, 3, 4]
    assert [r["steps"] for r in stats.snapshot(recent=2)["recent"]] == [3, 4]


def test_empty_recorder_has_zero_rates_and_fractions():
    snap = FleetStats().snapshot()
    assert snap["rounds"] == 0 and snap["steps_per_min"] == 0.0 and snap["recent"] == []
    assert set(snap["fractions"].values()) == {0.0}


@pytest.mark.parametrize("bad, needle", [
    ({"collect_s": -1.0}, "collect_s=-1.0"),
    ({"train_s": float("nan")}, "train_s=nan"),
    ({"publish_s": float("inf")}, "publish_s=inf"),
    ({"steps": -2}, "steps=-2"),
    ({"samples": 1.5}, "samples=1.5"),
    ({"rollout_tokens": None}, "rollout_tokens=None"),
])
def test_bad_values_are_refused_and_change_nothing(bad, needle):
    stats = FleetStats(clock=Clock())
    stats.record_round(collect_s=1.0, train_s=1.0, steps=1, samples=8)
    before = stats.snapshot()
    args = {"collect_s": 1.0, "train_s": 1.0, "steps": 1, "samples": 8, **bad}
    with pytest.raises(ValueError, match="must be finite seconds >= 0 and counts integers >= 0") as err:
        stats.record_round(**args)
    assert needle in str(err.value)
    assert stats.snapshot() == before


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window_s must be > 0"):
        FleetStats(window_s=0)
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        FleetStats(max_rounds=0)


def test_concurrent_writers_and_readers_lose_nothing():
    stats = FleetStats(max_rounds=10_000)
    n_threads, per_thread = 4, 500
    go = threading.Event()

    def write():
        go.wait()
        for _ in range(per_thread):
            stats.record_round(collect_s=0.001, train_s=0.001, steps=1, samples=2, rollout_tokens=3, trained_tokens=4)

    def read():
        go.wait()
        for _ in range(200):
            snap = stats.snapshot()
            assert snap["samples"] == 2 * snap["steps"]  # a snapshot never sees half a round

    threads = [threading.Thread(target=write) for _ in range(n_threads)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    snap = stats.snapshot(recent=0)
    total = n_threads * per_thread
    assert (snap["rounds"], snap["steps"], snap["samples"], snap["rollout_tokens"], snap["trained_tokens"]) == (
        total, total, 2 * total, 3 * total, 4 * total)


def test_batch_token_counts_split_rl_responses_from_all_loss_tokens():
    from trainer.batch import TrainSample

    rl = TrainSample(slot=0, tokens=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 1], rollout_logprobs=[0.0, 0.0, -1.0, -1.0, -1.0])
    sft = TrainSample(slot=1, tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1])
    assert batch_token_counts([rl, sft, rl]) == (6, 9)
    assert batch_token_counts([]) == (0, 0)
