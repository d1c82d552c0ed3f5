"""The service's Tinker backend (api/tinker/fleet_backend.py) over a real trainer group (Ray
actor, service/trainer_group.py) and a real Controller/registry, against the in-process
backend on an in-process trainer (the reference): the same calls give the same weights and
Adam moments, and the models' slots are registry leases (counted, refused when none is
free, freed on release). The group's train call carries attached Tinker calls (one mixed
step over Ray) and fails them when it fails. ~45 s (Ray start and one trainer rank)."""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray

import pytest
import torch

from tests.numerics import max_rel_err

pytestmark = pytest.mark.integration

NUM_SLOTS = 3


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        stop_ray()


def _data(seed: int, n: int):
    from trainer.tinker_ops import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        tokens = torch.randint(0, 400, (length + 1,), generator=g).tolist()
        weights = torch.ones(length)
        weights[:2] = 0.0
        out.append(Datum(tokens=tokens[:-1], inputs={"target_tokens": torch.tensor(tokens[1:], dtype=torch.long), "weights": weights}))
    return out


def _train(backend, models):
    from api.tinker.backend import LoraSpec, ModelCall
    from trainer.tinker_ops import AdamStep

    for i, m in enumerate(models):
        backend.create(m, LoraSpec(rank=4, seed=10 + i), tenant="alice")
    losses = []
    for step in range(3):
        calls = [ModelCall(m, _data(100 * step + i, 2 + i), "cross_entropy") for i, m in enumerate(models)]
        results = backend.forward_backward(calls)  # one mixed pass of both models
        assert all(r.error is None for r in results), [r.error for r in results]
        losses.append([r.metrics["loss:sum"] for r in results])
        for m in models:
            backend.optim_step(m, AdamStep(learning_rate=2e-2, eps=1e-2, grad_clip_norm=1.0))
    return losses


def _riders_on_the_group(group, lease_slot: int, free_slot: int) -> None:
    """The loop's train call on the group (Ray) carries the attached source's Tinker calls and
    hands their results back; a refused batch raises for the loop while the calls run alone; a
    train call that fails otherwise fails them and raises for the loop. Stops the group."""
    from tests.trainer_probes import slot_state_tensors_all_ranks

    from service.trainer_group import RiderCalls
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams
    from trainer.tinker_ops import Call

    delivered: list = []

    class Source:  # what api/tinker/fleet_backend.py's _LoopRiders gives the group, recorded
        def __init__(self, calls):
            self.calls = calls

        def take(self):
            calls, self.calls = self.calls, []
            return RiderCalls(calls, 64, delivered.append, delivered.append) if calls else None

    group.init_slot(free_slot, SlotHyperParams(objective="sft", rank=4, alpha=8, samples_per_step=1), seed=3)
    batch = TrainBatch(samples=[TrainSample(slot=free_slot, tokens=list(range(5, 17)), loss_mask=[0] * 3 + [1] * 9)])
    grad_before = slot_state_tensors_all_ranks(group, lease_slot)[0]["grad"]
    group.attach_riders(Source([Call(lease_slot, _data(7, 2), "cross_entropy")]))
    try:
        result = group.train(batch)
        assert result.stepped == [free_slot]  # the loop's slot stepped ...
        (results,) = delivered
        assert results[0].error is None and len(results[0].outputs) == 2 and results[0].metrics["loss:sum"] > 0
        grad_after = slot_state_tensors_all_ranks(group, lease_slot)[0]["grad"]
        assert any(not torch.equal(grad_after[1][k], grad_before[1][k]) for k in grad_before[1])  # ... the rider accumulated
        group.clear_slot(free_slot)  # the loop's next batch is refused: it raises for the loop, the calls run alone
        group.attach_riders(Source([Call(lease_slot, _data(8, 1), "cross_entropy")]))
        with pytest.raises(ValueError, match=f"slot {free_slot} is not initialized"):
            group.train(batch)
        assert len(delivered) == 2 and delivered[-1][0].error is None and delivered[-1][0].metrics["loss:sum"] > 0
        group.attach_riders(Source([Call(lease_slot, _data(9, 1), "cross_entropy")]))
        group.stop("a rank died")  # a train call that fails midway (no trainer): its calls get the failure
        with pytest.raises(RuntimeError, match="trainer is not running"):
            group.train(batch)
        assert isinstance(delivered[-1], str) and "trainer is not running" in delivered[-1]
    finally:
        group.attach_riders(None)


