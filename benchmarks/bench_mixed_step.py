"""Mixed-adapter step vs serialized per-adapter steps vs the frozen base alone.

A Qwen3-1.7B-shaped decoder (28 layers, hidden 2048, 16/8 heads, head_dim 128,
ffn 6144, vocab 151936, tied; random weights) built through Megatron-Bridge by
lorafleet's trainer (trainer/core.py), N resident LoRA slots of rank 16 on every
linear (qkv, proj, fc1, fc2), 16384 tokens per round, one optimizer step per
adapter per round. Per round, median over --iters after a warm-up:

  serialized  N train calls, one per adapter (each forward+backward+step alone)
  mixed       one train call with every adapter's samples (lorafleet's step)
  frozen base forward+backward of the same micro-batches with LoRA off, gradient to the
              input embeddings only (the floor any LoRA step sits on)

Cases (N adapters x sequences per adapter x length): 1x16x1024, 4x4x1024,
16x1x1024, 64x1x256 and 32x1x512. Prints a markdown table (median ms, peak GiB
per mode) and writes --out JSON.

  python -m benchmarks.bench_mixed_step --out mixed.json        # GPU, bf16 (8192-token micro-batches)
  python -m benchmarks.bench_mixed_step --tiny                  # CPU smoke test (tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
TINY = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4)
GIB = 2**30


def write_config(shape: dict, folder: str) -> str:
    """A config-only HF folder (no weights): the trainer builds it with random_init=True."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      attention_bias=False, torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(folder)
    return folder


