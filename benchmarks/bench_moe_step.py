"""Expert LoRA on an MoE base: mixed step vs serialized per-adapter steps vs the frozen base.

A Qwen3-30B-A3B-shaped MoE stack (hidden 2048, 32 / 4 heads, head_dim 128, 128 routed
experts of width 768, top-8 with normalized weights, vocab 151936, no shared expert;
random weights) cut to ``--layers`` decoder layers (default 8) so that the base and
the LoRA state of 32 resident adapters fit one H200: one layer holds 623 M base
parameters (1.2 GiB bf16, 97% of it experts), and rank-16 LoRA on attention and on
every expert's fc1/fc2 is 13 M parameters per adapter per layer, i.e. 419 M per layer
for 32 adapters, 6.7 GiB per layer with fp32 weights, gradients and two Adam moments.
8 layers: about 10 GiB of base and 54 GiB of LoRA state at N = 32, leaving room for
the activations of 16384 tokens x top-8. Every layer has the same shape, so the time
per layer carries over to the 48-layer model (x6 for the decoder, plus the unchanged
embedding and output layer).

Built by lorafleet's trainer (trainer/core.py, Megatron-Bridge), N resident slots of
rank 16, 16384 tokens per round, one optimizer step per adapter per round; median of
--iters rounds after a warm-up:

  serialized     N train calls, one per adapter
  mixed          one train call with every adapter's samples (grouped by (expert, adapter));
                 on CUDA the expert LoRA runs the segmented Triton kernels
                 (trainer/kernels/triton_expert_lora.py, lora_rank_kernels auto)
  mixed_library  the same call with lora_rank_kernels 'library': expert LoRA on grouped_mm
                 over (expert, adapter) groups in chunks of 1023 (the path before the kernels)
  frozen base    the same micro-batches with LoRA off, gradient to the input embeddings

Cases (N x sequences x length): 1 x 16 x 1024, 8 x 2 x 1024, 32 x 1 x 512. It also
probes the grouped GEMM group-count limit on the device (one call with 1023, 1024 and
2048 groups) and reports it. Needs only torch, transformers, megatron-core/-bridge and
pydantic (no ray, fastapi, sglang).

  python -m benchmarks.bench_moe_step --out moe.json     # GPU, bf16 (about 3 minutes on an H200)
  python -m benchmarks.bench_moe_step --only mixed,base --profile-out prof  # + torch.profiler tables and host syncs per case
  python -m benchmarks.bench_moe_step --tiny             # CPU smoke test (tiny shape)
  python -m benchmarks.bench_moe_step --n 32 --only mixed,mixed_b2b,mixed_b2b_in_order --state-dtype bfloat16
                                                         # every adapter with the compact optimizer state

--state-dtype: every adapter's AdamW moments in that storage (SlotHyperParams.state_dtype;
bfloat16 = the compact state, trainer/optim/compact_state.py). The step's memory traffic per
stepped LoRA parameter is then 36 bytes (fp32: the gradient norm's read, then weight, gradient and
both moments read and written) or 28 (bf16 moments); each case prints the step phase's effective
rate at that count (``# step ...``: the step_ms of ``mixed``, which includes the gradient norms).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks.bench_mixed_step import (  # noqa: E402
    PhaseTimer,
    back_to_back_modes,
    back_to_back_table,
    init_slots,
    make_samples,
    measure_modes,
    profile_round,
    timer_for,
    with_routing,
)
from benchmarks.failures import describe_failure  # noqa: E402
from benchmarks.sync_census import sync_sites  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     norm_topk_prob=True, rope_theta=1e6)
TINY = dict(vocab_size=400, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True, rope_theta=1e4)
GIB = 2**30


def write_config(shape: dict, layers: int, folder: str) -> str:
    """A config-only HF folder (no weights): the trainer builds it with random_init=True."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**shape, num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         attention_bias=False, torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(folder)
    return folder


