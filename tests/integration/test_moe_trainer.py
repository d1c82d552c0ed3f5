"""Expert LoRA on the tiny Qwen3-MoE through Megatron-Bridge (fp32, CPU).

* Equivalence: the dense proof's scenario (tests/integration/test_trainer_equivalence.py:
  three train calls over 4 slots, different ranks, schedules, clipping, normalizations,
  accumulation across calls, a slot stepping twice) on the MoE base, with one slot training
  attention only: every adapter gets the weights, Adam moments, losses and gradient norms
  it gets alone (max relative error <= MOE_TOL), for RL, SFT and both mixed; the loop kernel
  gives what grouped_mm gives, bit for bit.
* Isolation: training some slots leaves the others bit-identical; an attention-only slot
  keeps exactly zero expert weights.
* Export: the slot as a PEFT adapter (attention target_modules + expert target_parameters)
  loaded by HF+peft gives the trainer's logits; independently of the trainer's grouped
  GEMMs, since HF runs its own expert loop and PEFT its own expert delta.
* Checkpoint: a slot state saved and loaded into another slot is the same slot.

The bounds, derived as the dense module's (its docstring: mixed and alone are two fp32
reduction orders; benchmarks/fp32_cpu_orders.py measures every proof under six CPU kernel
profiles; a bound is the worst a profile reached times the larger of 3 and the spread between
profiles). The MoE scenario is noisier than the dense one: a sample alone puts one to three
tokens on an expert, and MKL rounds GEMMs of 3 rows or fewer another way; the worst quantities
are the A moments of slot 2's expert fc1 after its second step (A's gradient is proportional to
B after one update, a sum with much cancellation: relative noise 1e-5 at 1e-7 magnitudes).

    bound           proofs                                         worst (profile)             spread  bound
    MOE_TOL         mixed vs alone (rl, sft, mixed); TP=2 and      1.26e-5 (zen3-like, DP=2)    1.4x    4e-5
                    DP=2 mixed vs alone; padded rows mixed vs
                    alone and vs packed
    TWO_CALLS_TOL   the Triton test: Triton mixed vs alone, and    2.09e-5 (mkl-compatible)     3.4x    8e-5
                    against grouped_mm (two calls: nothing
                    dilutes those A moments yet)
    LOGITS_TOL      an exported slot's logits against HF+peft      2.86e-6 (every profile)      1.0x    9e-6
                    (absolute)

Two ranks against one take test_trainer_equivalence.py's ACROSS_LAYOUTS_TOL (worst here 1.08e-5).
A slot started from another's export computes bit for bit what it computes (same weights, same
shapes, same reduction order). Plants (measured): issue 13's first_weight_decay gives mixed vs
alone 1.3e-4 (slot 1), first_betas_eps 4.3; on the Triton path a tile reaching one row into the
next group 2.3e-2, each row scaled with its neighbour's slot scale 0.9.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.export_check import export_matches_full_tensors

from tests.integration.test_trainer_equivalence import (
    ACROSS_LAYOUTS_TOL,
    OBJECTIVES,
    _assert_nontrivial,
    assert_equivalent,
    make_batches,
    make_hypers,
    run_scenario,
    scenario_config,
)
from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

# Bounds for two fp32 reduction orders, derived from six CPU kernel profiles (module doc)
MOE_TOL = 4e-5  # worst 1.26e-5
TWO_CALLS_TOL = 8e-5  # the Triton test's two calls (worst 2.09e-5)
LOGITS_TOL = 9e-6  # absolute, an exported slot vs HF+peft (worst 2.86e-6)
ATTENTION_ONLY_SLOT = 3  # trains attention LoRA only (lora_experts false)


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


@pytest.fixture(scope="module")
def trainer(moe_world):
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(scenario_config(moe_world))


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
    assert_equivalent(run["mixed"], run["alone"], tol=MOE_TOL)
    _assert_experts_trained(run, trainer)


def test_mixed_objectives_equal_each_adapter_alone(mixed_run, trainer):
    _assert_nontrivial(mixed_run, OBJECTIVES["mixed"])
    assert_equivalent(mixed_run["mixed"], mixed_run["alone"], tol=MOE_TOL)
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
    """Bit for bit, expert GEMMs included: grouped_mm off CUDA is one mm per group, as the loop
    (test_trainer_equivalence.py's test of the same name)."""
    trainer.routing.kernel = "loop"
    try:
        run = run_scenario(trainer, moe_hypers("mixed"), batches)
    finally:
        trainer.routing.kernel = "auto"
    assert_equivalent(run["mixed"], mixed_run["mixed"], tol=0.0)


def test_triton_expert_kernels_equal_grouped_mm(trainer, batches):
    """The segmented Triton kernels (Triton's interpreter here; at TP 1 the fused expert
    linear, trainer/lora/expert_lora_nodes.py) train what grouped_mm trains: the scenario's first
    two calls (accumulation across them, slots of different ranks, the attention-only slot),
    the same weights, moments, losses and gradient norms; and mixed equals alone. With
    ``lora_rank_kernels: triton`` as a user sets it, so the attention LoRA's rank kernels
    (triton_lora.py) run in the interpreter too.

    Both comparisons are two fp32 reduction orders (Triton's tiles against MKL's GEMMs; mixed
    against alone, module doc), within TWO_CALLS_TOL: two calls, not three, to keep the
    interpreter's time down, so slot 2's A moments come from one gradient proportional to B
    after one update (the module doc's worst quantity) with no third call to dilute them.
    1e-5 held where numpy's OpenBLAS runs its Haswell kernels (9.96e-6) and failed where it runs
    its SkylakeX kernels (1.15e-5, a Zen 5 EPYC); on MKL's compatible path 2.09e-5."""
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
    assert_equivalent(run["mixed"], reference["mixed"], tol=TWO_CALLS_TOL)
    assert_equivalent(run["mixed"], run["alone"], tol=TWO_CALLS_TOL)
    _assert_experts_trained(run, trainer)


def _snapshot(trainer):
    return {slot: [t[slot].clone() for t in [p.data for p in trainer.buffers.params] + [p.grad for p in trainer.buffers.params]
                   + trainer.buffers.exp_avg_views + trainer.buffers.exp_avg_sq_views] for slot in range(4)}


def fresh_slots(trainer, hypers):
    for slot, h in enumerate(hypers):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, h, seed=200 + slot)


