"""Trainer-side cost of publishing at real size: exporting stepped slots of the Qwen3-8B shape.

What a publish costs on the trainer rank before any byte leaves it (issue 18 item 3, "trainer-side
export and serialization on the GPU machine"), for N = 1, 16, 64 stepped slots of rank 16 on
every linear (43.6 M parameters per adapter) resident in one trainer (random base, random slots:
the cost does not depend on the values), one rank:

  gather   MultiLoraTrainer.peft_tensors(slot): the slot's blocks gathered to the TP=1 layout,
           copied off the GPU as fp32, renamed to PEFT names (what every publish runs first)
  export   MultiLoraTrainer.export_peft(slot, folder): the gather plus the safetensors write
           (fp32: 174 MB per adapter) and adapter_config.json, into /dev/shm (tmpfs: the disk
           is taken out of the number) unless --folder says otherwise

Per-adapter ms (median over the N slots) and the round's total (N adapters, one after another:
what the trainer rank spends on the loop's publishes per round today).

    python -m benchmarks.bench_export --out export.json          # one GPU
    python -m benchmarks.bench_export --tiny                      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks.bench_mixed_step import TINY, init_slots  # noqa: E402
from benchmarks.bench_parallel_step import QWEN3_8B, build_trainer, spawn, write_untied_config  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def worker(rank: int, port: int, opts: dict, out_path: str) -> None:
    import torch.distributed as dist

    t0 = time.perf_counter()
    trainer = build_trainer(opts, "single", opts["slots"], "none", rank, port)
    n_max = max(opts["n"])
    init_slots(trainer, n_max, 1, opts["rank"], "sft")
    result = {"build_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "rows": []}
    print(f"# built in {result['build_s']:.1f} s on {result['device']}; {n_max} slots of rank {opts['rank']}", flush=True)
    cfg, tensors = trainer.peft_tensors(0)  # warm-up (and the adapter's size)
    result["params_per_adapter"] = sum(t.numel() for t in tensors.values())
    result["fp32_mb_per_adapter"] = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    root = tempfile.mkdtemp(dir=opts["folder_root"])
    try:
        for n in opts["n"]:
            row = {"n": n}
            for mode in ("gather", "export"):
                per = []
                for slot in range(n):
                    _sync()
                    t = time.perf_counter()
                    if mode == "gather":
                        trainer.peft_tensors(slot)
                    else:
                        trainer.export_peft(slot, os.path.join(root, f"s{slot}"))
                    per.append((time.perf_counter() - t) * 1e3)
                row[mode] = {"per_adapter_ms": statistics.median(per), "round_ms": sum(per)}
                print(f"N={n:3d} {mode:7s} {row[mode]['per_adapter_ms']:8.1f} ms per adapter, {row[mode]['round_ms']:9.1f} ms per round",
                      flush=True)
            shutil.rmtree(root)
            os.makedirs(root)
            result["rows"].append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU: a smoke test (numbers meaningless)")
    ap.add_argument("--n", default="1,16,64", help="comma list of stepped adapters per round")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--folder", default=None, help="where the folders are written (default /dev/shm, else the temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        ap.error("without CUDA only --tiny runs (the 8B shape is for GPUs)")
    n = sorted({int(x) for x in args.n.split(",")})
    if not n or n[0] < 1:
        ap.error(f"--n takes positive counts; got {args.n!r}")
    folder_root = args.folder or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    with tempfile.TemporaryDirectory() as tmp:
        shape = TINY if args.tiny else QWEN3_8B
        opts = {"folder": write_untied_config(shape, os.path.join(tmp, "model"), False), "shape": shape, "slots": max(n),
                "rank": args.rank, "micro_batch_tokens": 512 if args.tiny else 16384, "collective_timeout_s": 300.0,
                "n": n, "folder_root": folder_root}
        out = os.path.join(tmp, "export.json")
        spawn(worker, 1, opts, out)
        with open(out) as f:
            result = json.load(f)
    result["command"] = "python -m benchmarks.bench_export " + " ".join(argv if argv is not None else os.sys.argv[1:])
    print(f"{result['params_per_adapter'] / 1e6:.1f} M parameters per adapter ({result['fp32_mb_per_adapter']:.0f} MB fp32)")
    print("| stepped adapters | gather ms per adapter | export ms per adapter | gather per round s | export per round s |")
    print("|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['n']} | {r['gather']['per_adapter_ms']:.1f} | {r['export']['per_adapter_ms']:.1f} | "
              f"{r['gather']['round_ms'] / 1e3:.2f} | {r['export']['round_ms'] / 1e3:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
