"""The trainer at real size on two GPUs: the mixed step under TP=2 and DP=2 (and the slot limit on one).

A Qwen3-8B-shaped decoder with its real layer count (36 layers, hidden 4096, 32 / 8 heads,
head_dim 128, ffn 12288, vocab 151936, untied embeddings as in Qwen3-8B; random weights
from a config.json written to a temp folder and TrainerConfig.random_init), built by
lorafleet's trainer through Megatron-Bridge, 64 resident LoRA slots of rank 16 on every
linear (qkv, proj, fc1, fc2), 16384 tokens per round (packed), bf16, one optimizer step
per adapter per round. For each layout (--layout tp2,dp2: two processes over NCCL with
NCCL_NVLS_ENABLE=0, spawned like tests/gpu/test_fp32_gpu.py), medians over --iters
rounds after --warmup:

  mixed       one train call with every adapter's samples, N = 1, 16, 64
  frozen base the same micro-batches along the same path with LoRA off
              (benchmarks/trainer_floor.py frozen_base_pass; gradient to the input embeddings only)
  serialized  N train calls, one per adapter, at N = 1 and 16 (--serialized-n; 64 takes
              64 calls a round: add it with --serialized-n 1,16,64)
  export      (opt-in: --only mixed,export) a mixed round followed by the N stepped slots'
              background exports against the mixed round alone, per writer kind
              (--export-writer thread,process): benchmarks/publish_round.py

A round's time is the slowest rank's: each timed round ends with a device sync and a
barrier. Reported per GPU: tokens/s (round tokens / round time / GPUs), TFLOP/s and MFU
counting 4 x base parameters x tokens (the frozen pass's forward + backward to the
activations, no weight gradients: the convention of docs/benchmarks-history.md's frozen-base
rows; attention's score FLOPs and the LoRA FLOPs are not counted, so the mixed step's
MFU is the base's work per second), MFU against --peak-tflops (989.4: H100/H200 SXM
dense bf16) and against the bf16 matmul rate measured in the same run; peak memory per
GPU (torch.cuda.max_memory_allocated, the largest over ranks, and each rank's).
The LoRA path each layout took is printed. --lora-path fused,general runs each layout on
both (a fresh build each): the fused LoRA node (base GEMM + delta in one autograd node; at
TP=2 with the TP communication inside it, trainer/lora/fused_lora.py) and the general path
(Megatron's linear, then the delta: what the first TP=2 rows of docs/benchmarks-history.md
measured, when the fused node was TP=1 only). Default: fused, the trainer's default.

Memory (arithmetic from docs/benchmarks-history.md's 1.7B per-token figures scaled by hidden x
layers, so an estimate): 64 slots of rank 16 at 8B are 43.6 M LoRA parameters each, x 16
bytes (fp32 weight, grad, Adam m, v) = 41.6 GiB per GPU at DP=2 (about half at TP=2);
activations without recomputation about 6.8 MiB per token at TP 1 (108 GiB for 16k
tokens). So --recompute is a list: a layout runs with the first setting (default none,
the trainer's default) and, after an OOM on any rank (every rank stops at the first),
again with the next (full); each attempt is a row group of the table.

--layout single: one GPU, the largest slot count that fits beside the 8B base at 16k
tokens per round: tries --single-slots in ascending order (a fresh process each: a clean
allocator and an OOM that cannot leak) until one fails to build or to train a mixed round
in which every resident slot steps (the 16384 tokens split evenly over the slots); if the
first fails it halves downward. Reports the largest that trained, for each
--single-recompute setting (default none,full: about 1 min per attempt, so run them as
separate commands where a command has a time limit).

  python -m benchmarks.bench_parallel_step --out parallel.json                 # 2 GPUs: tp2 then dp2
  python -m benchmarks.bench_parallel_step --layout single --out single.json   # 1 GPU: slot limit
  python -m benchmarks.bench_parallel_step --tiny                               # CPU smoke test, gloo
  python -m benchmarks.bench_parallel_step --layout tp2 --lora-path fused,general --only mixed,base
  python -m benchmarks.bench_parallel_step --layout dp2 --only mixed,export --recompute full   # publish export

Run time on 2 H200s (estimate: about 1 min to build each layout plus 1-2 min of rounds):
about 5 min for the default tp2,dp2, up to about 9 min if both OOM without recomputation
and run again with it; --layout tp2 and --layout dp2 in separate commands stay well inside
a 10-minute limit. Cut cases with --n, --only, --serialized-n, --iters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines need it)

import torch  # noqa: E402

from benchmarks.bench_mixed_step import GIB, PhaseTimer, TINY, cases, init_slots, make_samples, sync, timed, write_config  # noqa: E402
from benchmarks.failures import describe_failure, is_oom  # noqa: E402
from benchmarks.publish_round import export_table, export_timings, room_line  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
H200_BF16_DENSE_TFLOPS = 989.4  # NVIDIA's dense bf16 figure for H100/H200 SXM
# tp1: the same cases and modes on one GPU (one process); single: the slot-limit search
LAYOUTS = {"tp2": {"tp": 2, "dp": 1}, "dp2": {"tp": 1, "dp": 2}, "tp1": {"tp": 1, "dp": 1}, "single": {"tp": 1, "dp": 1}}
USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")  # a thread count the user set wins over spawn's share


def world_size(layout: str) -> int:
    """Processes (GPUs) a layout runs on."""
    return LAYOUTS[layout]["tp"] * LAYOUTS[layout]["dp"]


def write_untied_config(shape: dict, folder: str, tied: bool) -> str:
    """bench_mixed_step's config-only HF folder, with Qwen3-8B's untied output layer unless ``tied``."""
    write_config(shape, folder)
    if not tied:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["tie_word_embeddings"] = False
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return folder


def trainer_config(opts: dict, layout: str, num_slots: int, recompute: str, path: str = "fused"):
    from trainer.config import TrainerConfig

    return TrainerConfig(base_model_path=opts["folder"], random_init=True, num_slots=num_slots, max_rank=opts["rank"],
                         micro_batch_tokens=opts["micro_batch_tokens"], recompute=recompute, fused_lora=path == "fused",
                         export_writer_threads=opts["export_threads"], lora_gemm=opts["lora_gemm"],
                         **LAYOUTS[layout])


def build_trainer(opts: dict, layout: str, num_slots: int, recompute: str, rank: int, port: int, path: str = "fused"):
    """The process group first, with a collective timeout of --collective-timeout-s (the trainer's
    init_parallel reuses it): a rank left waiting in a collective by a peer that failed (an OOM on
    one rank only) is ended by the NCCL watchdog instead of hanging the run."""
    from trainer.core import MultiLoraTrainer
    from trainer.platform.distributed import init_parallel

    cfg = trainer_config(opts, layout, num_slots, recompute, path)
    init_parallel(tp=cfg.tp, dp=cfg.dp, rank=rank, master_port=port, seed=cfg.seed, timeout_s=opts["collective_timeout_s"])
    return MultiLoraTrainer(cfg, rank=rank, master_port=port)


def base_params(trainer) -> int:
    """Parameters of the whole base model (not of this rank's shard), LoRA slots excluded:
    tensor-parallel shards summed over the TP group, replicated tensors (norms) counted once."""
    import torch.distributed as dist

    from trainer.platform.distributed import tp_group

    seen, sharded, replicated = set(), 0, 0
    for name, p in trainer.base.model.named_parameters():
        if "lora_" in name or id(p) in seen:
            continue
        seen.add(id(p))
        if getattr(p, "tensor_model_parallel", False):
            sharded += p.numel()
        else:
            replicated += p.numel()
    if trainer.config.tp > 1:
        t = torch.tensor([sharded], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(t, group=tp_group())
        sharded = int(t.item())
    return sharded + replicated


def lora_path(trainer) -> str:
    """Which LoRA path the trainer's layers take in train() (see MultiLoraLinear.forward)."""
    from trainer.lora.multi_lora import fused_tp_refusal

    cfg = trainer.config
    fused = trainer.routing.fused and cfg.packed and all(layer.fusable for layer in trainer.layers)
    if fused:
        return (f"fused LoRA node at TP={cfg.tp} (rank kernels {cfg.lora_rank_kernels}: triton on CUDA for >1 slot "
                "per micro-batch)")
    if not trainer.routing.fused:
        why = "fused_lora false"
    elif not cfg.packed:
        why = "padded micro-batches"
    else:
        why = "; ".join(sorted({f"{layer.name}: {fused_tp_refusal(layer.base, layer.parallel, layer.tp_size) or 'not fusable'}"
                                for layer in trainer.layers if not layer.fusable}))[:300]
    return f"general path: base linear + LoRA delta ({cfg.lora_kernel} kernel; fused node off: {why})"


def timed_round(fn, iters: int, warmup: int, phases: PhaseTimer | None) -> dict:
    """bench_mixed_step.timed with a barrier ending each round (a round's time is the slowest
    rank's); peak GiB and the phase split are this rank's; rank 0 prints warm-up progress."""
    import torch.distributed as dist

    return timed(fn, iters, warmup, phases, end_round=dist.barrier, progress=dist.get_rank() == 0)


def _gather(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out




def layout_worker(rank: int, port: int, opts: dict, layout: str, recompute: str, out_path: str, path: str = "fused") -> None:
    """One rank of a layout: build, time every case and mode, rank 0 writes the JSON. The first
    OOM (on any rank) ends the layout's cases: the JSON then says oom, and the parent retries
    with the next --recompute setting."""
    from benchmarks.trainer_floor import frozen_base_pass

    import torch.distributed as dist

    from trainer.batch import TrainBatch

    from benchmarks.bench_frozen_base import matmul_tflops

    t0 = time.perf_counter()
    trainer = build_trainer(opts, layout, opts["slots"], recompute, rank, port, path)
    build_s = time.perf_counter() - t0
    world = dist.get_world_size()
    params = base_params(trainer)
    matmul = matmul_tflops() if torch.cuda.is_available() else None
    phases = PhaseTimer(trainer)
    head = {"layout": layout, "recompute": recompute, "path": path, **LAYOUTS[layout], "gpus": world, "build_s": build_s, "base_params": params,
            "lora_params_per_rank": sum(p.numel() for p in trainer.buffers.params), "lora_path": lora_path(trainer),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "dtype": str(trainer.base.dtype), "matmul_bf16_tflops": matmul,
            "config": trainer.config.model_dump(mode="json")}
    if rank == 0:
        print(f"# {layout} {path}, recompute {recompute}: {world} x {head['device']}, {head['dtype']}, {params / 1e9:.3f} B base params, built in "
              f"{build_s:.1f} s ({torch.get_num_threads()} CPU threads per rank), {opts['slots']} slots x rank {opts['rank']} ({head['lora_params_per_rank'] / 1e6:.1f} M "
              f"LoRA params per rank); LoRA path: {head['lora_path']}", flush=True)
    rows, oom = [], False
    shape = opts["shape"]
    for n, seqs, length in opts["plan"]:
        if oom:
            break
        samples = make_samples(n, seqs, length, shape["vocab_size"], "sft")
        per_adapter = [TrainBatch(samples=[s for s in samples if s.slot == k]) for k in range(n)]
        mixed = TrainBatch(samples=samples)
        t_init = time.perf_counter()
        init_slots(trainer, n, seqs, opts["rank"], "sft")
        if rank == 0:  # progress: a case that stalls shows where (the first 8B runs never printed N=64)
            print(f"# {layout} {path} N={n}: {n} slots initialized in {time.perf_counter() - t_init:.1f} s", flush=True)
        row = {"n": n, "seqs": seqs, "len": length, "tokens": n * seqs * length}

        def run_serialized():
            for b in per_adapter:
                assert len(trainer.train(b).stepped) == 1

        def run_mixed():
            assert len(trainer.train(mixed).stepped) == n

        runners = {"serialized": run_serialized, "mixed": run_mixed, "base": lambda: frozen_base_pass(trainer, mixed)}
        for mode in opts["modes"]:
            if oom or (mode == "serialized" and n not in opts["serialized_n"]):
                continue
            iters = opts["serialized_iters"] if mode == "serialized" else opts["iters"]
            warmup = opts["serialized_warmup"] if mode == "serialized" else opts["warmup"]
            try:
                if mode == "export":  # one result per writer kind, each against the case's mixed round
                    res = {}
                    for kind in opts["export_writers"]:
                        res[kind] = e = export_timings(trainer, n, run_mixed, opts, kind)
                        mixed_ms = row.get("mixed", {}).get("ms")
                        if mixed_ms:
                            e["publish_share_of_mixed"] = (e["round_with_exports_ms"] - mixed_ms) / mixed_ms
                        if rank == 0:
                            print(f"{layout} {path} N={n:3d} export ({kind}) {_short(e)}", flush=True)
                else:
                    res = timed_round(runners[mode], iters, warmup, phases if mode != "base" else None)
            except Exception as err:  # an OOM on one rank: report it, keep the rest of the run
                if not is_oom(err):
                    raise
                res = {"error": describe_failure(err)}
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            statuses = _gather((res.get("peak_gib"), res.get("error")))
            peaks = [p for p, _ in statuses]
            errors = [e for _, e in statuses if e]
            if errors:  # every rank stops together
                res, oom = {"error": errors[0]}, True
            if "ms" in res and mode != "export":
                res["peak_gib_per_rank"] = peaks
                res["peak_gib"] = max(peaks) if peaks[0] is not None else None
                res["tokens_per_s_per_gpu"] = row["tokens"] / (res["ms"] / 1e3) / world
                res["tflops_per_gpu"] = 4 * params * row["tokens"] / (res["ms"] / 1e3) / world / 1e12
                res["mfu"] = res["tflops_per_gpu"] / opts["peak_tflops"]
                res["share_of_matmul"] = res["tflops_per_gpu"] / matmul if matmul else None
            row[mode] = res
            if rank == 0 and mode != "export":
                print(f"{layout} {path} N={n:3d} x {seqs:2d} x {length:5d}  {mode:10s} {_short(res)}", flush=True)
        rows.append(row)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(head | {"oom": oom, "results": rows}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def _short(res: dict) -> str:
    if "error" in res:
        return res["error"]
    if "round_with_exports_ms" in res:  # mode export (one writer kind)
        keys = ("adapter_mb_on_rank0", "export_calls_ms_per_round", "room_wait_ms_per_round", "writer_ms_per_adapter",
                "round_with_exports_ms", "publish_share_of_mixed", "back_to_back_mixed_ms", "back_to_back_with_exports_ms",
                "back_to_back_publish_share", "written", "superseded", "writes_left_after_rounds_s",
                "arena_register_s", "round_with_exports_peak_gib")
        return " ".join(f"{k}={res[k]:.3g}" for k in keys if res.get(k) is not None) + (
            f" FAILED WRITES {res['write_failures']}" if res.get("write_failures") else "") + (
            f" background_equals_sync={res['background_equals_sync']} rounds={res['round_with_exports_all_ms']}"
            f"\n  room: {room_line(res)}") + (
            f"\n  parts, back to back ms: {res['back_to_back_parts_ms']}" if res.get("back_to_back_parts_ms") else "")
    keys = ("ms", "fwd_bwd_ms", "step_ms", "other_ms", "tokens_per_s_per_gpu", "mfu", "peak_gib")
    return " ".join(f"{k}={res[k]:.3g}" for k in keys if res.get(k) is not None) + f" rounds={res['all_ms']}"


def single_worker(rank: int, port: int, opts: dict, num_slots: int, recompute: str, out_path: str) -> None:
    """One GPU, ``num_slots`` resident slots: can it build and train a mixed round where every
    slot steps? Writes {"ok": ...} with the round's time and peak memory, or the error."""
    import torch.distributed as dist

    from trainer.batch import TrainBatch

    result: dict = {"slots": num_slots, "recompute": recompute}
    try:
        t0 = time.perf_counter()
        trainer = build_trainer(opts, "single", num_slots, recompute, rank, port)
        result["build_s"] = time.perf_counter() - t0
        result["lora_params"] = sum(p.numel() for p in trainer.buffers.params)
        result["lora_path"] = lora_path(trainer)
        if torch.cuda.is_available():
            result["after_build_gib"] = torch.cuda.memory_allocated() / GIB
        length = opts["tokens"] // num_slots
        samples = make_samples(num_slots, 1, length, opts["shape"]["vocab_size"], "sft")
        init_slots(trainer, num_slots, 1, opts["rank"], "sft")
        batch = TrainBatch(samples=samples)

        def run_mixed():
            assert len(trainer.train(batch).stepped) == num_slots

        result |= {"len": length, "tokens": num_slots * length}
        result |= timed_round(run_mixed, opts["single_iters"], 1, None)
        result["ok"] = True
    except Exception as err:
        result |= {"ok": False, "oom": is_oom(err), "error": describe_failure(err)}
        if not result["oom"]:
            result["trace"] = traceback.format_exc()[-1500:]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn, nprocs: int, *args) -> None:
    """Run ``fn`` on ``nprocs`` fresh processes. Each gets a share of the host's cores for torch's
    CPU thread pool (OMP_NUM_THREADS, read when the child imports torch), as torchrun and Ray do:
    by default every process would size its pool to all cores, and ranks doing host work at the
    same time (the seeded CPU init of 64 slots) then oversubscribe the host."""
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    os.environ["OMP_NUM_THREADS"] = USER_OMP_THREADS or str(max(1, (os.cpu_count() or 1) // (2 * nprocs)))
    mp.spawn(fn, args=(free_loopback_port(), *args), nprocs=nprocs, join=True)


def run_single(opts: dict, counts: list[int], recompute: str, tmp: str) -> dict:
    """Ascending until the first failure; if the first count fails, halve downward."""
    tried: dict[int, dict] = {}

    def attempt(n: int) -> bool:
        out = os.path.join(tmp, f"single_{recompute}_{n}.json")
        try:
            spawn(single_worker, 1, opts, n, recompute, out)
            with open(out) as f:
                tried[n] = json.load(f)
        except Exception as err:  # the process died (e.g. killed for host memory)
            tried[n] = {"slots": n, "recompute": recompute, "ok": False, "error": f"process failed: {describe_failure(err)}"}
        r = tried[n]
        status = (f"trained {r['tokens']} tokens in {r['ms']:.0f} ms, peak {r['peak_gib'] or 0:.1f} GiB, "
                  f"{r.get('after_build_gib') or 0:.1f} GiB after build" if r["ok"] else r["error"])
        print(f"single, recompute {recompute}: {n} slots: {status}", flush=True)
        return r["ok"]

    counts = sorted(counts)
    if attempt(counts[0]):
        for n in counts[1:]:
            if not attempt(n):
                break
    else:
        n = counts[0] // 2
        while n >= 1 and not attempt(n):
            n //= 2
    fits = [n for n, r in tried.items() if r["ok"]]
    return {"recompute": recompute, "largest_fitting": max(fits) if fits else None,
            "tried": [tried[n] for n in sorted(tried)]}


def run_layout(opts: dict, layout: str, recomputes: list[str], tmp: str, path: str = "fused") -> list[dict]:
    """The layout on LoRA path ``path`` with the first recompute setting; after an OOM (or a
    failed run) again with the next."""
    attempts = []
    for recompute in recomputes:
        out = os.path.join(tmp, f"{layout}_{path}_{recompute}.json")
        t0 = time.perf_counter()
        try:
            spawn(layout_worker, world_size(layout), opts, layout, recompute, out, path)
            with open(out) as f:
                lay = json.load(f)
        except Exception as err:  # a rank died: build OOM, or ended by the NCCL watchdog
            lay = {"layout": layout, "recompute": recompute, "path": path, "oom": None, "results": [],
                   "error": f"process failed: {describe_failure(err)}"}
        lay["wall_s"] = time.perf_counter() - t0
        attempts.append(lay)
        print(f"# {layout} {path}, recompute {recompute}: {lay['wall_s']:.0f} s in all"
              + (f" (build {lay['build_s']:.0f} s)" if "build_s" in lay else f": {lay['error']}"), flush=True)
        if not (lay["oom"] or "error" in lay):
            break
    return attempts


def table(layouts: list[dict]) -> str:
    def fmt(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = [
        "| layout | N adapters x seqs x len | serialized ms | mixed ms (fwd+bwd / step / rest) | frozen base ms "
        "| mixed / base | serialized / mixed | tokens/s per GPU mixed / base | MFU mixed / base "
        "| peak GiB per GPU serialized / mixed / base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lay in layouts:
        for r in lay["results"]:
            s, m, b = (r.get(k, {}) for k in ("serialized", "mixed", "base"))
            sm, mm, bm = s.get("ms"), m.get("ms"), b.get("ms")
            split = " / ".join(fmt(m.get(k)) for k in ("fwd_bwd_ms", "step_ms", "other_ms"))
            tps = " / ".join(fmt(x.get("tokens_per_s_per_gpu")) for x in (m, b))
            mfu = " / ".join("-" if x.get("mfu") is None else f"{100 * x['mfu']:.1f}%" for x in (m, b))
            peaks = " / ".join(fmt(x.get("peak_gib"), ".1f") for x in (s, m, b))
            lines.append(
                f"| {lay['layout']} {lay.get('path', 'fused')} ({lay['recompute']}) | {r['n']} x {r['seqs']} x {r['len']} | {fmt(sm) if sm else s.get('error', '-')} | "
                f"{fmt(mm) if mm else m.get('error', '-')} ({split}) | {fmt(bm) if bm else b.get('error', '-')} | "
                f"{fmt(mm / bm if mm and bm else None, '.2f')} | {fmt(sm / mm if sm and mm else None, '.1f')} | "
                f"{tps} | {mfu} | {peaks} |"
            )
    return "\n".join(lines)


def single_table(single: dict) -> str:
    lines = ["| recompute | slots x rank 16 | trained a mixed round | tokens (slots x len) | round ms | GiB after build | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in (r for s in single for r in s["tried"]):
        ok = "yes" if r["ok"] else f"no ({r['error'][:80]})"
        ms = f"{r['ms']:.0f}" if r.get("ms") else "-"
        build = f"{r['after_build_gib']:.1f}" if r.get("after_build_gib") is not None else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        tokens = f"{r['tokens']} ({r['slots']} x {r['len']})" if r.get("tokens") else "-"
        lines.append(f"| {r['recompute']} | {r['slots']} | {ok} | {tokens} | {ms} | {build} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="tp2,dp2",
                    help="comma list of tp2, dp2 (two processes each), tp1 (the same cases on one GPU), single "
                         "(one GPU: the slot-limit search)")
    ap.add_argument("--tiny", action="store_true", help="tiny shape over gloo on the CPU: a smoke test (numbers meaningless)")
    ap.add_argument("--tied", action="store_true", help="tie the output layer to the embeddings (Qwen3-8B's are untied)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per round (default 16384; tiny 512)")
    ap.add_argument("--max-len", type=int, default=None, help="longest sequence (default 1024; tiny 64)")
    ap.add_argument("--slots", type=int, default=64, help="resident slots for tp2 / dp2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-path", default="fused",
                    help="comma list of fused, general for tp2 / dp2: each layout runs on each (fused = the fused "
                         "LoRA node, the trainer's default; general = fused_lora off)")
    ap.add_argument("--lora-gemm", choices=["library", "cutlass", "auto"], default="library",
                    help="TrainerConfig.lora_gemm: the fused node's base GEMM with its LoRA term (cutlass: H200 only)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="mode export: the publish folders' dtype (engines.publish_dtype; auto is the engines' "
                         "dtype, bf16 for a bf16 checkpoint on GPU); the synchronous export stays fp32 (before)")
    ap.add_argument("--export-threads", type=int, default=4,
                    help="mode export: writer threads on rank 0 (TrainerConfig.export_writer_threads)")
    ap.add_argument("--export-writer", default="process,thread",
                    help="mode export: comma list of writer kinds to time, each on the same build "
                         "(TrainerConfig.export_writer: thread, process)")
    ap.add_argument("--export-parts", action="store_true",
                    help="mode export: also time the mixed round plus the snapshot's gathers alone and plus gathers and copies without writes (tp1)")
    ap.add_argument("--export-sync", action="store_true",
                    help="mode export: also time the synchronous export_peft of the N slots (the path before issue 18)")
    ap.add_argument("--recompute", default="none,full",
                    help="comma list of recompute settings (none, selective, full) for tp2 / dp2: a layout runs with the "
                         "first; after an OOM it runs again with the next (default none,full: the trainer's default, "
                         "then full recomputation)")
    ap.add_argument("--collective-timeout-s", type=float, default=300.0,
                    help="collective timeout: a rank whose peer failed is ended after this long instead of hanging")
    ap.add_argument("--n", default="1,16,64", help="comma list of N adapters per mixed round")
    ap.add_argument("--only", default="mixed,base,serialized",
                    help="comma list of modes: mixed,base,serialized,export (export: after mixed, the publish "
                         "export's snapshot, the synchronous export and a mixed round with background exports)")
    ap.add_argument("--serialized-n", default="1,16", help="N whose serialized rounds are timed (64: 64 calls a round)")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds of mixed / base (default 3; tiny 2)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--serialized-iters", type=int, default=None, help="timed serialized rounds (default 2; tiny 1)")
    ap.add_argument("--serialized-warmup", type=int, default=1)
    ap.add_argument("--single-slots", default=None, help="slot counts to try with --layout single (default 64,128,256,512; tiny 4,8)")
    ap.add_argument("--single-iters", type=int, default=2)
    ap.add_argument("--single-recompute", default="none,full",
                    help="comma list of recompute settings: the slot search runs for each (default none,full)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per-GPU bf16 peak for MFU")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)

    layouts = args.layout.split(",")
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        ap.error(f"unknown layout {bad}; allowed: {', '.join(LAYOUTS)}")
    timed_layouts = [x for x in layouts if x != "single"]  # the layouts that time cases
    need = max((world_size(x) for x in timed_layouts), default=1)
    if torch.cuda.is_available() and torch.cuda.device_count() < need:
        ap.error(f"layouts {timed_layouts} need {need} GPUs; {torch.cuda.device_count()} visible")
    if not torch.cuda.is_available() and not args.tiny:
        ap.error("without CUDA only --tiny runs (the 8B shape is for GPUs)")
    paths = args.lora_path.split(",")
    if not paths or any(p not in ("fused", "general") for p in paths) or len(set(paths)) != len(paths):
        ap.error(f"--lora-path takes a comma list of fused, general (each once); got {args.lora_path!r}")
    modes = args.only.split(",")
    if any(m not in ("mixed", "base", "serialized", "export") for m in modes):
        ap.error(f"--only takes mixed, base, serialized, export; got {args.only}")
    writers = args.export_writer.split(",")
    if not writers or any(w not in ("thread", "process") for w in writers) or len(set(writers)) != len(writers):
        ap.error(f"--export-writer takes a comma list of thread, process (each once); got {args.export_writer!r}")
    if "export" in modes:  # it compares against the case's mixed round, so it runs after it
        modes = [m for m in modes if m != "export"] + ["export"]
    recomputes, single_recomputes = args.recompute.split(","), args.single_recompute.split(",")
    if any(r not in ("none", "selective", "full") for r in recomputes + single_recomputes):
        ap.error(f"--recompute / --single-recompute take none, selective, full; got {args.recompute!r} / "
                 f"{args.single_recompute!r}")
    shape = TINY if args.tiny else QWEN3_8B
    tokens = args.tokens or (512 if args.tiny else 16384)
    max_len = args.max_len or (64 if args.tiny else 1024)
    wanted = {int(x) for x in args.n.split(",")}
    plan = sorted({c for c in cases(tokens, max_len) if c[0] in wanted})
    if not plan or max(n for n, _, _ in plan) > args.slots:
        ap.error(f"--n {args.n}: each N must be one of 1, 4, 16, 32, 64 and at most --slots {args.slots}")
    result: dict = {"shape": shape, "tied": args.tied, "tokens_per_round": tokens, "layouts": [], "single": None,
                    "flops_convention": "4 x base params x round tokens (forward + backward to activations; "
                                        "no attention-score or LoRA FLOPs)", "peak_tflops": args.peak_tflops}
    with tempfile.TemporaryDirectory() as tmp:
        opts = {"folder": write_untied_config(shape, os.path.join(tmp, "model"), args.tied), "shape": shape,
                "export_dtype": args.export_dtype, "export_threads": args.export_threads,
                "export_writers": args.export_writer.split(","), "export_sync": args.export_sync, "export_parts": args.export_parts,
                "tokens": tokens, "plan": plan, "modes": modes, "slots": args.slots, "rank": args.rank,
                "lora_gemm": args.lora_gemm,
                "micro_batch_tokens": args.micro_batch_tokens if not args.tiny else min(args.micro_batch_tokens, tokens),
                "collective_timeout_s": args.collective_timeout_s, "serialized_n": {int(x) for x in args.serialized_n.split(",")},
                "iters": args.iters or (2 if args.tiny else 3), "warmup": args.warmup,
                "serialized_iters": args.serialized_iters or (1 if args.tiny else 2),
                "serialized_warmup": args.serialized_warmup, "single_iters": args.single_iters,
                "peak_tflops": args.peak_tflops}
        for layout in timed_layouts:
            for path in paths:
                result["layouts"] += run_layout(opts, layout, recomputes, tmp, path)
        if "single" in layouts:
            counts = [int(x) for x in (args.single_slots or ("4,8" if args.tiny else "64,128,256,512")).split(",")]
            result["single"] = [run_single(opts, counts, r, tmp) for r in single_recomputes]
    print()
    built = [lay for lay in result["layouts"] if "build_s" in lay]
    for lay in result["layouts"]:
        if "error" in lay:
            print(f"{lay['layout']} {lay.get('path', 'fused')}, recompute {lay['recompute']}: FAILED {lay['error']}")
    if built:
        lay0 = built[0]
        print(f"{lay0['device']}, {lay0['dtype']}, {lay0['base_params'] / 1e9:.2f} B base params, "
              f"{args.slots} slots x rank {args.rank}, {tokens} tokens per round; MFU = 4 x params x tokens "
              f"against {args.peak_tflops:.0f} TFLOP/s (bf16 matmul measured: "
              f"{lay0['matmul_bf16_tflops'] or float('nan'):.0f})")
        for lay in built:
            print(f"LoRA path {lay['layout']} {lay['path']} (recompute {lay['recompute']}): {lay['lora_path']}")
        print(table(built))
        if "export" in modes:
            print("\npublish export (mode export; per adapter, slowest rank; folders on /dev/shm):")
            print(export_table(built))
    if result["single"]:
        for s in result["single"]:
            print(f"\none GPU, recompute {s['recompute']}: largest slot count that trains a mixed round at {tokens} "
                  f"tokens: {s['largest_fitting']}")
        print(single_table(result["single"]))
    print(f"\nreproduce: python -m benchmarks.bench_parallel_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
