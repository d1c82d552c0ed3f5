"""The expert-LoRA Triton kernels alone at the MoE benchmark's shapes, over tile and launch variants.

Per (expert, slot) group layout of one MoE layer of the Qwen3-30B-A3B shape (bench_moe_step.py):
16384 tokens x top-8 = 131072 routed pairs over 128 experts x N slots (uniform random routing,
each token's slot from N equal segments), rank 16, bf16 activations, fp32 slot-major weights and
gradients. Per variant, the median ms (triton.testing.do_bench) of the six uses of one layer:

  fc1 (2048 -> 1536): shrink x A^T, expand h B^T, shrink g B, expand gh A, dA, dB
  fc2 (768 -> 2048):  the same

and their sum. A variant sets module attributes of trainer/kernels/triton_expert_lora.py (block sizes,
LAUNCH options); each variant's outputs are checked against the defaults' (bf16 rounding) before
timing, so a variant that computes something else is reported, not timed.

  python -m benchmarks.bench_expert_kernels --out kernels.json          # GPU
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from trainer.kernels import triton_expert_lora as tx

E, R, M = 128, 16, 16384 * 8
LINEARS = {"fc1": (2048, 1536), "fc2": (768, 2048)}
CURRENT: dict = {}

# name: attribute overrides (LAUNCH entries as "launch.<kernel>": {...})
VARIANTS: dict[str, dict] = {
    "default": {},
    "bt32": {"TILE_ROWS": 32},
    "bt128": {"TILE_ROWS": 128},
    "bt128_w8": {"TILE_ROWS": 128, "launch.shrink": {"num_warps": 8}, "launch.expand": {"num_warps": 8}},
    "w8": {"launch.shrink": {"num_warps": 8}, "launch.expand": {"num_warps": 8}, "launch.wgrad": {"num_warps": 8}},
    "bk256": {"SHRINK_COLS": 256},
    "bk64": {"SHRINK_COLS": 64},
    "bn256": {"EXPAND_COLS": 256},
    "bn64": {"EXPAND_COLS": 64},
    "bn256_w8": {"EXPAND_COLS": 256, "launch.expand": {"num_warps": 8}},
    "st4": {"launch.shrink": {"num_stages": 4}, "launch.expand": {"num_stages": 4}, "launch.wgrad": {"num_stages": 4}},
    "st2": {"launch.shrink": {"num_stages": 2}, "launch.expand": {"num_stages": 2}, "launch.wgrad": {"num_stages": 2}},
    "wg_bm128": {"WGRAD_COLS": 128},
    "wg_bm32": {"WGRAD_COLS": 32},
    "wg_rows128": {"WGRAD_ROWS": 128},
    "wg_rows32": {"WGRAD_ROWS": 32},
    "wg_bm128_w8": {"WGRAD_COLS": 128, "launch.wgrad": {"num_warps": 8}},
}


def apply(variant: dict) -> dict:
    """Set a variant's attributes; returns what to restore."""
    saved = {}
    for key, value in variant.items():
        if key.startswith("launch."):
            kernel = key.split(".", 1)[1]
            saved[key] = dict(tx.LAUNCH[kernel])
            tx.LAUNCH[kernel] = dict(value)
        else:
            saved[key] = getattr(tx, key)
            setattr(tx, key, value)
    return saved


def layout(n: int, gen: torch.Generator) -> torch.Tensor:
    """Group counts [E * n] of M pairs: token t in slot t * n // T, expert uniform (top-8 of 128)."""
    tokens = M // 8
    slot = (torch.arange(tokens) * n // tokens).repeat_interleave(8)
    expert = torch.rand(tokens, E, generator=gen).topk(8, dim=1).indices.reshape(-1)
    return torch.bincount(expert * n + slot, minlength=E * n)


def uses(n: int, gen: torch.Generator) -> dict:
    """The six calls of each linear at span n: {use: (timed call, check call returning a fresh
    result)}, over random operands."""
    dev = "cuda"
    out = {}
    for name, (k, nc) in LINEARS.items():
        x = torch.randn(M, k, generator=gen).to(dev, torch.bfloat16)
        gy = torch.randn(M, nc, generator=gen).to(dev, torch.bfloat16)
        a = (torch.randn(n, E, R, k, generator=gen) * 0.02).to(dev)
        b = (torch.randn(n, E, nc, R, generator=gen) * 0.02).to(dev)
        scale = torch.full((M,), 2.0, device=dev)
        h = torch.randn(M, R, generator=gen).to(dev, torch.bfloat16)
        y0 = torch.randn(M, nc, device=dev, dtype=torch.bfloat16)
        y, gx = y0.clone(), torch.empty(M, k, device=dev, dtype=torch.bfloat16)
        grad_a, grad_b = torch.zeros_like(a), torch.zeros_like(b)

        def tiles():
            return CURRENT["tiles"]  # built once per variant (its TILE_ROWS), outside the timed calls

        def fresh_grad(g, wide, side, dim):
            g = torch.zeros_like(g)
            tx.weight_grad_into(g, wide, side, tiles(), wide_dim=dim)
            return g

        out[f"{name} shrink-xA"] = (lambda x=x, a=a, s=scale: tx.shrink(x, a, tiles(), s, wide_dim=3),) * 2
        out[f"{name} expand-hB"] = (lambda y=y, h=h, b=b: tx.expand_into(y, h, b, tiles(), rank_dim=3),
                                    lambda y0=y0, h=h, b=b: tx.expand_into(y0.clone(), h, b, tiles(), rank_dim=3))
        out[f"{name} shrink-gB"] = (lambda gy=gy, b=b, s=scale: tx.shrink(gy, b, tiles(), s, wide_dim=2),) * 2
        out[f"{name} expand-ghA"] = (lambda gx=gx, h=h, a=a: tx.expand_into(gx, h, a, tiles(), rank_dim=2,
                                                                            accumulate=False),) * 2
        out[f"{name} dA"] = (lambda g=grad_a, x=x, h=h: tx.weight_grad_into(g, x, h, tiles(), wide_dim=3),
                             lambda g=grad_a, x=x, h=h: fresh_grad(g, x, h, 3))
        out[f"{name} dB"] = (lambda g=grad_b, gy=gy, h=h: tx.weight_grad_into(g, gy, h, tiles(), wide_dim=2),
                             lambda g=grad_b, gy=gy, h=h: fresh_grad(g, gy, h, 2))
    return out


def main(argv: list[str] | None = None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1,8,32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for n in [int(v) for v in args.n.split(",")]:
        counts = layout(n, gen)
        calls = uses(n, gen)
        ref = {}
        for vname in args.variants.split(","):
            saved = apply(VARIANTS[vname])
            try:
                CURRENT["tiles"] = tx.GroupTiles.of(counts.cuda(), M, n)
                row = {}
                for use, (fn, check) in calls.items():
                    got = check().float()
                    if vname == "default":
                        ref[use] = got
                    elif not torch.isfinite(got).all() or (got - ref[use]).norm() > 2e-2 * ref[use].norm():
                        row[use] = "WRONG"
                        continue
                    row[use] = round(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"), 4)
                timed = [v for v in row.values() if isinstance(v, float)]
                row["sum"] = round(sum(timed), 3) if len(timed) == len(calls) else None
            finally:
                apply(saved)
            results[f"N={n} {vname}"] = row
            print(f"N={n:2d} {vname:12s} sum {row['sum']} ms  " + "  ".join(f"{k} {v}" for k, v in row.items()
                                                                            if k != "sum"), flush=True)
        del calls
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    print(f"\nreproduce: python -m benchmarks.bench_expert_kernels {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
