"""Keep-warm eviction: what a swap-out and a swap-in of one slot cost, per tier, by adapter size.

A slot's state is one row of each of the trainer's four slot-major fp32 buffers (weights,
gradient, two Adam moments: trainer/lora/slot_buffers.py), so a swap moves 4 x P x 4 bytes, P the
LoRA elements per slot in Megatron's layout (fused qkv and fc1, one A each). This runs the code
a swap runs (trainer/swap/slot_swap.py copy_rows_out / copy_rows_in, trainer/swap/swap_store.py SwapStore:
pinned host memory on CUDA, checksummed spill files) on buffers of the real row size:

  out_host     device -> host copy, stored in host memory
  out_disk     device -> host copy, then the spill file (checksums, write, fsync, rename)
  in_host      host -> device copy
  in_disk      the spill file read cold (its pages dropped from the page cache first) into
               pinned memory and verified, then host -> device
  prefetch     the same read and check, on the store's background thread (off the round's path)
  in_prefetch  the swap-in after a finished prefetch: host -> device
A turn (one run out, another in) costs out + in of its tiers; "rotate R x S" prices giving each
of R runs one turn in S slots (R - S swap-outs and R - S swap-ins beyond the first S residents).

  python -m benchmarks.bench_slot_swap --device cuda --shapes qwen3-8b --out swap_gpu.json
  python -m benchmarks.bench_slot_swap --device cpu --shapes tiny,qwen3-1.7b --out swap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer.swap.slot_swap import copy_rows_in, copy_rows_out
from trainer.swap.swap_store import SlotSnapshot, SwapStore

# hidden, layers, q heads, kv heads, head dim, intermediate (the models' HF configs)
SHAPES = {
    "tiny": (64, 4, 4, 2, 16, 128),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288),
}
KINDS = ("weight", "grad", "exp_avg", "exp_avg_sq")


def lora_elements(shape: str, rank: int) -> int:
    """LoRA elements per slot on qkv, proj, fc1, fc2 of every layer: rank x (in + out) each."""
    h, n_layers, q, kv, d, ffn = SHAPES[shape]
    per_layer = (h + (q + 2 * kv) * d) + (q * d + h) + (h + 2 * ffn) + (ffn + h)
    return rank * per_layer * n_layers


def drop_page_cache(path) -> None:  # noqa: ANN001
    """Evict the (fsynced, so clean) file's pages, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench(shape: str, rank: int, device: str, iters: int, spill_dir: str) -> dict:
    p = lora_elements(shape, rank)
    buffers = {k: torch.randn(3, p, device=device) for k in KINDS}
    want = {k: buffers[k][1].clone() for k in KINDS}
    row_bytes = 4 * p * 4
    store = SwapStore(2**50, spill_dir, 2**50, pin=device == "cuda")
    meta, pending = {"step": 3}, torch.arange(7, dtype=torch.float64)
    t: dict[str, list[float]] = {k: [] for k in ("out_host", "in_host", "out_disk", "in_disk", "in_disk_warm",
                                                 "prefetch", "in_prefetch")}

    def out(key: str, tier_budget: int) -> None:
        store.host_budget_bytes = tier_budget
        t0 = time.perf_counter()
        where = store.put(key, SlotSnapshot(meta=meta, pending=pending, rows=copy_rows_out(buffers, 1)))
        t["out_host" if where == "host" else "out_disk"].append(time.perf_counter() - t0)

    def back(key: str, into: str) -> None:
        buffers_slot = 2
        t0 = time.perf_counter()
        snap, _ = store.load(key)
        copy_rows_in(buffers, buffers_slot, snap.rows)
        t[into].append(time.perf_counter() - t0)
        store.drop(key)
        assert all(torch.equal(buffers[k][buffers_slot], want[k]) for k in KINDS), "a swap changed the bytes"
        for k in KINDS:
            buffers[k][buffers_slot].zero_()

    for i in range(iters + 1):  # the first round warms allocators and the page cache's own paths
        out(f"h{i}", 2**50)
        back(f"h{i}", "in_host")
        out(f"d{i}", 0)
        drop_page_cache(store.spill_path(f"d{i}"))
        back(f"d{i}", "in_disk")
        out(f"w{i}", 0)
        back(f"w{i}", "in_disk_warm")  # just written: its pages still cached
        out(f"p{i}", 0)
        drop_page_cache(store.spill_path(f"p{i}"))
        store.host_budget_bytes = 2**50
        t0 = time.perf_counter()
        assert store.prefetch(f"p{i}") == "started"
        while store.prefetch(f"p{i}") != "prefetched":  # waited here only to time the background read
            time.sleep(0.001)
        t["prefetch"].append(time.perf_counter() - t0)
        back(f"p{i}", "in_prefetch")
        if i == 0:
            for k in t:
                t[k].clear()
    row = {"shape": shape, "rank": rank, "lora_params": p, "snapshot_mib": row_bytes / 2**20, "device": device,
           "iters": iters, **{f"{k}_ms": ms(v) for k, v in t.items()}}
    row["turn_host_ms"] = row["out_host_ms"] + row["in_host_ms"]
    row["turn_disk_ms"] = row["out_disk_ms"] + row["in_disk_ms"]
    row["turn_disk_prefetched_ms"] = row["out_disk_ms"] + row["in_prefetch_ms"]  # the read ran beside the round
    row["host_gb_per_s"] = row_bytes / (min(row["out_host_ms"], row["in_host_ms"]) / 1e3) / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="tiny,qwen3-1.7b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rotate", default="64x16", help="RUNSxSLOTS priced from the measured turn times")
    ap.add_argument("--spill-dir", default=None, help="where the spill files go (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs, slots = (int(x) for x in args.rotate.split("x"))
    if args.spill_dir is not None:  # a folder named on the command line is made, as the trainer makes its own
        Path(args.spill_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(dir=args.spill_dir) as d:
            r = bench(shape, args.rank, args.device, args.iters, d)
        r["rotate"] = args.rotate
        for tier in ("host", "disk", "disk_prefetched"):
            r[f"rotate_{tier}_s"] = (runs - slots) * r[f"turn_{tier}_ms"] / 1e3
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
