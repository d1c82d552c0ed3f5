"""lorafleet's mixed multi-adapter step against an independent reference (fp32, CPU).

Four adapters with different everything (rank, alpha, learning rate, Adam betas and eps,
weight decay, clipping norm, schedule, loss type and normalization, KL coefficient,
batch size, and what they train: attention + MLP + the unembedding (lm_head), MLP + unembedding,
the unembedding alone, attention + MLP) train together in lorafleet's trainer: three mixed calls, with
accumulation across calls, a slot absent from a call and slots stepping twice in one
call. Each adapter is then trained alone by the reference (tests/reference/trainer.py:
HF + peft, torch.optim.AdamW, clip_grad_norm_, LambdaLR, losses from their papers) on
its own samples in arrival order. Per adapter and per update: the same learning rate,
loss and gradient norm, and at the end the same LoRA weights and Adam moments.

Tolerance. The two sides are different implementations of the same fp32 math
(Megatron's fused layers vs Hugging Face's; FINDINGS: logits within 3e-7), so
gradients differ at ~1e-6 relative. Adam's update m / (sqrt(v) + eps) maps a gradient
element within that noise of zero to anything in [-lr, lr] when eps is tiny (see
test_trainer_equivalence.py's module doc), so every adapter here has an eps of 2e-3 or
more (each a different one): the update is then smooth in the gradient and the
comparison measures the trainer, not Adam's conditioning. Measured worst relative
error over all compared quantities: 1.2e-5 (Adam's second moments; losses <= 3.4e-7,
gradient norms <= 3.3e-6, weights <= 5.2e-6); REL_TOL leaves a 4x margin. The four
planted bugs of issue 13 (Adam betas swapped, KL sign flipped, every slot stepping with
the first stepping slot's betas/eps, or with its weight decay) each fail this test by
orders of magnitude more (tests/reference/plant_mutation.py plants them and lists the margins).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

REL_TOL = 5e-5
MICRO_BATCH_TOKENS = 48  # several micro-batches per call, slots sharing them

# Every field differs between adapters; one value of each kind per slot.
HYPERS = [
    dict(objective="rl", rank=4, alpha=8, lr=1e-2, betas=(0.9, 0.999), eps=1e-2, weight_decay=0.0,
         max_grad_norm=1.0, samples_per_step=2, clip_low=0.1, clip_high=0.3, kl_coef=0.0,
         loss_normalization="sequence_mean", targets=("attention", "mlp", "unembed")),
    dict(objective="sft", rank=8, alpha=16, lr=5e-3, betas=(0.8, 0.99), eps=5e-3, weight_decay=0.1,
         max_grad_norm=0.5, samples_per_step=3, lr_schedule="cosine", warmup_steps=1, total_steps=4,
         min_lr_ratio=0.1, loss_normalization="token_mean", targets=("mlp", "unembed")),
    dict(objective="rl", rank=2, alpha=4, lr=2e-2, betas=(0.95, 0.9), eps=2e-2, weight_decay=0.05,
         max_grad_norm=0.05, samples_per_step=1, clip_low=0.2, clip_high=0.28, kl_coef=0.5,
         loss_normalization="token_mean", lr_schedule="cosine", warmup_steps=2, total_steps=5, targets=("unembed",)),
    dict(objective="rl", rank=8, alpha=8, lr=1e-2, betas=(0.5, 0.98), eps=2e-3, weight_decay=0.2,
         max_grad_norm=None, samples_per_step=2, clip_low=0.25, clip_high=0.15, kl_coef=0.2,
         warmup_steps=2, loss_normalization="constant", loss_norm_tokens=12),
]
# Samples per slot in each call: slot 1 accumulates across calls and gets a second phase
# in call 3; slot 2 steps twice in call 3; slot 3 is absent from call 2 and steps twice in call 3.
CALLS = [{0: 2, 1: 2, 2: 1, 3: 2}, {0: 2, 1: 4, 2: 1}, {0: 2, 1: 3, 2: 2, 3: 4}]
UPDATES = [3, 3, 4, 3]  # optimizer updates per slot over the three calls


def make_batches(model_dir, seed=0):
    """Three mixed TrainBatches; RL rollout logprobs = the base's own + noise (some ratios clip)."""
    from transformers import AutoModelForCausalLM

    from trainer.batch import TrainBatch, TrainSample

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    batches = []
    for counts in CALLS:
        samples = []
        for slot, n in counts.items():
            for _ in range(n):
                length = int(torch.randint(7, 16, (1,), generator=g))
                prompt = int(torch.randint(2, 5, (1,), generator=g))
                tokens = torch.randint(0, vocab, (length,), generator=g)
                with torch.no_grad():
                    lp = torch.log_softmax(base(input_ids=tokens[None]).logits[0, :-1], -1)
                    lp = lp.gather(1, tokens[1:, None])[:, 0]
                rollout = [0.0] + (lp + 0.3 * torch.randn(length - 1, generator=g)).clamp(max=0).tolist()
                samples.append(TrainSample(slot=slot, tokens=tokens.tolist(), loss_mask=[0] * prompt + [1] * (length - prompt),
                                           advantage=float(torch.randn(1, generator=g)), rollout_logprobs=rollout))
        order = torch.randperm(len(samples), generator=g).tolist()  # adapters interleaved on the wire
        batches.append(TrainBatch(samples=[samples[i] for i in order]))
    return batches


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    denom = ref.abs().max().item()
    return (got - ref).abs().max().item() / (denom if denom > 0 else 1.0)


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                          micro_batch_tokens=MICRO_BATCH_TOKENS))