def cases(tokens: int, max_len: int) -> list[tuple[int, int, int]]:
    """(N adapters, sequences per adapter, length) with N * seqs * length == tokens."""
    out = []
    for n in (1, 4, 16, 64):
        length = min(max_len, tokens // n)
        out.append((n, tokens // (n * length), length))
    out.append((32, 1, tokens // 32))
    return out


def make_samples(n: int, seqs: int, length: int, vocab: int, objective: str, seed: int = 0):
    from trainer.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for slot in range(n):
        for _ in range(seqs):
            tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
            mask = [0] + [1] * (length - 1)
            if objective == "rl":
                out.append(TrainSample(slot=slot, tokens=tokens, loss_mask=mask, advantage=float(torch.randn(1, generator=g)),
                                       rollout_logprobs=[-(vocab**0.5) / 10.0] * length))
            else:
                out.append(TrainSample(slot=slot, tokens=tokens, loss_mask=mask))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int) -> tuple[float, float | None]:
    """(median ms, peak GiB; None without CUDA) of fn()."""
    for _ in range(warmup):
        fn()
    sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None
    return statistics.median(times), peak


def frozen_base_round(trainer, samples) -> None:
    """The same micro-batches as the trainer's, LoRA off, loss = sum of token log-probs,
    backward to the input embeddings only (the base is frozen)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from trainer.base_model import causal_mask
    from trainer.batch import PlannedSample, pack_micro_batches

    model, dev = trainer.base.model, trainer.device
    planned = [PlannedSample(i, s.slot, 0) for i, s in enumerate(samples)]
    lengths = [len(s.tokens) for s in samples]
    trainer.routing.disable()
    for mb in pack_micro_batches(planned, lengths, trainer.config.micro_batch_tokens):
        s = max(lengths[p.index] for p in mb)
        ids = torch.zeros(len(mb), s, dtype=torch.long)
        for j, p in enumerate(mb):
            ids[j, : lengths[p.index]] = torch.tensor(samples[p.index].tokens)
        ids = ids.to(dev)
        labels = torch.roll(ids, -1, dims=1)
        pos = torch.arange(s, device=dev).unsqueeze(0).expand(len(mb), s)
        emb = model.embedding(ids, pos).detach().requires_grad_()
        logits = model(ids, pos, causal_mask(s, dev), decoder_input=emb, runtime_gather_output=False)
        loss = vocab_parallel_cross_entropy(logits.float(), labels).sum()
        loss.backward()


def init_slots(trainer, n: int, seqs: int, rank: int, objective: str) -> None:
    from trainer.config import SlotHyperParams

    hyper = SlotHyperParams(rank=rank, alpha=2.0 * rank, lr=1e-4, samples_per_step=seqs, objective=objective)
    for slot in range(trainer.config.num_slots):
        if trainer.slot_status(slot)["active"]:
            trainer.clear_slot(slot)
    for slot in range(n):
        trainer.init_slot(slot, hyper, seed=slot)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape, 512 tokens, 2 iterations: a CPU smoke test")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per round (default 16384; tiny 512)")
    ap.add_argument("--max-len", type=int, default=None, help="longest sequence (default 1024; tiny 64)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="padded tokens per micro-batch (default 8192: two micro-batches per round; tiny: --tokens)")
    ap.add_argument("--kernel", choices=["auto", "grouped_mm", "loop"], default="auto")
    ap.add_argument("--objective", choices=["sft", "rl"], default="sft")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds per mode (default 5; tiny 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma list of modes: serialized,mixed,base")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)

    from trainer.batch import TrainBatch
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    shape = TINY if args.tiny else QWEN3_1_7B
    tokens = args.tokens or (512 if args.tiny else 16384)
    max_len = args.max_len or (64 if args.tiny else 1024)
    iters = args.iters or (2 if args.tiny else 5)
    modes = (args.only or "serialized,mixed,base").split(",")
    plan = cases(tokens, max_len)
    num_slots = max(n for n, _, _ in plan)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    with tempfile.TemporaryDirectory() as folder:
        cfg = TrainerConfig(base_model_path=write_config(shape, folder), random_init=True, num_slots=num_slots,
                            max_rank=args.rank, lora_kernel=args.kernel,
                            micro_batch_tokens=args.micro_batch_tokens or (tokens if args.tiny else 8192))
        t0 = time.perf_counter()
        trainer = MultiLoraTrainer(cfg)
        build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in trainer.base.model.parameters())
    print(f"# {device}, {trainer.base.dtype}, {params / 1e9:.3f} B params, built in {build_s:.1f} s, "
          f"{num_slots} slots x rank {args.rank}, kernel {args.kernel}, objective {args.objective}", flush=True)

    results = []
    for n, seqs, length in plan:
        samples = make_samples(n, seqs, length, shape["vocab_size"], args.objective)
        per_adapter = [TrainBatch(samples=[s for s in samples if s.slot == k]) for k in range(n)]
        mixed = TrainBatch(samples=samples)
        init_slots(trainer, n, seqs, args.rank, args.objective)
        row = {"n": n, "seqs": seqs, "len": length, "tokens": n * seqs * length}

        def run_serialized():
            for b in per_adapter:
                res = trainer.train(b)
                assert len(res.stepped) == 1

        def run_mixed():
            res = trainer.train(mixed)
            assert len(res.stepped) == n

        runners = {"serialized": run_serialized, "mixed": run_mixed, "base": lambda: frozen_base_round(trainer, samples)}
        for mode in modes:
            try:
                ms, peak = timed(runners[mode], iters, args.warmup)
                row[mode] = {"ms": ms, "peak_gib": peak}
            except torch.cuda.OutOfMemoryError as err:  # report, keep going
                row[mode] = {"error": f"OOM: {err}".splitlines()[0]}
                torch.cuda.empty_cache()
            print(f"N={n:3d} x {seqs:2d} x {length:5d}  {mode:10s} {row[mode]}", flush=True)
        results.append(row)

    print()
    print(table(results, modes))
    print(f"\nreproduce: python -m benchmarks.bench_mixed_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": str(trainer.base.dtype), "params": params, "rank": args.rank,
                       "kernel": args.kernel, "objective": args.objective, "results": results}, f, indent=2)
    return 0


def table(results: list[dict], modes: list[str]) -> str:
    def ms(row, mode):
        return row.get(mode, {}).get("ms")

    def fmt(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = [
        "| N adapters x seqs x len | serialized ms | mixed ms | frozen base ms | mixed / base | serialized / mixed | peak GiB serialized / mixed / base |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, m, b = ms(r, "serialized"), ms(r, "mixed"), ms(r, "base")
        peaks = " / ".join(fmt(r.get(k, {}).get("peak_gib"), ".1f") for k in ("serialized", "mixed", "base"))
        lines.append(
            f"| {r['n']} x {r['seqs']} x {r['len']} | {fmt(s)} | {fmt(m)} | {fmt(b)} | "
            f"{fmt(m / b if m and b else None, '.2f')} | {fmt(s / m if s and m else None, '.1f')} | {peaks} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