def test_isolation_other_slots_unchanged(trainer, batches):
    from trainer.batch import TrainBatch

    fresh_slots(trainer, moe_hypers("mixed"))
    before = _snapshot(trainer)
    own = [s for s in batches[0].samples if s.slot in (0, 2)]
    res = trainer.train(TrainBatch(samples=own))
    assert res.stepped == [0, 2]
    after = _snapshot(trainer)
    for slot in (1, 3):
        for x, y in zip(before[slot], after[slot]):
            assert torch.equal(x, y), f"slot {slot} changed"
    assert not torch.equal(before[0][1], after[0][1])  # slot 0 stepped: its first B moved


def export_ids() -> torch.Tensor:
    """The token ids the export parity runs on (2 sequences of 17)."""
    return torch.randint(0, 400, (2, 17), generator=torch.Generator().manual_seed(5))


def hf_peft_logits(hf_model, folder, ids):
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

    fresh_slots(trainer, moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    hf = AutoModelForCausalLM.from_pretrained(moe_world / "model", dtype=torch.float32).eval()
    ids = export_ids()
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
        ref = hf_peft_logits(hf, folder, ids)
        assert (ours - ref).abs().max().item() <= LOGITS_TOL
        assert (ref - base_logits).abs().max().item() > 1e-3  # the adapter really changes the output


def test_expert_part_of_the_export_matters(trainer, batches, tmp_path):
    """Dropping the expert tensors from the export changes the logits: the parity above
    really covers the expert LoRA."""
    from tests.trainer_probes import forward_logits

    from trainer.export.peft_io import write_peft_folder

    fresh_slots(trainer, moe_hypers("mixed"))
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

    fresh_slots(trainer, moe_hypers("mixed"))
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

    fresh_slots(trainer, moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    hyper = moe_hypers("mixed")[0]
    folder = trainer.export.export_peft(0, tmp_path / "experts")
    ids = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(7))
    want = forward_logits(trainer, ids, 0)
    trainer.clear_slot(3)
    trainer.init_slot(3, hyper, seed=0, init_from=folder)
    assert torch.equal(forward_logits(trainer, ids, 3), want)  # one reduction order: bit for bit
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


def two_rank_worker(rank, port, cfg_kwargs, hypers, batches, out_path):
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
    mp.spawn(two_rank_worker, args=(free_loopback_port(), cfg_kwargs, moe_hypers("mixed"), batches, str(out)),
             nprocs=2, join=True)
    run = torch.load(out, weights_only=False)
    _assert_nontrivial(run, OBJECTIVES["mixed"])
    assert (run["expert_triton_calls"] > 0) == (kernels == "triton")  # the expert path the layout names ran
    # the publish export (row snapshot, experts included) == the per-layer gather, in both layouts
    check = run["export_check"]
    assert check["names"] > 0 and check["mismatches"] == [], check
    # Two reduction orders, as on one rank; under DP also which samples a rank gets (dp_shard of
    # each phase) and the all-reduce of the parts: MOE_TOL covers both layouts (module doc).
    assert_equivalent(run["mixed"], run["alone"], tol=MOE_TOL)
    # and two ranks compute what one computes, up to another summation order of the same products
    assert_equivalent(run["mixed"], mixed_run["mixed"], tol=ACROSS_LAYOUTS_TOL)


def test_padded_micro_batches_route_each_sample_to_its_slot(moe_world, batches, mixed_run):
    """Padded rows ([s, b] activations, several samples of different slots side by side):
    the MoE layer maps Megatron's position-major tokens back to their samples' slots."""
    from trainer.core import MultiLoraTrainer

    padded = MultiLoraTrainer(scenario_config(moe_world, packed=False))
    run = run_scenario(padded, moe_hypers("mixed"), batches)
    assert_equivalent(run["mixed"], run["alone"], tol=MOE_TOL)  # padded rows' own fp32 order
    assert_equivalent(run["mixed"], mixed_run["mixed"], tol=MOE_TOL)  # padded computes what packed computes
