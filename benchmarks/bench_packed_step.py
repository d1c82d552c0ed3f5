"""Packed vs padded on a realistic RL batch, and the largest tokens-per-step that fits.

(b) tokens/s: a batch of RL samples (prompt 128-512 tokens uniform, response 32-2048
    long-tailed: lognormal, median 300, clipped), spread over N adapter slots, through
    the frozen 1.7B Qwen3-shaped base with lorafleet's fused attention and chunked
    log-probs, forward + backward:
      packed         micro-batches of at most --max-tokens tokens, one stream each, slots contiguous
      padded         micro-batches of --pad-batch samples in arrival order, each padded to its longest
      padded_sorted  the same after sorting samples by length (the best padding can do)
    Reported: real (non-pad) tokens/s, tokens actually computed, peak GiB.
(c) memory: peak GiB of one packed step at two sizes (2048-token sequences) gives
    fixed + per-token memory; from it the largest tokens-per-step that fits the device
    next to N=64 resident rank-16 LoRA slots (weights, grads, Adam moments in fp32),
    checked by running that size; without and with full activation recomputation.

  python -m benchmarks.bench_packed_step --out packed.json                 # GPU
  python -m benchmarks.bench_packed_step --shape tiny --smoke              # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import time

from benchmarks.bench_frozen_base import (  # noqa: E402  (sets TORCHDYNAMO_DISABLE first)
    GIB,
    SHAPES,
    build_megatron,
    free,
    mcore_packed_step,
    setup_parallel,
    sync,
)
from benchmarks.failures import describe_failure  # noqa: E402

import torch  # noqa: E402


def rl_batch(n_samples: int, n_slots: int, vocab: int, seed: int = 0, scale: float = 1.0):
    """Token sequences (prompt + response) and their slot ids, in arrival order."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(128, 513, (n_samples,), generator=g).float()
    responses = torch.exp(math.log(300) + 1.0 * torch.randn(n_samples, generator=g)).clamp(32, 2048)
    lengths = [max(2, int((p + r).item() * scale)) for p, r in zip(prompts, responses)]
    slots = torch.randint(0, n_slots, (n_samples,), generator=g).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    return seqs, slots


def lora_state_gib(shape: dict, n_slots: int, rank: int) -> float:
    """fp32 weights + grads + Adam m, v of N rank-r LoRA slots on qkv, proj, fc1, fc2."""
    h, q_out = shape["hidden"], shape["heads"] * shape["head_dim"]
    qkv_out = q_out + 2 * shape["kv_heads"] * shape["head_dim"]
    dims = (h + qkv_out) + (q_out + h) + (h + 2 * shape["ffn"]) + (shape["ffn"] + h)
    params = n_slots * rank * dims * shape["num_layers"]
    return params * 16 / GIB


def packed_micro_batches(seqs, slots, n_slots, max_tokens, device):
    from trainer.base.packing import pack_sequences, split_by_token_budget

    groups = split_by_token_budget([len(s) for s in seqs], slots, max_tokens)
    return [pack_sequences([seqs[i] for i in g], [slots[i] for i in g], n_slots, device=device) for g in groups]


def padded_micro_batches(seqs, slots, pad_batch, device, sort_by_length=False):
    """(PaddedBatch, slot ids) per micro-batch; rows sorted by slot inside each (LoRA routing)."""
    from tests.padded_batch import pad_sequences

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i])) if sort_by_length else list(range(len(seqs)))
    out = []
    for j in range(0, len(order), pad_batch):
        rows = sorted(order[j : j + pad_batch], key=lambda i: slots[i])
        out.append((pad_sequences([seqs[i] for i in rows], device=device), [slots[i] for i in rows]))
    return out


# ---- optional: helper-1's multi-LoRA slots (trainer/lora/multi_lora.py) on the same base ----------


class _Mapping:
    def __init__(self, hf_param):
        self.hf_param = hf_param


class _RandomBase:
    """What install_multi_lora needs from a FrozenBase, for a random model without an HF
    checkpoint: the model, its device, and the fused kind of each linear (by name)."""

    def __init__(self, model, device):
        self.model, self.device = model, device

    def hf_mapping(self, name):
        if name.endswith("linear_qkv.weight"):
            return _Mapping({"q": "q", "k": "k", "v": "v"})
        if name.endswith("linear_fc1.weight"):
            return _Mapping({"gate": "gate", "up": "up"})
        return _Mapping(name)