def test_fleet_backend_equals_in_process_and_leases_registry_slots(ray_cluster, tiny_world, tmp_path):
    from tests.trainer_probes import slot_state_tensors_all_ranks
    from trainer.slot_checkpoint import slot_state_tensors

    from api.tinker.backend import InProcessBackend, LoraSpec
    from api.tinker.fleet_backend import FleetBackend
    from service.config import ServiceSettings, SlotCapacity
    from service.controller import Controller
    from service.trainer_group import TrainerGroup
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=NUM_SLOTS, max_rank=4, micro_batch_tokens=64)
    with pytest.raises(ValueError, match="dp == 1"):
        FleetBackend(TrainerGroup(cfg.model_copy(update={"dp": 2})), None, base_model="m", tokenizer_id="m")  # type: ignore[arg-type]

    controller = Controller(ServiceSettings(state_dir=tmp_path / "state"), SlotCapacity(num_slots=NUM_SLOTS, max_rank=4))
    group = TrainerGroup(cfg, setup_timeout_s=300, call_timeout_s=120)
    try:
        group.start()
        fleet = FleetBackend(group, controller, base_model="m", tokenizer_id="m", max_seq_len=64)
        models = ["s-1:train:0", "s-2:train:0"]
        got_losses = _train(fleet, models)
        leases = controller.slot_leases()
        assert leases == {models[0]: (0, "alice"), models[1]: (1, "alice")}
        assert controller.registry.free_slots() == [2]
        got = {m: slot_state_tensors_all_ranks(group, leases[m][0])[0] for m in models}

        # slots: one more model takes the last slot, the next is refused (registry unchanged), release frees
        fleet.create("s-3:train:0", LoraSpec(rank=4, seed=1), tenant="bob")
        with pytest.raises(ValueError, match=r"no free trainer slot: all 3 slots are held"):
            fleet.create("s-3:train:1", LoraSpec(rank=4, seed=1), tenant="bob")
        assert set(controller.slot_leases()) == {*models, "s-3:train:0"}
        fleet.release(models[0])
        assert controller.registry.free_slots() == [0]
        assert "s-3:train:1" not in fleet._slots  # noqa: SLF001 - the refused model holds nothing
        _riders_on_the_group(group, lease_slot=leases[models[1]][0], free_slot=0)
    finally:
        group.stop()
        controller.close()

    reference = InProcessBackend(MultiLoraTrainer(cfg), base_model="m", tokenizer_id="m", max_seq_len=64)
    ref_losses = _train(reference, models)
    assert max(abs(a - b) / abs(b) for ga, gb in zip(got_losses, ref_losses) for a, b in zip(ga, gb)) < 1e-6
    assert all(t.abs().max() > 0 for m in models for t in got[m]["weight"][1].values())  # B starts at 0: it trained
    for m in models:
        want = slot_state_tensors(reference.trainer, reference._slots[m])  # noqa: SLF001
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            for side in (0, 1):
                for name, t in want[kind][side].items():
                    assert max_rel_err(got[m][kind][side][name], t) < 1e-5, (m, kind, side, name)


