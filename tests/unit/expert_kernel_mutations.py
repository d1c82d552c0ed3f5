"""Plant bugs in the expert-LoRA kernels one at a time and check that a test fails for each.

    python -m tests.unit.expert_kernel_mutations            # every mutation (a few minutes on the CPU)
    python -m tests.unit.expert_kernel_mutations wgrad_no_accumulate expand_no_accumulate

Each mutation replaces one exact piece of trainer/kernels/triton_expert_lora.py,
trainer/lora/expert_lora_nodes.py or the MoE layer's routing helpers (trainer/lora/moe_lora.py), runs the kernel and node tests (Triton's interpreter on the
CPU) in a subprocess, and restores the file (also when interrupted). A mutation that no
test catches is printed as SURVIVED and the exit status is 1.
"""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO

ROOT = REPO
KERNELS = "trainer/kernels/triton_expert_lora.py"
NODES = "trainer/lora/expert_lora_nodes.py"
LAYER = "trainer/lora/moe_lora.py"
TESTS = ["tests/unit/test_triton_expert_lora.py", "tests/unit/test_moe_lora.py"]

# name: (file, exact text, replacement, what the bug is)
MUTATIONS = {
    "tile_end_off_by_one": (KERNELS, "r1 = torch.minimum(r0 + bt, row_end[g])", "r1 = torch.minimum(r0 + bt, row_end[g] + 1)",
                            "segment bound: a tile runs one row into the next group"),
    "tile_row_bound": (KERNELS, "return g, r0, r1, rows, rows < r1, rr, rr < R", "return g, r0, r1, rows, rows <= r1, rr, rr < R",
                       "segment bound: the shrink and the expand take one row past their tile"),
    "wgrad_row_bound": (KERNELS, "t_ok = ts < r1 - t0", "t_ok = ts < r1 - t0 + 1",
                        "segment bound: a group's weight gradient takes the next group's first row"),
    "shrink_slot_expert_strides": (KERNELS, "x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(wide_dim)",
                                   "x.stride(0), x.stride(1), w.stride(1), w.stride(0), w.stride(wide_dim)",
                                   "wrong stride: slot and expert strides of the weights exchanged"),
    "shrink_k_step_stride": (KERNELS, "w_ptrs += BK * sw_k", "w_ptrs += BK * sw_r",
                             "wrong stride: the weights advance along the rank, not the wide dim"),
    "expand_out_stride": (KERNELS, "y_ptrs += BN * sy_n", "y_ptrs += BN * sy_t",
                          "wrong stride: the expand's output advances by rows"),
    "group_to_slot_expert": (KERNELS, "w_ptrs = w_ptr + (g % S) * sw_s + (g // S) * sw_e + ks",
                             "w_ptrs = w_ptr + (g // S) * sw_s + (g % S) * sw_e + ks",
                             "group g read as (slot g // S, expert g % S)"),
    "shrink_no_accumulate": (KERNELS, "acc += tl.dot(xt, wt, input_precision=PREC)", "acc = tl.dot(xt, wt, input_precision=PREC)",
                             "missing accumulation over the wide dim's blocks"),
    "expand_no_accumulate": (KERNELS, "acc += tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)", "pass",
                             "missing accumulation: the expand overwrites the expert GEMM's output"),
    "wgrad_no_accumulate": (KERNELS, "tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + acc, mask=ok)",
                            "tl.store(ptrs, acc, mask=ok)", "missing accumulation into the existing gradient"),
    "wgrad_rows_no_accumulate": (KERNELS, "acc += tl.dot(tl.trans(pt), qt, input_precision=PREC)",
                                 "acc = tl.dot(tl.trans(pt), qt, input_precision=PREC)",
                                 "missing accumulation over a group's row blocks"),
    "wgrad_transposed": (KERNELS, "grad.stride(0), grad.stride(1), grad.stride(wide_dim), grad.stride(rank_dim)",
                         "grad.stride(0), grad.stride(1), grad.stride(rank_dim), grad.stride(wide_dim)",
                         "transposed gradient: dW written as its transpose"),
    "scale_missing_in_gh": (NODES, "gh = tx.shrink(gy, b, tiles, row_scale, wide_dim=2)  # scaled",
                            "gh = tx.shrink(gy, b, tiles, None, wide_dim=2)  # scaled",
                            "the fused node's gh without the slot's scale (dA wrong)"),
    "fused_grads_swapped": (NODES, "tx.weight_grad_into(grad_b, gy, h, tiles, wide_dim=2)\n        tx.weight_grad_into(grad_a, x, gh, tiles, wide_dim=3)",
                            "tx.weight_grad_into(grad_b, gy, h, tiles, wide_dim=2)\n        tx.weight_grad_into(grad_a, x, gh * 0.5, tiles, wide_dim=3)",
                            "the fused node's dA from a wrong gh"),
    "pairs_token_order": (LAYER, "tok = torch.arange(t * topk, device=dev) // topk",
                          "tok = torch.arange(t * topk, device=dev) % t",
                          "routed pairs: the token ids interleaved instead of token-major"),
    "pairs_expert_order": (LAYER, "place = torch.where(routing_map, routed_upto - 1, topk + ids - routed_upto)",
                           "place = torch.where(routing_map, topk - routed_upto, topk + ids - routed_upto)",
                           "routed pairs: a token's experts descending (nonzero's order is ascending)"),
    "pairs_unrouted_first": (LAYER, "place = torch.where(routing_map, routed_upto - 1, topk + ids - routed_upto)",
                             "place = torch.where(routing_map, e - topk + routed_upto - 1, ids - routed_upto)",
                             "routed pairs: the unrouted experts placed first (the pairs name wrong experts)"),
    "counts_last_group_lost": (LAYER, "scatter_add_(0, key, torch.ones_like(key))",
                               "scatter_add_(0, key.clamp(max=groups - 2), torch.ones_like(key))",
                               "group counts: the last group's pairs counted in the group before it"),
}


def run(name: str, mutations: dict = MUTATIONS, tests: list[str] = TESTS) -> bool:
    """Plant ``mutations[name]``, run ``tests`` in a subprocess, restore the file; True when caught."""
    rel, old, new, _ = mutations[name]
    path = ROOT / rel
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to mutate is not in {rel} exactly once (the code moved?)")
    try:
        path.write_text(text.replace(old, new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(text)
    tail = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")][:1]
    print(f"{name:28s} {'caught' if proc.returncode else 'SURVIVED'}  {tail[0][7:110] if tail else ''}", flush=True)
    return proc.returncode != 0


def main(argv: list[str], mutations: dict = MUTATIONS, tests: list[str] = TESTS) -> int:
    """Every mutation named in ``argv`` (default all), one at a time; 1 if any survived."""
    names = argv or list(mutations)
    unknown = [n for n in names if n not in mutations]
    if unknown:
        raise SystemExit(f"unknown mutations {unknown}: choose from {', '.join(mutations)}")
    return 0 if all([run(n, mutations, tests) for n in names]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
