"""trainer/batch.py ``rider_share``: how a round's Tinker datums are shared over the DP ranks."""

import pytest

from trainer.batch import rider_share

pytestmark = pytest.mark.unit

SLOTS = [2, 0, 1, 0, 2, 0, 3]  # the riders' slots, in the round's order


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_shares_partition_the_riders_and_spread_each_slot(dp):
    shares = [rider_share(SLOTS, r, dp) for r in range(dp)]
    assert sorted(k for s in shares for k in s) == list(range(len(SLOTS)))  # each rider on exactly one rank
    assert all(s == sorted(s) for s in shares)  # each share in the round's order
    for slot in set(SLOTS):  # a slot's datums spread evenly: its counts per rank differ by at most one
        counts = [sum(1 for k in s if SLOTS[k] == slot) for s in shares]
        assert max(counts) - min(counts) <= 1, (slot, counts)


def test_one_rank_keeps_every_rider_in_order_and_two_ranks_split_by_slot_order():
    assert rider_share(SLOTS, 0, 1) == list(range(len(SLOTS)))
    # (slot, position) order: 1, 3, 5 (slot 0), 2 (slot 1), 0, 4 (slot 2), 6 (slot 3); rank 0 takes the
    # 1st, 3rd, 5th and 7th (1, 5, 0, 6), rank 1 the others; each share in the round's order
    assert rider_share(SLOTS, 0, 2) == [0, 1, 5, 6] and rider_share(SLOTS, 1, 2) == [2, 3, 4]
    assert rider_share([], 1, 2) == []