@pytest.fixture(scope="module")
def compared(trainer, tiny_world):
    return train_both(trainer, tiny_world / "model")


def train_both(trainer, model_dir):
    """lorafleet mixed run and the reference's per-adapter runs, with everything to compare
    (also the GPU tier's: tests/gpu/test_reference_gpu.py, an fp32 CUDA trainer)."""
    from tests.reference.trainer import train_alone
    from trainer.config import SlotHyperParams

    hypers = [SlotHyperParams(**h) for h in HYPERS]
    batches = make_batches(model_dir)
    inits = {}
    for slot, h in enumerate(hypers):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, h, seed=100 + slot)
        inits[slot] = _cpu(trainer.export.peft_tensors(slot)[1])
    ours = {slot: [] for slot in range(4)}
    for batch in batches:
        result = trainer.train(batch)
        for slot, m in result.slots.items():
            ours[slot] += [dict(update=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr, skipped=r.skipped_nonfinite)
                           for r in m.steps]
    out = {}
    for slot, h in enumerate(hypers):
        own = [s for b in batches for s in b.samples if s.slot == slot]
        ref, reports = train_alone(model_dir, h, inits[slot], own)
        out[slot] = dict(ours=ours[slot], ref=reports, weights=_cpu(trainer.export.peft_tensors(slot)[1]),
                         ref_weights=ref.state(), init=inits[slot], moments=_our_moments(trainer, slot),
                         ref_moments=ref.moments())
    return out


def _cpu(tensors: dict) -> dict:
    return {k: v.cpu() for k, v in tensors.items()}


def _our_moments(trainer, slot):
    """lorafleet's Adam moments of the slot in PEFT names (through its own PEFT mapping)."""
    from trainer.swap.slot_checkpoint import slot_state_tensors

    from trainer.export.peft_io import slot_to_hf

    parts = slot_state_tensors(trainer, slot)
    layers = trainer.slots.trained_layers(trainer.slots[slot].hyper)
    return {kind: _cpu(slot_to_hf(trainer.base, layers, *parts[kind])) for kind in ("exp_avg", "exp_avg_sq")}


def test_each_adapter_matches_the_reference(compared):
    print(f"worst relative error vs the reference: {assert_matches_reference(compared):.2e}")


