"""Group-normalized advantages, per-adapter buffers: staleness and registration filters."""

import math

import pytest

from rollout.groups import AdapterBuffer, RolloutGroup, Sample, group_advantages

pytestmark = pytest.mark.unit


def group(version, adapter="a", registration_id="reg-1", rewards=(0.0, 1.0)):
    adv = group_advantages(list(rewards))
    return RolloutGroup(
        adapter=adapter, registration_id=registration_id, version=version, prompt_index=0, epoch=0,
        prompt_text="p", prompt_ids=[1, 2],
        samples=[Sample(response_ids=[3], response_text="x", logprobs=[-0.1], finish_reason="stop", reward=r, advantage=a)
                 for r, a in zip(rewards, adv)],
    )


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    adv = group_advantages([0.2, 0.5, 0.9])
    mean = (0.2 + 0.5 + 0.9) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in [0.2, 0.5, 0.9]) / 3)
    assert adv == pytest.approx([(r - mean) / (std + 1e-6) for r in [0.2, 0.5, 0.9]], rel=1e-12)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]
    assert group_advantages([]) == []


@pytest.mark.parametrize(
    "max_staleness, current, versions, kept, dropped",
    [
        (0, 3, [3, 2, 3], [3, 3], [2]),
        (1, 3, [1, 2, 3], [2, 3], [1]),
        (2, 3, [1, 2, 3], [1, 2, 3], []),
        (0, 0, [0, 0], [0, 0], []),
    ],
)
def test_buffer_drops_stale_groups(max_staleness, current, versions, kept, dropped):
    buf = AdapterBuffer("a", "reg-1", max_staleness)
    for v in versions:
        assert buf.put(group(v))
    ready, stale = buf.pop(10, current)
    assert [g.version for g in ready] == kept
    assert [g.version for g in stale] == dropped
    assert buf.dropped_stale == len(dropped) and len(buf) == 0


def test_buffer_refuses_foreign_registration_and_adapter():
    buf = AdapterBuffer("a", "reg-2", 1)
    assert not buf.put(group(0, registration_id="reg-1"))  # the previous tenant of the name
    assert not buf.put(group(0, adapter="b", registration_id="reg-2"))
    assert buf.put(group(0, registration_id="reg-2"))
    assert len(buf) == 1 and buf.refused_foreign == 2


def test_buffer_pops_oldest_first_up_to_max():
    buf = AdapterBuffer("a", "reg-1", 5)
    for v in range(5):
        buf.put(group(v))
    ready, _ = buf.pop(2, 4)
    assert [g.version for g in ready] == [0, 1]
    ready, _ = buf.pop(10, 4)
    assert [g.version for g in ready] == [2, 3, 4]
    assert buf.drain() == []
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        AdapterBuffer("a", "r", -1)


def test_group_wire_roundtrip_keeps_stamps():
    g = group(7, rewards=(0.25, 0.75))
    back = RolloutGroup.model_validate_json(g.model_dump_json())
    assert (back.adapter, back.registration_id, back.version) == ("a", "reg-1", 7)
    assert back.rewards == [0.25, 0.75] and [s.advantage for s in back.samples] == pytest.approx([-1.0, 1.0], abs=1e-5)
