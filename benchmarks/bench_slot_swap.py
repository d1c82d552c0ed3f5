"""Keep-warm eviction: what a swap-out and a swap-in of one slot cost, by adapter size.

A slot's state is one row of each of the trainer's four slot-major fp32 buffers (weights,
gradient, two Adam moments: trainer/slot_buffers.py), so a swap moves 4 x P x 4 bytes, P the
LoRA elements per slot in Megatron's layout (fused qkv and fc1, one A each). This times the
trainer's own copy functions (trainer/slot_swap.py copy_rows_out / copy_rows_in, pinned host
memory on CUDA) on buffers of the real row size, and on CPU the spill-file round trip too.
It also prices rotating R runs through S slots once (each run in for a turn: R - S swap-outs
and R - S swap-ins beyond the first S residents).

  python -m benchmarks.bench_slot_swap --device cpu --shapes tiny,qwen3-1.7b --out swap_cpu.json
  python -m benchmarks.bench_slot_swap --device cuda --shapes qwen3-1.7b,qwen3-8b --out swap_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from trainer.slot_swap import SlotSnapshot, SwapStore, copy_rows_in, copy_rows_out

# hidden, layers, q heads, kv heads, head dim, intermediate (the models' HF configs)
SHAPES = {
    "tiny": (64, 4, 4, 2, 16, 128),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288),
}


def lora_elements(shape: str, rank: int) -> int:
    """LoRA elements per slot on qkv, proj, fc1, fc2 of every layer: rank x (in + out) each."""
    h, n_layers, q, kv, d, ffn = SHAPES[shape]
    per_layer = (h + (q + 2 * kv) * d) + (q * d + h) + (h + 2 * ffn) + (ffn + h)
    return rank * per_layer * n_layers


def median_s(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(shape: str, rank: int, slots: int, device: str, iters: int, spill: bool) -> dict:
    p = lora_elements(shape, rank)
    buffers = {k: torch.randn(slots, p, device=device) for k in ("weight", "grad", "exp_avg", "exp_avg_sq")}
    row_bytes = 4 * p * 4
    out_s = median_s(lambda: copy_rows_out(buffers, 1), iters)
    rows = copy_rows_out(buffers, 1)
    in_s = median_s(lambda: copy_rows_in(buffers, 2, rows), iters)
    assert all(torch.equal(buffers[k][2].cpu(), rows[k].cpu()) for k in rows)
    row = {"shape": shape, "rank": rank, "lora_params": p, "snapshot_mb": row_bytes / 2**20, "device": device,
           "swap_out_ms": out_s * 1e3, "swap_in_ms": in_s * 1e3,
           "gb_per_s": row_bytes / min(out_s, in_s) / 1e9}
    if spill:
        with tempfile.TemporaryDirectory() as d:
            store = SwapStore(host_budget_bytes=0, spill_dir=d)

            def round_trip():
                store.put("k", SlotSnapshot(meta={}, pending=torch.zeros(7, dtype=torch.float64), rows=dict(rows)))
                store.take("k")

            row["spill_round_trip_ms"] = median_s(round_trip, max(1, iters // 2)) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="tiny,qwen3-1.7b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4, help="buffer rows allocated (the copies touch two)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rotate", default="64x16", help="RUNSxSLOTS priced from the measured swap times")
    ap.add_argument("--no-spill", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs, slots = (int(x) for x in args.rotate.split("x"))
    rows = []
    for shape in args.shapes.split(","):
        r = bench(shape, args.rank, args.slots, args.device, args.iters, spill=not args.no_spill and args.device == "cpu")
        r["rotate"] = args.rotate
        r["rotate_s"] = (runs - slots) * (r["swap_out_ms"] + r["swap_in_ms"]) / 1e3
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
