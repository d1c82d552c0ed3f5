"""The trainer group (service/fleet/trainer_group.py over trainer/actor.py TrainWorker) with real Ray:
two data-parallel ranks train a mixed
batch; only slot gradients are all-reduced, both ranks end bit-identical, and the
result matches one process training the whole batch. Each rank runs at niceness 0 (every thread),
not Ray's worker default of 15 (service/fleet/actors.py TRAINER_RANK_NICENESS)."""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray
from tests.proc_probes import thread_niceness
from tests.trainer_probes import train_batch

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        stop_ray()


def _hyper(slot):
    from trainer.config import SlotHyperParams

    return SlotHyperParams(rank=4, alpha=8, lr=1e-2, samples_per_step=3, objective="sft" if slot else "rl")


def _batch():
    from trainer.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(0)
    out = []
    for slot in [0, 1, 0, 1, 0, 1]:
        n = int(torch.randint(6, 12, (1,), generator=g))
        out.append(TrainSample(slot=slot, tokens=torch.randint(0, 400, (n,), generator=g).tolist(),
                               loss_mask=[0, 0] + [1] * (n - 2), advantage=float(torch.randn(1, generator=g))))
    return TrainBatch(samples=out)


def test_dp2_actor_group_matches_one_process(ray_cluster, tiny_world):
    from tests.trainer_probes import slot_state_tensors_all_ranks
    from trainer.swap.slot_checkpoint import slot_state_tensors

    from service.fleet.actors import TRAINER_RANK_NICENESS
    from service.fleet.trainer_group import TrainerGroup
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=2, max_rank=4, dp=2, micro_batch_tokens=64)
    group = TrainerGroup(cfg, setup_timeout_s=300, call_timeout_s=120)
    try:
        group.start()
        assert sorted(p["dp_rank"] for p in group.placement) == [0, 1]
        assert len(set(group.pids())) == 2  # one process per rank
        for pid in group.pids():
            assert set(thread_niceness(pid).values()) == {TRAINER_RANK_NICENESS}, pid
        for slot in (0, 1):
            group.init_slot(slot, _hyper(slot), seed=slot)
        res = train_batch(group, _batch())
        assert res.stepped == [0, 1] and res.slots[0].samples == 3
        per_rank = slot_state_tensors_all_ranks(group, 0)
    finally:
        group.stop()

    # both DP ranks applied the same (all-reduced) update
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        for side in (0, 1):
            for name, t in per_rank[0][kind][side].items():
                assert torch.equal(t, per_rank[1][kind][side][name])

    # one process with the whole batch: same losses and moments (linear in the gradient)
    single = MultiLoraTrainer(cfg.model_copy(update={"dp": 1}))
    for slot in (0, 1):
        single.init_slot(slot, _hyper(slot), seed=slot)
    ref = single.train(_batch())
    for slot in (0, 1):
        assert res.slots[slot].loss == pytest.approx(ref.slots[slot].loss, rel=1e-5)
        assert res.slots[slot].steps[0].grad_norm == pytest.approx(ref.slots[slot].steps[0].grad_norm, rel=1e-5)
    mine = slot_state_tensors(single, 0)
    for kind in ("exp_avg", "exp_avg_sq"):
        for side in (0, 1):
            for name, t in mine[kind][side].items():
                # (A's moments are exactly zero after the first step: B starts at zero)
                d = (per_rank[0][kind][side][name] - t).abs().max() / max(t.abs().max(), 1e-30)
                assert d <= 1e-5, (kind, name, d.item())
    assert max(t.abs().max() for t in mine["exp_avg"][1].values()) > 0
