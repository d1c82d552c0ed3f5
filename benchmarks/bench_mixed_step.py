"""Mixed-adapter step vs serialized per-adapter steps vs the frozen base alone.

A Qwen3-1.7B-shaped decoder (28 layers, hidden 2048, 16/8 heads, head_dim 128,
ffn 6144, vocab 151936, tied; random weights) built through Megatron-Bridge by
lorafleet's trainer (trainer/core.py), N resident LoRA slots of rank 16 on every
linear (qkv, proj, fc1, fc2), 16384 tokens per round, one optimizer step per
adapter per round. Per round, median over --iters after a warm-up:

  serialized  N train calls, one per adapter (each forward+backward+step alone)
  mixed       one train call with every adapter's samples (lorafleet's step)
  frozen base the same micro-batches along the same path (benchmarks/trainer_floor.py frozen_base_pass:
              packed/fused/chunked as configured) with LoRA off, gradient to the input
              embeddings only (the floor any LoRA step sits on)

The trainer runs with its defaults (packed micro-batches, fused attention without
TransformerEngine, chunked log-probs, no recomputation) unless flags say otherwise.
The mixed and serialized rounds are broken down into forward+backward, optimizer step
(normalize, clip, AdamW of the stepping slots) and the rest (batch planning, packing,
host work), each timed with a device sync.

Cases (N adapters x sequences per adapter x length): 1x16x1024, 4x4x1024,
16x1x1024, 64x1x256 and 32x1x512. Prints a markdown table and writes --out JSON.
--profile-out DIR writes torch.profiler tables (device time per kernel, and the round's wall
time against the device's busy time) of one mixed and one frozen-base round of every case
run (issue 28: where 64 x 256 loses against 16 x 1024), and the host-device syncs of each round
by call site (benchmarks/sync_census.py).

  python -m benchmarks.bench_mixed_step --out mixed.json        # GPU, bf16 (the config default: 16384-token micro-batches)
  python -m benchmarks.bench_mixed_step --tiny                  # CPU smoke test (tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks.failures import attempt  # noqa: E402
from tests.trainer_probes import slot_status  # noqa: E402

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


def timed(fn, iters: int, warmup: int, phases: PhaseTimer | None = None, *,
          end_round: Callable[[], None] | None = None, progress: bool = False) -> dict:
    """Median ms of fn() (the lower median: one real round, so its phase split adds up to it),
    every round's ms, peak GiB (None without CUDA) and the phase split of that round.
    ``end_round`` runs after each round's device sync (the multi-rank benchmarks' barrier, so a
    round's time is the slowest rank's); ``progress`` prints each warm-up round's time (the
    first call of a new shape compiles and autotunes)."""
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        sync()
        if progress:
            print(f"#   warm-up round {i + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
    if end_round:
        end_round()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, fb, st = [], [], []
    for _ in range(iters):
        if phases:
            phases.reset()
        t0 = time.perf_counter()
        fn()
        sync()
        if end_round:
            end_round()
        times.append((time.perf_counter() - t0) * 1e3)
        if phases:
            fb.append(phases.fwd_bwd * 1e3)
            st.append(phases.step * 1e3)
    mid = sorted(range(iters), key=lambda i: times[i])[(iters - 1) // 2]
    out = {"ms": times[mid], "all_ms": [round(t, 1) for t in times],
           "peak_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None}
    if phases:
        out.update(fwd_bwd_ms=fb[mid], step_ms=st[mid], other_ms=times[mid] - fb[mid] - st[mid])
    return out


def timed_back_to_back(fn, iters: int, warmup: int, phases: PhaseTimer | None = None) -> dict:
    """Mean ms of fn() over ``iters`` rounds run as the service loop runs them: no device sync
    between rounds (the phase timer's syncs off), one at the end. A round's work that outlives
    its call (the optimizer step on its own stream, trainer/optim/step_overlap.py) overlaps the next
    round's here, and only here."""
    was = phases.enabled if phases else None
    if phases:
        phases.enabled = False
    try:
        for _ in range(warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return {"ms": (time.perf_counter() - t0) * 1e3 / iters, "rounds": iters}
    finally:
        if phases:
            phases.enabled = was


def timer_for(mode: str) -> Callable:
    """How a mode's rounds are timed: back to back for the *_b2b* modes, else round by round."""
    return timed_back_to_back if "_b2b" in mode else timed


def measure_modes(row: dict, modes: list[str], repeats: int, measure: Callable[[str], dict], label: str) -> None:
    """Each mode ``repeats`` times, the modes alternating (the device's rate drifts over a run, so
    one mode's rounds after another's would measure the drift too). ``row[mode]``: the repeat of
    median ms (the lower median); ``row["repeats"][mode]``: every repeat's ms."""
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for mode in modes:
            result = attempt(lambda m=mode: measure(m))
            runs.setdefault(mode, []).append(result)
            print(f"{label}  {mode:18s} {result}", flush=True)
    for mode, results in runs.items():
        ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
        row[mode] = ok[(len(ok) - 1) // 2] if ok else results[-1]
        if repeats > 1:
            row.setdefault("repeats", {})[mode] = [r.get("ms") for r in results]


def back_to_back_modes(trainer, run_mixed: Callable[[], None], run_base: Callable[[], None]) -> dict:
    """The back-to-back modes: mixed with the step overlapped (whatever its size: CUDA only),
    mixed with the step in order on the main stream, and the frozen base."""
    overlap = trainer.step_overlap

    def forced(attr: str, value) -> Callable[[], None]:  # noqa: ANN001
        def run() -> None:
            kept = getattr(overlap, attr)
            setattr(overlap, attr, value)
            try:
                run_mixed()
            finally:
                setattr(overlap, attr, kept)

        return run

    return {"mixed_b2b": forced("min_params", 0), "mixed_b2b_in_order": forced("active", False), "base_b2b": run_base}


def back_to_back_table(results: list[dict]) -> str:
    """Rows of the back-to-back modes: ms per round and their ratios to the frozen base."""

    def ms(row, mode):
        return row.get(mode, {}).get("ms")

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    lines = ["| N adapters x seqs x len | back to back: mixed ms (step overlapped) | mixed ms (step in order) "
             "| frozen base ms | mixed / base (overlapped; in order) |", "|---|---|---|---|---|"]
    for r in results:
        m, o, b = ms(r, "mixed_b2b"), ms(r, "mixed_b2b_in_order"), ms(r, "base_b2b")
        if m is None and o is None:
            continue
        ratios = f"{fmt(m / b if m and b else None, '.2f')}; {fmt(o / b if o and b else None, '.2f')}"
        lines.append(f"| {r['n']} x {r['seqs']} x {r['len']} | {fmt(m)} | {fmt(o)} | {fmt(b)} | {ratios} |")
    return "\n".join(lines)


class PhaseTimer:
    """Times the trainer's forward+backward and optimizer-step phases (device-synced).

    Benchmark instrumentation only: wraps, for this process, the two phase functions that
    MultiLoraTrainer.train calls (trainer/core.py's forward_backward and step_due_slots).
    ``enabled`` False: the wrapped functions run as they are (no syncs: back-to-back rounds)."""

    def __init__(self, trainer) -> None:  # noqa: ARG002 - the trainer whose train call is timed
        import trainer.core as core

        self.fwd_bwd = self.step = 0.0
        self.enabled = True
        for name, attr in (("forward_backward", "fwd_bwd"), ("step_due_slots", "step")):
            inner = getattr(core, name)

            def timed_call(*args, _inner=inner, _attr=attr, **kwargs):
                if not self.enabled:
                    return _inner(*args, **kwargs)
                sync()
                t0 = time.perf_counter()
                out = _inner(*args, **kwargs)
                sync()
                setattr(self, _attr, getattr(self, _attr) + time.perf_counter() - t0)
                return out

            setattr(core, name, timed_call)

    def reset(self) -> None:
        self.fwd_bwd = self.step = 0.0


def init_slots(trainer, n: int, seqs: int, rank: int, objective: str) -> None:
    from trainer.config import SlotHyperParams

    hyper = SlotHyperParams(rank=rank, alpha=2.0 * rank, lr=1e-4, samples_per_step=seqs, objective=objective)
    for slot in range(trainer.config.num_slots):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
    for slot in range(n):
        trainer.init_slot(slot, hyper, seed=slot)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.trainer_floor import frozen_base_pass

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape, 512 tokens, 2 iterations: a CPU smoke test")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per round (default 16384; tiny 512)")
    ap.add_argument("--max-len", type=int, default=None, help="longest sequence (default 1024; tiny 64)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="tokens per micro-batch (default: the trainer config default, 16384: one per round; tiny: --tokens)")
    ap.add_argument("--kernel", choices=["auto", "grouped_mm", "loop"], default="auto")
    ap.add_argument("--rank-kernels", choices=["auto", "triton", "library"], default="auto",
                    help="the fused node's rank-R reductions (TrainerConfig.lora_rank_kernels)")
    ap.add_argument("--objective", choices=["sft", "rl"], default="sft")
    ap.add_argument("--padded", action="store_true", help="padded micro-batches instead of packed streams")
    ap.add_argument("--layer-spec", choices=["auto", "fused", "local", "transformer_engine"], default="auto")
    ap.add_argument("--full-logits", action="store_true", help="loss from full fp32 logits instead of chunked log-probs")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds per mode (default 5; tiny 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="measure every mode this many times, alternating")
    ap.add_argument("--only", default=None, help="comma list of modes: serialized,mixed,base,mixed_library,"
                    "mixed_b2b,mixed_b2b_in_order,base_b2b (the last three: rounds back to back, timed_back_to_back) "
                    "(mixed_library: the mixed step with lora_rank_kernels='library'); mixed_cutlass, "
                    "mixed_b2b_cutlass, mixed_b2b_in_order_cutlass: with lora_gemm='cutlass' (H200)")
    ap.add_argument("--n", default="all", help="comma list of the cases' N to run (default all: 1,4,16,64,32)")
    ap.add_argument("--serialized-n", default="all",
                    help="comma list of N whose serialized rounds are timed (they take N train calls), or 'all'")
    ap.add_argument("--serialized-iters", type=int, default=None, help="timed serialized rounds (default --iters)")
    ap.add_argument("--profile-out", default=None, help="folder for torch.profiler tables of the last case")
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
    serialized_n = None if args.serialized_n == "all" else {int(x) for x in args.serialized_n.split(",")}
    plan = cases(tokens, max_len)
    if args.n != "all":
        plan = [c for c in plan if c[0] in {int(x) for x in args.n.split(",")}]
    num_slots = max(n for n, _, _ in plan)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    with tempfile.TemporaryDirectory() as folder:
        cfg = TrainerConfig(base_model_path=write_config(shape, folder), random_init=True, num_slots=num_slots,
                            max_rank=args.rank, lora_kernel=args.kernel, lora_rank_kernels=args.rank_kernels,
                            micro_batch_tokens=args.micro_batch_tokens or (tokens if args.tiny else 16384),
                            packed=not args.padded, layer_spec=args.layer_spec,
                            chunked_logprobs=not args.full_logits, recompute=args.recompute)
        t0 = time.perf_counter()
        trainer = MultiLoraTrainer(cfg)
        build_s = time.perf_counter() - t0
    phases = PhaseTimer(trainer)
    lora_params = sum(p.numel() for p in trainer.buffers.params)
    params = sum(p.numel() for p in trainer.base.model.parameters()) - lora_params  # the base's own
    path = (f"{'packed' if cfg.packed else 'padded'} micro-batches of {cfg.micro_batch_tokens} tokens, "
            f"{trainer.base.layer_spec} layer spec, {'chunked log-probs' if cfg.chunked_logprobs else 'full logits'}, "
            f"recompute {cfg.recompute}")
    print(f"# {device}, {trainer.base.dtype}, {params / 1e9:.3f} B params, built in {build_s:.1f} s, "
          f"{num_slots} slots x rank {args.rank} ({lora_params / 1e6:.1f} M LoRA params), kernel {args.kernel}, "
          f"objective {args.objective}; {path}", flush=True)

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

        run_cutlass = with_routing(trainer, "lora_gemm", "cutlass", run_mixed)
        runners = {"serialized": run_serialized, "mixed": run_mixed, "base": lambda: frozen_base_pass(trainer, mixed),
                   "mixed_library": with_routing(trainer, "rank_kernels", "library", run_mixed),
                   "mixed_cutlass": run_cutlass}
        runners.update(back_to_back_modes(trainer, run_mixed, runners["base"]))
        runners.update({f"{mode}_cutlass": run for mode, run in back_to_back_modes(trainer, run_cutlass, runners["base"]).items()
                        if mode.startswith("mixed")})
        def measure(mode: str) -> dict:
            n_iters = args.serialized_iters or iters if mode == "serialized" else iters
            return timer_for(mode)(runners[mode], n_iters, args.warmup, phases if mode != "base" else None)

        measure_modes(row, [m for m in modes if m != "serialized" or serialized_n is None or n in serialized_n],
                      args.repeats, measure, f"N={n:3d} x {seqs:2d} x {length:5d}")
        if args.profile_out:
            row["profile"] = profile_round(trainer, mixed, args.profile_out, f"n{n}x{seqs}x{length}")
            from benchmarks.sync_census import sync_sites

            row["syncs"] = sync_sites(trainer, mixed, args.profile_out, f"n{n}x{seqs}x{length}")
        results.append(row)

    print()
    print(table(results))
    print()
    print(back_to_back_table(results))
    print(f"\nreproduce: python -m benchmarks.bench_mixed_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": str(trainer.base.dtype), "params": params,
                       "lora_params": lora_params, "rank": args.rank, "kernel": args.kernel,
                       "objective": args.objective, "path": path, "config": cfg.model_dump(mode="json"),
                       "results": results}, f, indent=2)
    return 0


def with_routing(trainer, attr: str, value: str, run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with one of the trainer's kernel choices changed for its duration: mixed_library
    (``rank_kernels`` 'library': the library GEMMs where the default takes the Triton kernels) and the
    *_cutlass modes (``lora_gemm`` 'cutlass': the base GEMM with the LoRA term in one CUTLASS kernel,
    trainer/kernels/cutlass_lora; CUDA sm_90a only, the mode fails with the reason elsewhere)."""

    def run_with() -> None:
        kept = getattr(trainer.routing, attr)
        setattr(trainer.routing, attr, value)
        try:
            run()
        finally:
            setattr(trainer.routing, attr, kept)

    return run_with


def profile_round(trainer, batch, folder: str, tag: str) -> dict:
    """torch.profiler tables (self device time per op/kernel) of one mixed and one frozen-base round,
    and per round: its wall ms, the device's busy ms (self device time summed over every op: kernels
    and copies) and the busy ms of each kernel family (name prefixes, the largest first)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.trainer_floor import frozen_base_pass

    os.makedirs(folder, exist_ok=True)
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary = {}
    for name, fn in (("mixed", lambda: trainer.train(batch)), ("base", lambda: frozen_base_pass(trainer, batch))):
        fn()
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
        averages = prof.key_averages()
        text = averages.table(sort_by=sort, row_limit=60, max_name_column_width=90)
        device_us = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))  # noqa: E731
        # device-side entries only (kernels, copies, memsets): a CPU op's self device time is the
        # kernels it launched, which are listed again as their own entries
        kernels = [e for e in averages if getattr(e, "device_type", None) == DeviceType.CUDA and device_us(e) > 0]
        busy_ms = sum(device_us(e) for e in kernels) / 1e3
        families: dict[str, float] = {}
        for e in kernels:
            family = e.key.split("(")[0].split("<")[0][:60]
            families[family] = families.get(family, 0.0) + device_us(e) / 1e3
        top = dict(sorted(((k, round(v, 2)) for k, v in families.items()), key=lambda kv: -kv[1])[:25])
        summary[name] = {"wall_ms": round(wall_ms, 1), "device_busy_ms": round(busy_ms, 1), "kernel_families_ms": top}
        idle = ""
        if cuda:  # the device's idle gaps and the host ops behind them (trace_gaps.py); the trace kept, gzipped
            from benchmarks.trace_gaps import gaps, load, report

            trace = os.path.join(folder, f"trace_{tag}_{name}.json")
            prof.export_chrome_trace(trace)
            idle = report(gaps(load(trace)))
            subprocess.run(["gzip", "-f", trace], check=False)
            print("# " + "\n#   ".join(idle.splitlines()[:8]), flush=True)
        with open(os.path.join(folder, f"profile_{tag}_{name}.txt"), "w") as f:
            f.write(f"wall {wall_ms:.1f} ms, device busy {busy_ms:.1f} ms\n")
            f.write(json.dumps(top, indent=1) + "\n")
            f.write(idle + "\n")
            f.write(text)
        print(f"# profile {name} ({tag}): wall {wall_ms:.1f} ms, device busy {busy_ms:.1f} ms; "
              f"{os.path.join(folder, f'profile_{tag}_{name}.txt')}", flush=True)
    return summary


def table(results: list[dict]) -> str:
    def get(row, mode, key="ms"):
        return row.get(mode, {}).get(key)

    def fmt(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = [
        "| N adapters x seqs x len | serialized ms | mixed ms (fwd+bwd / step / rest) | frozen base ms | mixed / base "
        "| serialized / mixed | peak GiB serialized / mixed / base | mixed, library rank kernels, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, m, b = get(r, "serialized"), get(r, "mixed"), get(r, "base")
        lib = get(r, "mixed_library")
        split = " / ".join(fmt(get(r, "mixed", k)) for k in ("fwd_bwd_ms", "step_ms", "other_ms"))
        peaks = " / ".join(fmt(get(r, k, "peak_gib"), ".1f") for k in ("serialized", "mixed", "base"))
        lines.append(
            f"| {r['n']} x {r['seqs']} x {r['len']} | {fmt(s)} | {fmt(m)} ({split}) | {fmt(b)} | "
            f"{fmt(m / b if m and b else None, '.2f')} | {fmt(s / m if s and m else None, '.1f')} | {peaks} | {fmt(lib)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
