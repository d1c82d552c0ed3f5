"""The export write off the trainer's critical path (issue 18, trainer/export/export_writer.py), with real
Ray and the real trainer on the tiny world (fp32, CPU): one TrainerGroup rank shared by the module.

Proved by order, never by time: a named fault injection (tests/trainer_probes.py `hold_export_writes`)
holds rank 0's writer thread, so a train call that completes while the writer is held did not
wait for the write, and the folder it then writes must still hold the weights of the step before
the export (the snapshot is taken in call order, not by the writer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.local_ray import start_ray, stop_ray
from tests.trainer_probes import train_batch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def group(tiny_world):
    from service.fleet.trainer_group import TrainerGroup
    from trainer.config import SlotHyperParams, TrainerConfig

    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=2, max_rank=4, micro_batch_tokens=64)
    g = TrainerGroup(cfg, setup_timeout_s=300, call_timeout_s=60)  # a tiny call takes < 1 s
    try:
        g.start()
        g.init_slot(0, SlotHyperParams(rank=4, alpha=8, lr=1e-2, samples_per_step=2, objective="sft"), seed=0)
        yield g
    finally:
        g.stop()
        stop_ray()


def _batch(seed: int):
    from trainer.batch import TrainBatch, TrainSample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(2):
        n = int(torch.randint(6, 12, (1,), generator=gen))
        samples.append(TrainSample(slot=0, tokens=torch.randint(0, 400, (n,), generator=gen).tolist(),
                                   loss_mask=[0, 0] + [1] * (n - 2)))
    return TrainBatch(samples=samples)


def _folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


def _assert_same(x: Path, y: Path) -> None:
    (cx, tx), (cy, ty) = _folder(x), _folder(y)
    assert cx == cy
    assert sorted(tx) == sorted(ty)
    for name in tx:
        assert torch.equal(tx[name], ty[name]), name


def _hold(group, held: bool) -> None:
    """The named fault injection, in the actor's fault concurrency group: it reaches the rank
    whatever its other threads are doing."""
    from tests.trainer_probes import hold_export_writes

    hold_export_writes(group, held)


def test_background_export_is_the_snapshot_step_and_the_next_train_does_not_wait(group, tmp_path):
    import ray

    assert train_batch(group, _batch(1)).stepped == [0]
    group.export_peft(0, tmp_path / "sync-step1")  # synchronous: the step-1 weights
    _hold(group, True)
    try:
        refs = group.begin_export_peft(0, tmp_path / "bg")
        # Submitted right after the export: it changes the weights. It completes while the writer
        # is held, so it did not wait for the write.
        assert train_batch(group, _batch(2)).stepped == [0]
        assert not (tmp_path / "bg").exists()
        ready, _ = ray.wait(refs[-1:], timeout=0)
        assert ready == []  # the held writer cannot have finished: wait_export is still waiting
    finally:
        _hold(group, False)
    assert ray.get(refs, timeout=120)[-1] == str(tmp_path / "bg")
    # the background folder equals the synchronous export of the same (step-1) weights, tensor by tensor
    _assert_same(tmp_path / "bg", tmp_path / "sync-step1")
    # ...and the step-2 weights are different (so the comparison above can fail)
    group.export_peft(0, tmp_path / "sync-step2")
    _, step1 = _folder(tmp_path / "sync-step1")
    _, step2 = _folder(tmp_path / "sync-step2")
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bg", "sync-step1", "sync-step2"]  # no temporaries left


def test_background_exports_queue_in_order_while_held(group, tmp_path):
    import ray

    _hold(group, True)
    try:
        first = group.begin_export_peft(0, tmp_path / "v1")
        assert train_batch(group, _batch(3)).stepped == [0]
        second = group.begin_export_peft(0, tmp_path / "v2")
        assert train_batch(group, _batch(4)).stepped == [0]
        group.export_peft(0, tmp_path / "sync-v3")  # the synchronous export does not queue behind the held writer
    finally:
        _hold(group, False)
    ray.get(first + second, timeout=120)
    _, v1 = _folder(tmp_path / "v1")
    _, v2 = _folder(tmp_path / "v2")
    _, v3 = _folder(tmp_path / "sync-v3")
    # three distinct versions, each the weights at its own point of the call order
    assert any(not torch.equal(v1[k], v2[k]) for k in v1) and any(not torch.equal(v2[k], v3[k]) for k in v2)


def test_failed_write_or_snapshot_makes_the_awaited_call_raise(group, tmp_path):
    import ray

    from rollout.engines.weights import PendingFolder

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "handoff" / "v1"  # cannot be created: its parent is a regular file
    refs = group.begin_export_peft(0, bad)
    with pytest.raises(Exception, match="a-file"):
        ray.get(refs, timeout=120)
    # the rollout worker's view of it (PendingFolder.ready, what publish_version awaits) raises too,
    # which fails the publish; the loop's settle_publishes republishes it (tests of the runtime)
    with pytest.raises(Exception, match="a-file"):
        asyncio.run(PendingFolder(bad, group.begin_export_peft(0, bad)).ready())
    # a snapshot that fails (a slot not in use) fails the awaited call instead of leaving it waiting
    with pytest.raises(Exception, match="slot 1 is not initialized"):
        ray.get(group.begin_export_peft(1, tmp_path / "free-slot"), timeout=120)
    # the writer survives failures: the next export is written
    ray.get(group.begin_export_peft(0, tmp_path / "ok"), timeout=120)
    assert (tmp_path / "ok" / "adapter_model.safetensors").is_file()


def test_publish_folder_in_bf16_is_the_fp32_weights_rounded(group, tmp_path):
    """engines.publish_dtype (issue 18 item 3): the trainer casts the snapshot to the engines' dtype
    before its copy to host; the folder holds exactly the fp32 weights rounded to it, under the same
    adapter_config. Checkpoints and the synchronous export stay fp32 unless told."""
    import ray

    assert train_batch(group, _batch(5)).stepped == [0]
    group.export_peft(0, tmp_path / "fp32")  # the default: the weights as trained
    ray.get(group.begin_export_peft(0, tmp_path / "bf16", "bfloat16"), timeout=120)
    group.export_peft(0, tmp_path / "fp16", "float16")  # the synchronous publish (an adapter's first version)
    cfg32, fp32 = _folder(tmp_path / "fp32")
    assert {t.dtype for t in fp32.values()} == {torch.float32}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cfg, low = _folder(tmp_path / name)
        assert cfg == cfg32
        assert sorted(low) == sorted(fp32)
        for key in fp32:
            assert low[key].dtype == dtype, key
            assert torch.equal(low[key], fp32[key].to(dtype)), key
        # the rounding changes values (so the equality above is not the fp32 file re-read)
        assert any(not torch.equal(low[k].float(), fp32[k]) for k in fp32)
        # and the trained B blocks are in it (a step happened: B is no longer its zero init)
        assert any(k.endswith("lora_B.weight") and low[k].abs().sum() > 0 for k in low)
    # a dtype the trainer cannot write is refused before any rank is called; nothing is written
    with pytest.raises(ValueError, match="unknown export dtype 'int8'; allowed: float32, bfloat16, float16"):
        group.begin_export_peft(0, tmp_path / "bad", "int8")
    assert not (tmp_path / "bad").exists()
