"""GPU tier of the unembedding LoRA (lm_head): bf16 against fp32 on CUDA, and the chunked path's memory.

* The chunked log-probs with a per-slot LoRA on the logits (trainer/kernels/chunked_logprobs.py LogitLora)
  at a real vocabulary (151936, Qwen3's): bf16 values and gradients (hidden, z, B) against the fp32
  run of the same function, and the fp32 run against the full-logits reference; the peak memory of
  the chunked bf16 forward+backward stays far below the full fp32 logits alone (it never makes
  them), while the full path's peak is above them.
* The trainer on the tiny model on CUDA: slots with the unembedding among their targets, the same
  three train calls in bf16 and in fp32 (both on the device): losses and weights at bf16 tolerance
  (test_trainer_gpu.py's), and the unembedding's B trained.

Skipped without CUDA. ``LORAFLEET_GPU_TESTS_ON_CPU=1`` runs the same checks on the CPU at a small
vocabulary (the memory check needs CUDA's allocator statistics and is skipped there).
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("LORAFLEET_GPU_TESTS_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not ON_CPU, reason="needs a CUDA device"),
]
DEV = torch.device("cuda" if torch.cuda.is_available() and not ON_CPU else "cpu")
# Qwen3's vocabulary at 16k tokens on the device; a small problem on the CPU.
T, H, V, R, N = (16384, 1024, 151936, 16, 8) if DEV.type == "cuda" else (512, 64, 1000, 8, 8)
CHUNK = 2048 if DEV.type == "cuda" else 96
SEGMENTS = [(0, 0, T // 4), (2, T // 4, T // 2), (5, T // 2 + 7, T - 3)]  # slot 1's tokens (T/2 .. T/2+7) train none
LOSS_TOL = 5e-2  # tests/gpu/test_trainer_gpu.py's bf16 tolerances
TENSOR_TOL = 1e-1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _problem(dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g) * H**-0.5 * 2
    t = torch.randint(0, V, (T,), generator=g)
    t[:: 97] = -100
    z = torch.randn(T, R, generator=g) * 0.5
    b = torch.randn(N, V, R, generator=g) * 0.3
    up = torch.randn(T, generator=g)
    return [x.to(DEV, dtype) if x.is_floating_point() else x.to(DEV) for x in (h, w, t, z, b, up)]


def _run(fn, dtype, **kw):
    from trainer.kernels.chunked_logprobs import LogitLora

    h, w, t, z, b, up = _problem(dtype)
    h, z, b = (x.requires_grad_() for x in (h, z, b))
    lp = fn(h, w, t, lora=LogitLora(z=z, lora_b=b, segments=SEGMENTS), **kw)
    (lp * up.float()).sum().backward()
    return lp.detach(), h.grad, z.grad, b.grad


def test_chunked_unembed_lora_bf16_against_fp32_and_the_full_reference():
    from tests.reference.token_logprobs import full_token_logprobs
    from trainer.kernels.chunked_logprobs import chunked_token_logprobs

    f32 = _run(chunked_token_logprobs, torch.float32, chunk_size=CHUNK)
    ref = _run(full_token_logprobs, torch.float32)
    for name, a, r in zip(("logprobs", "dh", "dz", "dB"), f32, ref):
        assert rel(a, r) <= 1e-4, (name, rel(a, r))  # fp32 both ways (TF32 off by default for matmul)
    bf16 = _run(chunked_token_logprobs, torch.bfloat16, chunk_size=CHUNK)
    errs = {name: rel(a, r) for name, a, r in zip(("logprobs", "dh", "dz", "dB"), bf16, f32)}
    print("unembed LoRA chunked, bf16 vs fp32 (relative norm):", {k: f"{v:.2e}" for k, v in errs.items()})
    assert errs["logprobs"] <= 2e-2 and all(v <= 5e-2 for v in errs.values()), errs
    assert bf16[3][1].abs().max() == 0 and bf16[3][0].abs().max() > 0  # slot 1 (no segment) gets no dB


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA allocator statistics")
def test_chunked_path_never_holds_the_full_logits():
    from tests.reference.token_logprobs import full_token_logprobs
    from trainer.kernels.chunked_logprobs import chunked_token_logprobs

    full_logits_bytes = T * V * 4  # the fp32 [tokens x vocabulary] logits alone
    peaks = {}
    for name, fn, kw in (("chunked", chunked_token_logprobs, dict(chunk_size=CHUNK)), ("full", full_token_logprobs, {})):
        inputs = _problem(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        from trainer.kernels.chunked_logprobs import LogitLora

        h, w, t, z, b, up = inputs
        h, z, b = (x.requires_grad_() for x in (h, z, b))
        lp = fn(h, w, t, lora=LogitLora(z=z, lora_b=b, segments=SEGMENTS), **kw)
        (lp * up.float()).sum().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del h, w, t, z, b, up, lp, inputs
        torch.cuda.empty_cache()
    gib = {k: round(v / 2**30, 2) for k, v in peaks.items()}
    print(f"peak above inputs, GiB: {gib}; fp32 logits alone {full_logits_bytes / 2**30:.2f} GiB")
    assert peaks["chunked"] < 0.5 * full_logits_bytes, gib
    assert peaks["full"] > full_logits_bytes, gib  # the reference really is the full-logits footprint


def _trainer(tiny_world, dtype):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                          micro_batch_tokens=48, dtype=dtype))


def _scenario(trainer):
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams

    targets = [("attention", "mlp", "unembed"), ("unembed",), ("mlp", "unembed"), ("attention", "mlp")]
    for slot, tg in enumerate(targets):
        trainer.init_slot(slot, SlotHyperParams(rank=4, alpha=8, lr=2e-2, eps=1e-2, samples_per_step=2,
                                                objective="sft" if slot % 2 else "rl", targets=tg), seed=40 + slot)
    losses = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        samples = []
        for slot in (0, 0, 1, 1, 2, 2, 3, 3):
            n = int(torch.randint(8, 16, (1,), generator=g))
            samples.append(TrainSample(slot=slot, tokens=torch.randint(0, 400, (n,), generator=g).tolist(),
                                       loss_mask=[0, 0] + [1] * (n - 2), advantage=float(torch.randn(1, generator=g))))
        res = trainer.train(TrainBatch(samples=samples))
        losses.append([res.slots[s].loss for s in range(4)])
    return losses, {slot: trainer.export.peft_tensors(slot)[1] for slot in range(4)}


def test_trainer_unembed_bf16_against_fp32_on_the_device(tiny_world):
    losses16, w16 = _scenario(_trainer(tiny_world, "bfloat16"))
    losses32, w32 = _scenario(_trainer(tiny_world, "float32"))
    worst_loss = max(abs(a - b) / max(abs(b), 1e-6) for r16, r32 in zip(losses16, losses32) for a, b in zip(r16, r32))
    worst_w = max(rel(w16[s][k], w32[s][k]) for s in range(4) for k in w32[s])
    print(f"trainer with unembedding LoRA, bf16 vs fp32: losses {worst_loss:.2e}, weights {worst_w:.2e}")
    assert worst_loss <= LOSS_TOL and worst_w <= TENSOR_TOL, (worst_loss, worst_w)
    for slot in (0, 1, 2):
        assert w32[slot]["base_model.model.lm_head.lora_B.weight"].abs().max() > 0
    assert "base_model.model.lm_head.lora_B.weight" not in w32[3]
