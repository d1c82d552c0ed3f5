"""Expert LoRA on the tiny Qwen3-MoE through Megatron-Bridge (fp32, CPU).

* Equivalence: the dense proof's scenario (tests/integration/test_trainer_equivalence.py:
  three train calls over 4 slots, different ranks, schedules, clipping, normalizations,
  accumulation across calls, a slot stepping twice) on the MoE base, with one slot training
  attention only: every adapter gets the weights, Adam moments, losses and gradient norms
  it gets alone (max relative error <= 1e-5), for RL, SFT and both mixed; the loop kernel
  gives what grouped_mm gives.
* Isolation: training some slots leaves the others bit-identical; an attention-only slot
  keeps exactly zero expert weights.
* Export: the slot as a PEFT adapter (attention target_modules + expert target_parameters)
  loaded by HF+peft gives the trainer's logits; independently of the trainer's grouped
  GEMMs, since HF runs its own expert loop and PEFT its own expert delta.
* Checkpoint: a slot state saved and loaded into another slot is the same slot.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.export_check import export_matches_full_tensors

from tests.integration.test_trainer_equivalence import (
    OBJECTIVES,
    _assert_nontrivial,
    PADDED_TOL,
    assert_equivalent,
    make_batches,
    make_hypers,
    run_scenario,
)
from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

ATTENTION_ONLY_SLOT = 3  # trains attention LoRA only (lora_experts false)


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


@pytest.fixture(scope="module")
def trainer(moe_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    cfg = TrainerConfig(base_model_path=str(moe_world / "model"), num_slots=4, max_rank=8, micro_batch_tokens=40)
    return MultiLoraTrainer(cfg)


@pytest.fixture(scope="module")
def batches(trainer):
    return make_batches(trainer)


def moe_hypers(objectives, **kw):
    # the dense scenario's hyper-parameters with attention + MLP targets for every slot (its slots 1
    # and 2 also train the unembedding, which this module does not test)
    hypers = [h.model_copy(update={"targets": ("attention", "mlp")}) for h in make_hypers(OBJECTIVES[objectives], **kw)]
    hypers[ATTENTION_ONLY_SLOT] = hypers[ATTENTION_ONLY_SLOT].model_copy(update={"lora_experts": False})
    return hypers


def expert_layers(trainer):
    from trainer.lora.moe_lora import is_expert_layer

    return [layer for layer in trainer.layers if is_expert_layer(layer)]


def test_the_base_is_moe_and_experts_carry_slots(trainer):
    layers = expert_layers(trainer)
    assert len(layers) == 8  # 4 MoE layers x (fc1, fc2)
    fc1 = layers[0]
    assert tuple(fc1.lora_A.shape) == (4, 8, 8, 64) and tuple(fc1.lora_B.shape) == (4, 8, 64, 8)


@pytest.fixture(scope="module")
def mixed_run(trainer, batches):
    return run_scenario(trainer, moe_hypers("mixed"), batches)


@pytest.mark.parametrize("objectives", ["rl", "sft"])
def test_mixed_step_equals_each_adapter_alone(trainer, batches, objectives):
    run = run_scenario(trainer, moe_hypers(objectives), batches)
    _assert_nontrivial(run, OBJECTIVES[objectives])
    assert_equivalent(run["mixed"], run["alone"])
    _assert_experts_trained(run, trainer)


def test_mixed_objectives_equal_each_adapter_alone(mixed_run, trainer):
    _assert_nontrivial(mixed_run, OBJECTIVES["mixed"])
    assert_equivalent(mixed_run["mixed"], mixed_run["alone"])
    _assert_experts_trained(mixed_run, trainer)


def _assert_experts_trained(run, trainer):
    """Expert B moved away from zero for expert slots; the attention-only slot's state holds no
    expert tensors (a slot's state holds the layers it trains, trainer/swap/slot_checkpoint.py: the
    others are exactly zero, which tests/reference/test_trainer_against_reference.py checks)."""
    names = [layer.name for layer in expert_layers(trainer)]
    for slot in range(4):
        a, b = run["mixed"][slot]["tensors"]["weight"]
        if slot == ATTENTION_ONLY_SLOT:
            assert not set(names) & (set(a) | set(b))
        else:
            assert max(b[n].abs().max().item() for n in names) > 0


def test_loop_kernel_equals_grouped_mm(trainer, batches, mixed_run):
    trainer.routing.kernel = "loop"
    try:
        run = run_scenario(trainer, moe_hypers("mixed"), batches)
    finally:
        trainer.routing.kernel = "auto"
    assert_equivalent(run["mixed"], mixed_run["mixed"])


def test_triton_expert_kernels_equal_grouped_mm(trainer, batches):
    """The segmented Triton kernels (Triton's interpreter here; at TP 1 the fused expert
    linear, trainer/lora/expert_lora_nodes.py) train what grouped_mm trains: the scenario's first
    two calls (accumulation across them, slots of different ranks, the attention-only slot),
    the same weights, moments, losses and gradient norms; and mixed equals alone. With
    ``lora_rank_kernels: triton`` as a user sets it, so the attention LoRA's rank kernels
    (triton_lora.py) run in the interpreter too."""
    from trainer.kernels import triton_expert_lora

    calls = []
    real_shrink = triton_expert_lora.shrink

    def counted_shrink(*args, **kwargs):
        calls.append(1)
        return real_shrink(*args, **kwargs)

    reference = run_scenario(trainer, moe_hypers("mixed"), batches[:2])  # grouped_mm (the CPU default)
    assert not calls
    trainer.routing.rank_kernels = "triton"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_expert_lora, "shrink", counted_shrink)
        try:
            run = run_scenario(trainer, moe_hypers("mixed"), batches[:2])
        finally:
            trainer.routing.rank_kernels = "auto"
    assert calls  # the expert path really ran on the Triton kernels
    assert_equivalent(run["mixed"], reference["mixed"])
    assert_equivalent(run["mixed"], run["alone"])
    _assert_experts_trained(run, trainer)


def _snapshot(trainer):
    return {slot: [t[slot].clone() for t in [p.data for p in trainer.buffers.params] + [p.grad for p in trainer.buffers.params]
                   + trainer.buffers.exp_avg_views + trainer.buffers.exp_avg_sq_views] for slot in range(4)}


def _fresh(trainer, hypers):
    for slot, h in enumerate(hypers):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, h, seed=200 + slot)


def test_isolation_other_slots_unchanged(trainer, batches):
    from trainer.batch import TrainBatch

    _fresh(trainer, moe_hypers("mixed"))
    before = _snapshot(trainer)
    own = [s for s in batches[0].samples if s.slot in (0, 2)]
    res = trainer.train(TrainBatch(samples=own))
    assert res.stepped == [0, 2]
    after = _snapshot(trainer)
    for slot in (1, 3):
        for x, y in zip(before[slot], after[slot]):
            assert torch.equal(x, y), f"slot {slot} changed"
    assert not torch.equal(before[0][1], after[0][1])  # slot 0 stepped: its first B moved


def _hf_peft_logits(hf_model, folder, ids):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model, str(folder))
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        model.unload()


def test_export_parity_with_hf_peft(trainer, batches, moe_world, tmp_path):
    from tests.trainer_probes import forward_logits

    from transformers import AutoModelForCausalLM

    _fresh(trainer, moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    hf = AutoModelForCausalLM.from_pretrained(moe_world / "model", dtype=torch.float32).eval()
    ids = torch.randint(0, 400, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = hf(ids).logits
    for slot in (0, ATTENTION_ONLY_SLOT):
        folder = trainer.export.export_peft(slot, tmp_path / f"slot{slot}")
        cfg = json.loads((tmp_path / f"slot{slot}" / "adapter_config.json").read_text())
        assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        if slot == ATTENTION_ONLY_SLOT:
            assert "target_parameters" not in cfg
        else:
            assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        ours = forward_logits(trainer, ids, slot)
        ref = _hf_peft_logits(hf, folder, ids)
        assert (ours - ref).abs().max().item() <= 1e-5
        assert (ref - base_logits).abs().max().item() > 1e-3  # the adapter really changes the output


def test_expert_part_of_the_export_matters(trainer, batches, tmp_path):
    """Dropping the expert tensors from the export changes the logits: the parity above
    really covers the expert LoRA."""
    from tests.trainer_probes import forward_logits

    from trainer.export.peft_io import write_peft_folder

    _fresh(trainer, moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    cfg, tensors = trainer.export.peft_tensors(0)
    ids = torch.randint(0, 400, (1, 9), generator=torch.Generator().manual_seed(6))
    full = forward_logits(trainer, ids, 0)
    expert_keys = [k for k in tensors if ".mlp.experts." in k]
    assert len(expert_keys) == 4 * 2 * 2  # layers x (gate_up, down) x (A, B)
    trainer.clear_slot(0)
    trainer.init_slot(0, moe_hypers("mixed")[0].model_copy(update={"lora_experts": False}), seed=0)
    attention_only = {k: v for k, v in tensors.items() if k not in expert_keys}
    cfg_attention = {k: v for k, v in cfg.items() if k != "target_parameters"}
    write_peft_folder(tmp_path / "attn", cfg_attention, attention_only)
    trainer.clear_slot(0)
    trainer.init_slot(0, moe_hypers("mixed")[0].model_copy(update={"lora_experts": False}), seed=0,
                      init_from=tmp_path / "attn")
    assert (forward_logits(trainer, ids, 0) - full).abs().max().item() > 1e-4


def test_checkpoint_round_trip(trainer, batches, tmp_path):
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state, slot_state_tensors

    from trainer.batch import TrainBatch

    _fresh(trainer, moe_hypers("mixed"))
    trainer.train(batches[0])
    trainer.train(TrainBatch(samples=[s for s in batches[1].samples if s.slot == 1][:1]))  # slot 1 pending
    saved = slot_state_tensors(trainer, 1)
    save_slot_state(trainer, 1, tmp_path / "s1")
    trainer.clear_slot(3)
    load_slot_state(trainer, 3, tmp_path / "s1")
    loaded = slot_state_tensors(trainer, 3)
    for kind in saved:
        for side in (0, 1):
            for name, t in saved[kind][side].items():
                assert torch.equal(loaded[kind][side][name], t), (kind, name)
    assert trainer.slots.expert_scales[3] == trainer.slots.expert_scales[1] > 0


def test_start_from_an_exported_expert_adapter(trainer, batches, tmp_path):
    """init_from reads the expert LoRA back (target_parameters): the new slot computes what the
    exported one computes; a slot whose lora_experts is false refuses it and nothing changes."""
    from tests.trainer_probes import forward_logits
    from trainer.swap.slot_checkpoint import slot_state_tensors

    _fresh(trainer, moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    hyper = moe_hypers("mixed")[0]
    folder = trainer.export.export_peft(0, tmp_path / "experts")
    ids = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(7))
    want = forward_logits(trainer, ids, 0)
    trainer.clear_slot(3)
    trainer.init_slot(3, hyper, seed=0, init_from=folder)
    assert (forward_logits(trainer, ids, 3) - want).abs().max().item() <= 1e-5
    for name, t in slot_state_tensors(trainer, 0)["weight"][0].items():
        assert torch.equal(slot_state_tensors(trainer, 3)["weight"][0][name], t), name

    trainer.clear_slot(3)
    before = _snapshot(trainer)
    with pytest.raises(ValueError, match="has expert LoRA .* but the slot's lora_experts is false"):
        trainer.init_slot(3, hyper.model_copy(update={"lora_experts": False}), seed=0, init_from=folder)
    assert slot_status(trainer, 3) == {"slot": 3, "active": False}
    after = _snapshot(trainer)
    for slot in range(4):
        for x, y in zip(before[slot], after[slot]):
            assert torch.equal(x, y)


# -- two gloo processes: tensor parallel 2 (experts split over TP) and data parallel 2 -------------------


def _parallel_worker(rank, port, cfg_kwargs, hypers, batches, out_path):
    import torch.distributed as dist

    from trainer.kernels import triton_expert_lora
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    calls = []
    real_shrink = triton_expert_lora.shrink
    triton_expert_lora.shrink = lambda *a, **k: calls.append(1) or real_shrink(*a, **k)  # counts the expert path's use
    trainer = MultiLoraTrainer(TrainerConfig(**cfg_kwargs), rank=rank, master_port=port)
    result = run_scenario(trainer, hypers, batches)
    result["expert_triton_calls"] = len(calls)
    result["export_check"] = export_matches_full_tensors(trainer, hypers, batches[0], f"{out_path}.export")
    if rank == 0:
        torch.save(result, out_path)
    dist.barrier()
    dist.destroy_process_group()


# tp-triton runs the Triton kernels in the interpreter on two ranks: about 5 minutes on the shared
# 2-core machine, so opt-in (-m slow); the delta node it exercises is the one the tp case runs
# (same all-reduces), and its Triton kernels have the one-rank proofs above and in tests/unit.
@pytest.mark.parametrize("layout", ["tp", "dp", pytest.param("tp-triton", marks=pytest.mark.slow)])
def test_two_ranks_equivalence(trainer, batches, mixed_run, tmp_path, layout):
    """TP=2: each rank holds half of every expert's width (fc1 column-, fc2 row-parallel) and
    the matching half of its LoRA; DP=2: each rank routes its own micro-batches; tp-triton:
    TP=2 with the expert LoRA on the segmented Triton kernels (the delta node, its TP
    all-reduces around them), against one rank on grouped_mm."""
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    parallel, _, kernels = layout.partition("-")
    cfg_kwargs = trainer.config.model_dump() | {parallel: 2} | ({"lora_rank_kernels": kernels} if kernels else {})
    out = tmp_path / f"{layout}2.pt"
    mp.spawn(_parallel_worker, args=(free_loopback_port(), cfg_kwargs, moe_hypers("mixed"), batches, str(out)),
             nprocs=2, join=True)
    run = torch.load(out, weights_only=False)
    _assert_nontrivial(run, OBJECTIVES["mixed"])
    assert (run["expert_triton_calls"] > 0) == (kernels == "triton")  # the expert path the layout names ran
    # the publish export (row snapshot, experts included) == the per-layer gather, in both layouts
    check = run["export_check"]
    assert check["names"] > 0 and check["mismatches"] == [], check
    # Under DP a slot's gradient is the all-reduced sum of each rank's part, and which samples a
    # rank gets differs between the mixed and the alone runs (dp_shard of each phase), so the
    # fp32 summation order differs too: measured 1.01e-5 on slot 2 (clipped, token_mean, lr
    # 2e-2, 4 steps). TP keeps the 1e-5 bound of the one-rank proofs.
    tol = 3e-5 if parallel == "dp" else 1e-5
    assert_equivalent(run["mixed"], run["alone"], tol=tol)
    # and two ranks compute what one computes, up to the same fp32 summation order
    assert_equivalent(run["mixed"], mixed_run["mixed"], tol=3e-5)


def test_padded_micro_batches_route_each_sample_to_its_slot(moe_world, batches, mixed_run):
    """Padded rows ([s, b] activations, several samples of different slots side by side):
    the MoE layer maps Megatron's position-major tokens back to their samples' slots."""
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    padded = MultiLoraTrainer(TrainerConfig(base_model_path=str(moe_world / "model"), num_slots=4, max_rank=8,
                                            micro_batch_tokens=40, packed=False))
    run = run_scenario(padded, moe_hypers("mixed"), batches)
    assert_equivalent(run["mixed"], run["alone"], tol=PADDED_TOL)  # padded rows' own fp32 order
    assert_equivalent(run["mixed"], mixed_run["mixed"], tol=PADDED_TOL)  # padded computes what packed computes