def probe_group_limit(hidden: int, rank: int) -> dict:
    """Does one grouped_mm call take 1023 / 1024 / 2048 groups here (x [T, hidden] @ A_g.T)?"""
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        return {"device": "cpu", "note": "CPU grouped_mm: no group limit probed"}
    out = {}
    for groups in (1023, 1024, 2048):
        x = torch.randn(groups * 4, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(groups, rank, hidden, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(4, groups * 4 + 1, 4, device="cuda", dtype=torch.int32)
        try:
            y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
            ref = torch.einsum("gtk,grk->gtr", x.view(groups, 4, hidden).float(), w.float()).reshape(-1, rank)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            out[groups] = f"ok (max rel err {err:.1e})"
        except Exception as e:  # noqa: BLE001 - reported as the finding
            out[groups] = describe_failure(e, 200)
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.trainer_floor import frozen_base_pass

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape, 512 tokens, 2 iterations: a CPU smoke test")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; tiny 2)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per round (default 16384; tiny 512)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=None, help="timed rounds per mode (default 3; tiny 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="measure every mode this many times, alternating")
    ap.add_argument("--n", default="1,8,32", help="comma list of N (adapters)")
    ap.add_argument("--only", default="serialized,mixed,mixed_library,base",
                    help="comma list of modes: serialized,mixed,mixed_library,base,mixed_b2b,mixed_b2b_in_order,base_b2b "
                         "(the last three: rounds back to back, bench_mixed_step.timed_back_to_back)")
    ap.add_argument("--attention-only", action="store_true", help="adapters without expert LoRA (lora_experts false)")
    ap.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="every adapter's optimizer state (SlotHyperParams.state_dtype; bfloat16: the compact state)")
    ap.add_argument("--profile-out", default=None, help="folder for torch.profiler tables (mixed and base) of each case")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)

    from trainer.batch import TrainBatch
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer

    shape = TINY if args.tiny else QWEN3_30B_A3B
    layers = args.layers or (2 if args.tiny else 8)
    tokens = args.tokens or (512 if args.tiny else 16384)
    iters = args.iters or (2 if args.tiny else 3)
    ns = [int(x) for x in args.n.split(",")]
    modes = args.only.split(",")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    limit = probe_group_limit(shape["hidden_size"], args.rank)
    print(f"# grouped_mm group-count probe: {limit}", flush=True)

    with tempfile.TemporaryDirectory() as folder:
        cfg = TrainerConfig(base_model_path=write_config(shape, layers, folder), random_init=True,
                            num_slots=max(ns), max_rank=args.rank, micro_batch_tokens=tokens)
        t0 = time.perf_counter()
        trainer = MultiLoraTrainer(cfg)
        build_s = time.perf_counter() - t0
    phases = PhaseTimer(trainer)
    lora_params = sum(p.numel() for p in trainer.buffers.params)
    params = sum(p.numel() for p in trainer.base.model.parameters()) - lora_params
    print(f"# {device}, {trainer.base.dtype}, {layers} layers, {params / 1e9:.2f} B base params, built in {build_s:.1f} s, "
          f"{max(ns)} slots x rank {args.rank} ({lora_params / 1e6:.0f} M LoRA params, experts "
          f"{'off' if args.attention_only else 'on'})", flush=True)

    results = []
    for n in ns:
        length = min(1024, tokens // n)
        seqs = tokens // (n * length)
        samples = make_samples(n, seqs, length, shape["vocab_size"], "sft")
        per_adapter = [TrainBatch(samples=[s for s in samples if s.slot == k]) for k in range(n)]
        mixed = TrainBatch(samples=samples)
        init_slots(trainer, n, seqs, args.rank, "sft")
        if args.attention_only or args.state_dtype != "float32":
            for slot in range(n):
                update = {"lora_experts": not args.attention_only, "state_dtype": args.state_dtype}
                hyper = SlotHyperParams(**(trainer.slots[slot].hyper.model_dump() | update))
                trainer.clear_slot(slot)
                trainer.init_slot(slot, hyper, seed=slot)
        row = {"n": n, "seqs": seqs, "len": length, "tokens": n * seqs * length}

        def run_serialized():
            for b in per_adapter:
                assert len(trainer.train(b).stepped) == 1

        def run_mixed():
            assert len(trainer.train(mixed).stepped) == n

        runners = {"serialized": run_serialized, "mixed": run_mixed, "mixed_library": with_routing(trainer, "rank_kernels", "library", run_mixed),
                   "base": lambda: frozen_base_pass(trainer, mixed)}
        runners.update(back_to_back_modes(trainer, run_mixed, runners["base"]))
        def measure(mode: str) -> dict:
            return timer_for(mode)(runners[mode], iters, args.warmup, phases if mode != "base" else None)

        measure_modes(row, modes, args.repeats, measure, f"N={n:3d} x {seqs:2d} x {length:5d}")
        row["step_traffic"] = step_traffic(row, n * lora_params // max(ns), args.state_dtype)
        print(f"# step N={n}: {row['step_traffic']}", flush=True)
        results.append(row)
        if args.profile_out:
            tag = f"moe_n{n}x{seqs}x{length}"
            profile_round(trainer, mixed, args.profile_out, tag)
            row["syncs"] = sync_sites(trainer, mixed, args.profile_out, tag)

    print()
    print(table(results))
    print()
    print(back_to_back_table(results))
    print(f"\nreproduce: python -m benchmarks.bench_moe_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": str(trainer.base.dtype), "layers": layers, "params": params,
                       "lora_params": lora_params, "rank": args.rank, "group_limit_probe": limit,
                       "attention_only": args.attention_only, "state_dtype": args.state_dtype, "results": results}, f, indent=2)
    return 0


# Memory traffic of the step per stepped LoRA parameter, by state dtype: the gradient norm reads the
# gradient (4); AdamW reads and writes the fp32 weight and gradient (16: the gradient is zeroed) and
# both moments, fp32 (16) or bf16 (8).
STEP_BYTES = {"float32": 36, "bfloat16": 28}


def step_traffic(row: dict, stepped_params: int, state_dtype: str) -> dict:
    """The step phase's bytes and effective rate (mixed mode's step_ms), for the JSON and the log."""
    nbytes = stepped_params * STEP_BYTES[state_dtype]
    step_ms = row.get("mixed", {}).get("step_ms")
    return {"state_dtype": state_dtype, "stepped_params": stepped_params, "bytes_per_param": STEP_BYTES[state_dtype],
            "gbytes": round(nbytes / 1e9, 2), "step_ms": step_ms,
            "gbytes_per_s": round(nbytes / 1e9 / (step_ms / 1e3), 1) if step_ms else None}


def table(results: list[dict]) -> str:
    def get(row, mode, key="ms"):
        return row.get(mode, {}).get(key)

    def fmt(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = ["| N adapters x seqs x len | serialized ms | mixed ms (fwd+bwd / step / rest) | frozen base ms | mixed / base "
             "| serialized / mixed | mixed, library kernels, ms (fwd+bwd) / base | peak GiB serialized / mixed / base |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, m, b, lib = get(r, "serialized"), get(r, "mixed"), get(r, "base"), get(r, "mixed_library")
        split = " / ".join(fmt(get(r, "mixed", k)) for k in ("fwd_bwd_ms", "step_ms", "other_ms"))
        peaks = " / ".join(fmt(get(r, k, "peak_gib"), ".1f") for k in ("serialized", "mixed", "base"))
        library = f"{fmt(lib)} ({fmt(get(r, 'mixed_library', 'fwd_bwd_ms'))}) / {fmt(lib / b if lib and b else None, '.2f')}"
        lines.append(f"| {r['n']} x {r['seqs']} x {r['len']} | {fmt(s)} | {fmt(m)} ({split}) | {fmt(b)} | "
                     f"{fmt(m / b if m and b else None, '.2f')} | {fmt(s / m if s and m else None, '.1f')} | {library} | "
                     f"{peaks} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
