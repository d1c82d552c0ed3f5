"""One LoRA-wrapped linear on the GPU: what the LoRA costs on top of the frozen base GEMMs.

For each linear of the Qwen3-1.7B shape (qkv 2048->4096, proj 2048->2048, fc1
2048->12288, fc2 6144->2048), 16384 tokens in G equal slot segments, rank 16, bf16:

  base      x @ W.T forward and g @ W backward (frozen weight: no weight gradient)
  fused     trainer/lora/fused_lora.py's node, forward + backward (dx, dA, dB)
  triton    the same node with its rank-R reductions in Triton (triton_lora.py)
  and each rank-R GEMM of the fused node alone (shrink x A^T, expand h B^T, g B,
  gh A, dB = g^T h, dA = gh^T x), plus the memory floor of the LoRA part: the bytes
  the six GEMMs must move (3 x (in + out) x T x 2) plus the C operand reads of the two
  addmm_ (in + out) at the measured copy bandwidth.

Medians of --iters CUDA-event timings after warm-up.

  python -m benchmarks.bench_lora_layer --out lora_layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

SHAPES = {"qkv": (2048, 4096), "proj": (2048, 2048), "fc1": (2048, 12288), "fc2": (6144, 2048)}


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s (read + write), 2 GiB buffers."""
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() * 2 / (ms / 1e3)


def bench_shape(name: str, fan_in: int, fan_out: int, groups: int, tokens: int, rank: int, iters: int) -> dict:
    from trainer.lora.fused_lora import FusedLoraLinear, SlotSpan
    from trainer.kernels import triton_lora
    from trainer.kernels.segmented_mm import segment_mm, segment_mm_nt, segment_weight_grad

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w = torch.randn(fan_out, fan_in, device=dev, dtype=dt) / fan_in**0.5
    a_param = torch.nn.Parameter(torch.randn(groups, rank, fan_in, device=dev) / fan_in**0.5)
    b_param = torch.nn.Parameter(torch.randn(groups, fan_out, rank, device=dev) / rank**0.5)
    a_param.grad, b_param.grad = torch.zeros_like(a_param), torch.zeros_like(b_param)
    a_c, b_c = a_param.detach().to(dt), b_param.detach().to(dt)
    counts = [tokens // groups] * groups
    counts[-1] += tokens - sum(counts)
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    span = SlotSpan.of(offsets, counts)
    scale = torch.full((tokens, 1), 2.0, device=dev, dtype=dt)
    x = torch.randn(tokens, fan_in, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(tokens, fan_out, device=dev, dtype=dt)
    h = torch.randn(tokens, rank, device=dev, dtype=dt)
    k = "grouped_mm"

    def base():
        y = x.detach() @ w.t()
        return y, g @ w

    def fused(rank_kernels="library"):
        y = FusedLoraLinear.apply(x, w, a_param, b_param, a_c, b_c, span, scale, k, rank_kernels)
        return torch.autograd.grad(y, x, g)  # dx returned (as base() returns it); dA, dB accumulate

    # the two variants agree (bf16 rounding apart) before either is timed
    a_param.grad.zero_()
    dx_lib, ga_lib = fused()[0], a_param.grad.clone()
    a_param.grad.zero_()
    dx_tl, ga_tl = fused("triton")[0], a_param.grad.clone()
    for what, got, ref in (("dx", dx_tl, dx_lib), ("dA", ga_tl, ga_lib)):
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if err > 2e-2:
            raise SystemExit(f"{name} G={groups}: triton {what} differs from the library node by {err:.2e}")

    row = {"shape": name, "in": fan_in, "out": fan_out, "groups": groups, "tokens": tokens}
    row["base_ms"] = timed(base, iters)
    row["fused_ms"] = timed(fused, iters)
    row["triton_ms"] = timed(lambda: fused("triton"), iters)
    xd = x.detach()
    tiles = span.tiles(dev)
    ga, gb = a_param.grad, b_param.grad
    parts = {
        "shrink": lambda: segment_mm(xd, a_c, offsets, counts, k),
        "expand": lambda: segment_mm(h, b_c, offsets, counts, k),
        "g_B": lambda: segment_mm_nt(g, b_c, offsets, counts, k),
        "gh_A": lambda: segment_mm_nt(h, a_c, offsets, counts, k),
        "dB": lambda: segment_weight_grad(g, h, offsets, counts, k),
        "dA": lambda: segment_weight_grad(h, xd, offsets, counts, k),
        "shrink_tl": lambda: triton_lora.shrink(xd, a_c, tiles, scale, wide_dim=2),
        "g_B_tl": lambda: triton_lora.shrink(g, b_c, tiles, scale, wide_dim=1),
        "dB_tl": lambda: triton_lora.weight_grad_into(gb, g, h, tiles, wide_dim=1),
        "dA_tl": lambda: triton_lora.weight_grad_into(ga, xd, h, tiles, wide_dim=2),
    }
    for part, fn in parts.items():
        row[f"{part}_ms"] = timed(fn, iters)
    row["lora_ms"] = row["fused_ms"] - row["base_ms"]
    row["lora_triton_ms"] = row["triton_ms"] - row["base_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--groups", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for groups in (int(x) for x in args.groups.split(",")):
        for name, (fan_in, fan_out) in SHAPES.items():
            row = bench_shape(name, fan_in, fan_out, groups, args.tokens, args.rank, args.iters)
            row["floor_ms"] = (4 * (fan_in + fan_out) * args.tokens * 2) / bw * 1e3
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print("\n| linear | G | base ms | fused ms | LoRA ms | LoRA ms, Triton | floor ms "
          "| shrink / expand / g B / gh A / dB / dA ms | Triton shrink / g B / dB / dA ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = " / ".join(f"{r[p + '_ms']:.3f}" for p in ("shrink", "expand", "g_B", "gh_A", "dB", "dA"))
        tl_parts = " / ".join(f"{r[p + '_tl_ms']:.3f}" for p in ("shrink", "g_B", "dB", "dA"))
        print(f"| {r['shape']} {r['in']}->{r['out']} | {r['groups']} | {r['base_ms']:.3f} | {r['fused_ms']:.3f} | "
              f"{r['lora_ms']:.3f} | {r['lora_triton_ms']:.3f} | {r['floor_ms']:.3f} | {parts} | {tl_parts} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