def install_lora(model, device, n_slots, rank):
    from trainer.lora.multi_lora import SlotRouting, install_multi_lora

    routing = SlotRouting(n_slots, kernel="auto")
    layers = install_multi_lora(
        _RandomBase(model, device), target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
        num_slots=n_slots, max_rank=rank, routing=routing, tp_group=None,
    )
    g = torch.Generator(device=device).manual_seed(0)
    for layer in layers:
        with torch.no_grad():
            layer.lora_A.normal_(0.0, 0.01, generator=g)
            layer.lora_B.normal_(0.0, 0.01, generator=g)
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
    scales = torch.full((n_slots,), 2.0, device=device)
    return routing, scales, layers


def route_packed(routing, packed, scales):
    """SlotRouting for a packed stream ([T, 1, h]: b = 1, s = T; slot segments from packing)."""
    routing.set_packed(packed, scales)


def padded_step(model, batch):
    """Right-padded rows, causal attention (pads never reach real tokens), pads ignored in the loss."""
    from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

    targets, valid = batch.next_token_targets()
    pos = batch.position_ids
    emb = model.embedding(batch.tokens, pos).detach().requires_grad_()
    lp = model(batch.tokens, pos, None, decoder_input=emb, output_processor=LogprobOutputProcessor(),
               output_processor_context=targets)
    loss = -(lp.sum() / valid.sum())
    loss.backward()
    return loss.detach()