def test_fleet_idle_model_evicted_for_a_queued_registration(ray_cluster, tiny_world, tmp_path):
    """Two slots, two Tinker models; a REST registration queues. The coalescer's admit (called
    here directly, as its tick does) evicts the least recently called idle model through the
    trainer group's swap and releases its registry lease; the queue's head binds that slot.
    The evicted model's next call then waits (no slot); once the run retires and its slot is
    free, the model swaps back in with its state bit-identical to before it left."""
    from tests.trainer_probes import slot_state_tensors_all_ranks

    from contextlib import nullcontext

    from api.tinker.backend import LoraSpec, ModelCall
    from api.tinker.fleet_backend import FleetBackend
    from service.config import ServiceSettings, SlotCapacity, load_settings
    from service.controller import Controller
    from service.trainer_group import TrainerGroup
    from trainer.config import TrainerConfig
    from trainer.tinker_ops import AdamStep

    data = tmp_path / "data"
    data.mkdir()
    (data / "rl.jsonl").write_text("".join(f'{{"prompt": "p{i}", "label": "0123"}}\n' for i in range(10)))
    settings = load_settings(state_dir=tmp_path / "state", data_roots=[data])
    assert isinstance(settings, ServiceSettings)
    controller = Controller(settings, SlotCapacity(num_slots=2, max_rank=4))
    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=2, max_rank=4, micro_batch_tokens=64)
    group = TrainerGroup(cfg, setup_timeout_s=300, call_timeout_s=120)
    now = [0.0]
    try:
        group.start()
        fleet = FleetBackend(group, controller, base_model="m", tokenizer_id="m", max_seq_len=64, idle_evict_s=30.0)
        fleet._clock = lambda: now[0]  # noqa: SLF001 - the test moves the idle clock by hand
        a, b = "s-1:train:0", "s-2:train:0"
        fleet.create(a, LoraSpec(rank=4, seed=3), tenant="alice")
        fleet.create(b, LoraSpec(rank=4, seed=4), tenant="bob")
        for m in (a, b):
            assert fleet.forward_backward([ModelCall(m, _data(7, 3), "cross_entropy")])[0].error is None
            fleet.optim_step(m, AdamStep(learning_rate=2e-2, eps=1e-2))
            now[0] += 1.0  # a is called before b: a is the least recently called
        before = slot_state_tensors_all_ranks(group, fleet._slots[a])[0]  # noqa: SLF001

        run = controller.register("rest", {"data": {"path": str(data / "rl.jsonl")}, "reward": {"name": "target_share"}, "rank": 4})
        assert run.queued and controller.slot_demand() == 1
        assert fleet.admit(set(), set()) == {}  # nobody idle yet: nothing evicted
        assert fleet.evicted() == set() and controller.slot_demand() == 1
        now[0] += 100.0
        # Both idle, but with calls riding in the loop's train call: the coalescer's hold_idle (a FAKE
        # here, refusing every model as the real one does for a taken call) keeps them resident (E1)
        alone, fleet.hold_idle = fleet.hold_idle, lambda m: nullcontext(False)
        assert fleet.admit(set(), set()) == {} and fleet.evicted() == set() and controller.slot_demand() == 1
        fleet.hold_idle = alone  # back to the backend alone (no coalescer: every model idle for it)
        assert fleet.admit(set(), {b}) == {}  # b has a queued call: never evicted (E1); a goes
        assert fleet.evicted() == {a} and set(controller.slot_leases()) == {b}
        # The loop's thread's view (backend E4): a is not resident, and its slot lookup there
        # neither swaps it back in nor waits for a lock: the call gets an error instead
        assert not fleet.is_resident(a) and fleet.is_resident(b)
        _, errors = fleet._calls([ModelCall(a, _data(7, 3), "cross_entropy")], bring_in=False)  # noqa: SLF001
        assert "no trainer slot" in errors[0] and fleet.evicted() == {a}
        assert [r.name for r in controller.registry.bind_queued()] == ["rest"]
        assert controller.slot_demand() == 0 and fleet.admit(set(), set()) == {}  # no more evictions
        assert fleet.evicted() == {a}

        assert fleet.forward([ModelCall(b, _data(8, 2), "cross_entropy")])[0].error is None  # b: called just now
        waiting = fleet.admit({a}, {a})  # a's next call: both slots held, none idle -> waits
        assert "waiting for a trainer slot" in waiting[a] and "all 2 slots are held" in waiting[a], waiting
        controller.fail(run.registration_id, "the test ends the run: its slot is free again")
        assert fleet.admit({a}, {a}) == {}  # the run's slot is free: a comes back
        after = slot_state_tensors_all_ranks(group, fleet._slots[a])[0]  # noqa: SLF001
        for kind in ("weight", "grad", "exp_avg", "exp_avg_sq"):
            for side in (0, 1):
                for name, t in before[kind][side].items():
                    assert torch.equal(after[kind][side][name], t), (kind, side, name)
        assert set(controller.slot_leases()) == {a, b} and group.swapped()["keys"] == []
    finally:
        group.stop()
        controller.close()
