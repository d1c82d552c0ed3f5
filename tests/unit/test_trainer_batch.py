"""TrainSample validation (scenario table), phases, DP shards and micro-batch packing."""

import pytest
from pydantic import ValidationError

from trainer.batch import PlannedSample, TrainBatch, TrainSample, assign_phases, dp_shard, pack_micro_batches

pytestmark = pytest.mark.unit

OK = dict(slot=0, tokens=[5, 6, 7], loss_mask=[0, 1, 1])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"loss_mask": [0, 1]}, "loss_mask has 2 entries but tokens has 3"),
        ({"loss_mask": [1, 1, 1]}, r"loss_mask\[0\] must be 0"),
        ({"loss_mask": [0, 2, 1]}, "must be 0 or 1"),
        ({"tokens": [5, -1, 7]}, "token ids must be >= 0"),
        ({"tokens": [5]}, "at least 2 items"),
        ({"advantage": float("nan")}, "advantage must be finite"),
        ({"rollout_logprobs": [0.0, -1.0]}, "rollout_logprobs has 2 entries"),
        ({"rollout_logprobs": [0.0, 0.5, -1.0]}, r"finite and <= 0 on learned tokens; bad positions \[1\]"),
        ({"rollout_logprobs": [0.0, float("-inf"), -1.0]}, r"bad positions \[1\]"),
        ({"slot": -1}, "greater than or equal to 0"),
        ({"weight": 2.0}, "Extra inputs are not permitted"),
    ],
)
def test_sample_rejects(change, message):
    with pytest.raises(ValidationError, match=message):
        TrainSample(**(OK | change))


def test_valid_sample_and_batch():
    s = TrainSample(**OK, rollout_logprobs=[123.0, -0.5, -1.0])  # masked positions may hold anything
    assert TrainBatch(samples=[s]).samples[0].advantage == 0.0
    with pytest.raises(ValidationError, match="at least 1 item"):
        TrainBatch(samples=[])


def test_phases_follow_each_slots_accumulation():
    # slot 0: 1 pending of 3 -> its 2nd sample here completes a step, the 3rd starts the next
    # slot 1: 0 pending of 1 -> every sample is its own step
    planned = assign_phases([0, 1, 0, 1, 0], pending={0: 1, 1: 0}, samples_per_step={0: 3, 1: 1})
    assert [(p.slot, p.phase) for p in planned] == [(0, 0), (1, 0), (0, 0), (1, 1), (0, 1)]


def test_dp_shards_partition_and_agree():
    planned = [PlannedSample(i, slot, 0) for i, slot in enumerate([2, 0, 1, 0, 2, 0])]
    shards = [dp_shard(planned, r, 2) for r in range(2)]
    assert sorted(p.index for s in shards for p in s) == list(range(6))
    assert [p.slot for p in shards[0]] == [0, 0, 2] and [p.slot for p in shards[1]] == [0, 1, 2]


def test_pack_respects_budget_and_sorts_by_slot():
    lengths = [10, 30, 5, 20, 20, 50]
    planned = [PlannedSample(i, slot, 0) for i, slot in enumerate([3, 1, 2, 0, 1, 0])]
    batches = pack_micro_batches(planned, lengths, token_budget=60)
    assert sorted(p.index for b in batches for p in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[p.index] for p in b) <= 60
        assert [p.slot for p in b] == sorted(p.slot for p in b)
    assert [[p.index for p in b] for b in batches] == [[5], [3, 1], [4, 2, 0]]