def time_batch(run_all, iters: int) -> tuple[float, float]:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run_all()  # warm-up
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run_all()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    return sorted(times)[len(times) // 2], peak


def bench_tokens_per_second(model, seqs, slots, n_slots, max_tokens, pad_batch, iters, device, lora=None) -> dict:
    """``lora``: (routing, scales) of installed multi-LoRA slots, or None for the frozen base."""
    real = sum(len(s) for s in seqs)
    out = {"samples": len(seqs), "slots": n_slots, "real_tokens": real, "lora": lora is not None,
           "max_len": max(len(s) for s in seqs), "mean_len": real / len(seqs)}
    cases = {
        "packed": packed_micro_batches(seqs, slots, n_slots, max_tokens, device),
        "padded": padded_micro_batches(seqs, slots, pad_batch, device),
        "padded_sorted": padded_micro_batches(seqs, slots, pad_batch, device, sort_by_length=True),
    }

    def packed_one(b):
        if lora is not None:
            route_packed(lora[0], b, lora[1])
        return mcore_packed_step(model, b)

    def padded_one(item):
        batch, row_slots = item
        if lora is not None:
            lora[0].set(torch.tensor(row_slots), batch.tokens.shape[1], lora[1])
        return padded_step(model, batch)

    for name, batches in cases.items():
        step = packed_one if name == "packed" else padded_one
        computed = sum((b if name == "packed" else b[0]).tokens.numel() for b in batches)
        try:
            sec, peak = time_batch(lambda: [step(b) for b in batches], iters)
            out[name] = {"micro_batches": len(batches), "computed_tokens": computed, "s_per_batch": sec,
                         "real_tokens_per_s": real / sec, "peak_gib": peak}
            print(f"{'lora ' if lora else ''}{name:14s} {len(batches):3d} mb  {computed:7d} tok computed  "
                  f"{sec * 1e3:8.1f} ms  {real / sec:9.0f} real tok/s  peak {peak:6.1f} GiB", flush=True)
        except Exception as exc:
            out[name] = {"error": describe_failure(exc)}
            print(f"{name}: FAILED {describe_failure(exc)}", flush=True)
        free()
    if lora is not None:
        lora[0].disable()
    if "real_tokens_per_s" in out.get("packed", {}) and "real_tokens_per_s" in out.get("padded", {}):
        out["packed_over_padded"] = out["packed"]["real_tokens_per_s"] / out["padded"]["real_tokens_per_s"]
    return out


def one_packed_step_peak(model, tokens: int, seq_len: int, vocab: int, device) -> dict:
    """Peak GiB (or OOM) of one packed step of ``tokens`` tokens in ``seq_len``-token sequences."""
    from trainer.base.packing import pack_sequences

    n = max(1, tokens // seq_len)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (seq_len,), generator=g) for _ in range(n)]
    packed = pack_sequences(seqs, [i % 64 for i in range(n)], 64, device=device)
    free()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        mcore_packed_step(model, packed)
        sync()
    except torch.cuda.OutOfMemoryError:
        del packed
        free()
        return {"tokens": n * seq_len, "oom": True}
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else 0.0
    reserved = torch.cuda.max_memory_reserved() / GIB if torch.cuda.is_available() else 0.0
    del packed
    free()
    return {"tokens": n * seq_len, "oom": False, "peak_gib": peak, "reserved_gib": reserved, "s": sec,
            "tokens_per_s": n * seq_len / sec}


def bench_max_tokens(shape, dtype, device, recompute, lora_gib, probe, cap_tokens, seq_len=2048) -> dict:
    model = build_megatron(shape, "fused", dtype, recompute=recompute)
    try:
        total = torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 0.0
        a = one_packed_step_peak(model, probe[0], seq_len, shape["vocab"], device)
        b = one_packed_step_peak(model, probe[1], seq_len, shape["vocab"], device)
        out = {"recompute": recompute, "device_gib": total, "lora_state_gib_n64_r16": lora_gib, "probes": [a, b]}
        if a["oom"] or b["oom"]:
            return out
        per_token = (b["peak_gib"] - a["peak_gib"]) / (b["tokens"] - a["tokens"])
        fixed = a["peak_gib"] - per_token * a["tokens"]
        # Leave the LoRA slots their room, and 3 GiB for allocator slack and the CUDA context.
        budget = total - lora_gib - 3.0
        predicted = int((budget - fixed) / per_token)
        out.update(per_token_kib=per_token * 2**20, fixed_gib=fixed, predicted_max_tokens=predicted)
        tried = []
        target = min(predicted, cap_tokens) // seq_len * seq_len
        for _ in range(3):  # step down 10% on OOM (fragmentation the linear fit does not see)
            r = one_packed_step_peak(model, target, seq_len, shape["vocab"], device)
            tried.append(r)
            if not r["oom"]:
                break
            target = int(target * 0.9) // seq_len * seq_len
        out["verified"] = tried
        out["capped"] = predicted > cap_tokens
        ok = [r for r in tried if not r["oom"]]
        if ok:
            print(f"recompute={recompute}: {per_token * 2**20:.1f} KiB/token + {fixed:.1f} GiB fixed -> predicted "
                  f"{predicted} tokens; ran {ok[0]['tokens']} tokens at peak {ok[0]['peak_gib']:.1f} GiB "
                  f"({ok[0]['tokens_per_s']:.0f} tok/s)", flush=True)
        return out
    finally:
        del model
        free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16384, help="packed micro-batch budget")
    parser.add_argument("--pad-batch", type=int, default=8, help="samples per padded micro-batch")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--cap-tokens", type=int, default=524288, help="largest size the memory check runs")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--skip", default="", help="comma list of parts to skip: tokens,lora,memory")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    shape = SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setup_parallel()
    scale = 0.05 if args.smoke else 1.0
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    skip = set(filter(None, args.skip.split(",")))
    seqs, slots = rl_batch(args.samples, args.slots, shape["vocab"], scale=scale)
    budget = max(1, int(args.max_tokens * scale))
    if "tokens" not in skip:
        model = build_megatron(shape, "fused", dtype)
        result["tokens_per_s"] = bench_tokens_per_second(
            model, seqs, slots, args.slots, budget, args.pad_batch, args.iters, device
        )
        del model
        free()
    if "lora" not in skip:
        try:  # the mixed step's model: trainer/lora/multi_lora.py slots on every linear
            model = build_megatron(shape, "fused", dtype)
            routing, scales, _ = install_lora(model, device, args.slots, args.lora_rank)
            result["lora_tokens_per_s"] = bench_tokens_per_second(
                model, seqs, slots, args.slots, budget, args.pad_batch, args.iters, device, lora=(routing, scales)
            )
        except Exception as exc:
            result["lora_tokens_per_s"] = {"error": describe_failure(exc)}
            print(f"lora: FAILED {describe_failure(exc)}", flush=True)
        model = None
        free()
    if "memory" not in skip and device.type == "cuda":
        lora = lora_state_gib(shape, 64, 16)
        probe = (16384, 32768)
        result["max_tokens"] = [
            bench_max_tokens(shape, dtype, device, rc, lora, probe, args.cap_tokens) for rc in ("none", "full")
        ]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