def assert_matches_reference(compared) -> float:
    """Every compared quantity within REL_TOL; returns the worst relative error."""
    worst = 0.0
    for slot, c in compared.items():
        ours, ref = c["ours"], c["ref"]
        assert len(ours) == len(ref) == UPDATES[slot], (slot, len(ours), len(ref))
        assert [r["update"] for r in ours] == [r["update"] for r in ref]
        assert not any(r["skipped"] for r in ours)
        assert [r["lr"] for r in ours] == pytest.approx([r["lr"] for r in ref], rel=1e-12), slot
        for key in ("loss", "grad_norm"):
            e = rel_err([r[key] for r in ours], [r[key] for r in ref])
            worst = max(worst, e)
            assert e <= REL_TOL, (slot, key, e, [r[key] for r in ours], [r[key] for r in ref])
        assert set(c["weights"]) == set(c["ref_weights"])
        for name, w in c["ref_weights"].items():
            e = rel_err(c["weights"][name], w)
            worst = max(worst, e)
            assert e <= REL_TOL, (slot, name, e)
        # Adam moments: the reference keeps one per unique parameter; tied A's appear under each name.
        for name, (m, v) in c["ref_moments"].items():
            for kind, t in (("exp_avg", m), ("exp_avg_sq", v)):
                e = rel_err(c["moments"][kind][name], t)
                worst = max(worst, e)
                assert e <= REL_TOL, (slot, name, kind, e)
    return worst


def test_the_comparison_is_not_trivial(compared):
    assert_nontrivial(compared)


def assert_nontrivial(compared) -> None:
    """The scenario exercises what it claims to: weights moved (A too), clipping and the
    KL term were live, schedules were not constant, and lorafleet did not copy anything."""
    for slot, c in compared.items():
        moved_a = max(rel_err(c["weights"][k], c["init"][k]) for k in c["init"] if ".lora_A." in k)
        moved_b = max(c["weights"][k].abs().max().item() for k in c["init"] if ".lora_B." in k)
        assert moved_a > 1e-3 and moved_b > 0, (slot, moved_a, moved_b)
    assert any(r["grad_norm"] > 0.05 for r in compared[2]["ref"])  # slot 2's clipping engaged
    assert len({r["lr"] for r in compared[1]["ref"]}) == 3  # warm-up + cosine: three different lrs
    assert [r["lr"] for r in compared[3]["ref"]][:2] == pytest.approx([5e-3, 1e-2])  # linear warm-up
    # each slot's export holds exactly its targets' modules, and the unembedding LoRA moved
    modules = {slot: {k.split(".")[-3] for k in c["weights"]} for slot, c in compared.items()}
    assert modules[0] == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert modules[1] == {"gate_proj", "up_proj", "down_proj", "lm_head"}
    assert modules[2] == {"lm_head"}
    assert "lm_head" not in modules[3] and "q_proj" in modules[3]
    for slot in (0, 1, 2):
        assert c_abs(compared[slot]["weights"], "lm_head.lora_B") > 0, slot


def c_abs(weights, part):
    return max(t.abs().max().item() for k, t in weights.items() if part in k)


def test_targets_off_stay_exactly_zero(trainer, compared):
    """In the trainer's buffers, every layer of a target a slot does not train is exactly zero
    after the whole scenario: weights, gradient and both Adam moments (slots.py invariant)."""
    from trainer.lora.slots import layer_trained

    for slot in range(4):
        hyper = trainer.slots[slot].hyper
        off = [layer for layer in trainer.layers if not layer_trained(layer, hyper)]
        assert off or slot == 0
        for kind in ("weight", "grad", "exp_avg", "exp_avg_sq"):
            a_full, b_full = trainer.slots.read_full(slot, kind, trainer.slots[slot].rank, off)
            assert all(t.abs().max() == 0 for t in (*a_full.values(), *b_full.values())), (slot, kind)
