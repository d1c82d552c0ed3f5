"""GPU tier: LoRA in the GEMM (trainer/kernels/cutlass_lora), the CUTLASS kernel on an H200 (sm_90a).

* kernel level, every kernel configuration, forward (x W^T + h B_g^T) and input gradient
  (g W + gh A_g), Qwen3-1.7B and Qwen3-8B linear shapes (a few hundred tokens: the GEMM's N and K are
  the real ones), ranks 8 / 16 / 64, segment layouts with empty segments, odd offsets, tiles holding
  several segments, one segment: against the fp32 definition computed by torch from the same bf16
  operands, against the kernel's contract from its tile table (plan.emulate, fp32), and against
  today's path (cuBLAS + the segmented expand);
* node level: FusedLoraLinear with lora_gemm = cutlass against library (output, input gradient, both
  LoRA weight gradients, which stay on today's path but read the kernel's saved h) and against the
  fp32 definition through autograd; auto takes a measured decision;
* TP=2 (two GPUs, NCCL): the worker of tests/integration/test_fused_lora_tp.py at kernel-sized
  dimensions with lora_gemm = cutlass (column forward and input gradient, row input gradient on the
  kernel; the row forward keeps its delta after the all-reduce) against the fp64 definition and the
  general path.

Skipped without CUDA, on a GPU that is not sm_90, and where the extension cannot be built (nvcc or
the nvidia-cutlass headers missing): the build itself is the first check.
Tolerances: bf16 keeps 8 significant bits (3.9e-3 relative per rounding). The kernel rounds once (its
fp32 accumulator to bf16), so against the fp32 definition of the same bf16 operands it is within one
rounding of the largest element (KERNEL_TOL); today's path rounds the delta to bf16 first, so kernel
against today differs by up to two roundings (TODAY_TOL). A wrong slot, a row counted twice or a
missing LoRA block is an O(R / K)-to-O(1) error, far above these.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                                 reason="the kernel is built for sm_90a (H100 / H200)")]

KERNEL_TOL = 8e-3
TODAY_TOL = 1.6e-2
NODE_TOL = 3e-2  # node level: the LoRA weight gradients sum bf16 products over hundreds of tokens
# (in, out) of the four LoRA linears: (qkv, proj, fc1, fc2)
SHAPES = {
    "1.7b": [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048)],
    "8b": [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)],
}
SEGMENTS = {
    "aligned": [256, 0, 128, 384],            # every tile inside one segment: hblk is h (identity plan)
    "odd_empty": [0, 37, 0, 200, 1, 90, 0],   # odd offsets, empty segments inside and at both ends
    "many_per_tile": [3, 5, 7, 11, 13, 2, 250],  # six segments in the first tile
    "one": [301],
}
RANKS = (8, 16, 64)


@pytest.fixture(scope="module")
def ext():
    from trainer.kernels.cutlass_lora import kernels

    return kernels.extension()  # builds on first use (minutes): benchmarks/gpu_suite.sh builds it first


def _segment_of_rows(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).cuda()


def _operands(counts, fan_in, fan_out, rank, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, n_seg = sum(counts), len(counts)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    return {
        "x": rnd(t, fan_in), "w": rnd(fan_out, fan_in, scale=fan_in**-0.5),
        "a": rnd(n_seg, rank, fan_in, scale=fan_in**-0.5), "b": rnd(n_seg, fan_out, rank, scale=rank**-0.5),
        "h": rnd(t, rank), "gy": rnd(t, fan_out), "gh": rnd(t, rank),
    }


def _rel(got, want):
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("segments", sorted(SEGMENTS))
def test_kernel_against_definition_contract_and_todays_path(ext, model, segments):
    from trainer.kernels.cutlass_lora import kernels
    from trainer.kernels.cutlass_lora.plan import TilePlan, emulate
    from trainer.kernels.segmented_mm import segment_mm, segment_mm_nt

    counts = SEGMENTS[segments]
    seg = _segment_of_rows(counts)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    failures = []
    for i, (fan_in, fan_out) in enumerate(SHAPES[model]):
        rank = RANKS[i % len(RANKS)]
        o = _operands(counts, fan_in, fan_out, rank, seed=i)
        f = {k: v.float() for k, v in o.items()}
        fwd_def = f["x"] @ f["w"].t() + torch.einsum("tr,tnr->tn", f["h"], f["b"][seg])
        dx_def = f["gy"] @ f["w"] + torch.einsum("tr,trk->tk", f["gh"], f["a"][seg])
        fwd_today = segment_mm(o["h"], o["b"], offsets, counts, "grouped_mm").addmm_(o["x"], o["w"].t())
        dx_today = segment_mm_nt(o["gh"], o["a"], offsets, counts, "grouped_mm").addmm_(o["gy"], o["w"])
        for c, cfg in enumerate(kernels.CONFIGS):
            plan = TilePlan.of(counts, cfg.tile_m, "cuda")
            fwd = kernels.run("nk", o["x"], o["w"], o["h"], o["b"], plan, c)
            dx = kernels.run("kn", o["gy"], o["w"], o["gh"], o["a"], plan, c)
            fwd_contract = emulate(o["x"], o["w"].t(), plan.hblk(o["h"]), o["b"].transpose(1, 2), plan)
            dx_contract = emulate(o["gy"], o["w"], plan.hblk(o["gh"]), o["a"], plan)
            checks = {
                "fwd vs definition": (_rel(fwd, fwd_def), KERNEL_TOL),
                "fwd vs contract": (_rel(fwd, fwd_contract), KERNEL_TOL),
                "fwd vs today": (_rel(fwd, fwd_today.float()), TODAY_TOL),
                "dx vs definition": (_rel(dx, dx_def), KERNEL_TOL),
                "dx vs contract": (_rel(dx, dx_contract), KERNEL_TOL),
                "dx vs today": (_rel(dx, dx_today.float()), TODAY_TOL),
            }
            for name, (err, tol) in checks.items():
                print(f"{model} {segments} {fan_in}x{fan_out} r{rank} {cfg.name} {name}: {err:.2e}")
                if not err <= tol:  # NaN fails too
                    failures.append(f"{fan_in}x{fan_out} r{rank} {cfg.name} {name}: {err:.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)


def test_lora_term_is_not_lost(ext):
    """The LoRA blocks really run: with W = 0 the output is the delta alone (a kernel that skipped its
    extra K blocks would return zeros and still pass a loose test dominated by x W^T)."""
    from trainer.kernels.cutlass_lora import kernels
    from trainer.kernels.cutlass_lora.plan import TilePlan

    counts = SEGMENTS["odd_empty"]
    o = _operands(counts, 2048, 2048, 16, seed=7)
    seg = _segment_of_rows(counts)
    want = torch.einsum("tr,tnr->tn", o["h"].float(), o["b"].float()[seg])
    for c, cfg in enumerate(kernels.CONFIGS):
        got = kernels.run("nk", o["x"], torch.zeros_like(o["w"]), o["h"], o["b"],
                          TilePlan.of(counts, cfg.tile_m, "cuda"), c)
        assert _rel(got, want) <= KERNEL_TOL, cfg.name


def _node(lora_gemm, counts, fan_in, fan_out, rank, seed=0):
    """FusedLoraLinear forward + backward (bf16 activations, fp32 LoRA masters), returning
    (y, dx, dA, dB) and the fp32 definition's (by autograd)."""
    from trainer.lora.fused_lora import ComputeWeights, FusedLoraLinear, SlotSpan

    g = torch.Generator(device="cuda").manual_seed(seed)
    t, n_seg = sum(counts), len(counts)
    x = torch.randn(t, fan_in, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(fan_out, fan_in, generator=g, device="cuda") * fan_in**-0.5).to(torch.bfloat16)
    a = torch.randn(n_seg, rank, fan_in, generator=g, device="cuda") * fan_in**-0.5
    b = torch.randn(n_seg, fan_out, rank, generator=g, device="cuda") * rank**-0.5
    gy = torch.randn(t, fan_out, generator=g, device="cuda").to(torch.bfloat16)
    scales = torch.rand(n_seg, generator=g, device="cuda") + 0.5
    seg = _segment_of_rows(counts)
    a_param, b_param = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    a_c, b_c = ComputeWeights().get(a_param, b_param, torch.bfloat16)
    span = SlotSpan.of(torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32), counts)
    scale_col = scales[seg].to(torch.bfloat16)[:, None]
    xr = x.clone().requires_grad_()
    y = FusedLoraLinear.apply(xr, w, a_param, b_param, a_c, b_c, span, scale_col, "grouped_mm",
                              "triton", None, lora_gemm)
    y.backward(gy)
    got = (y.detach(), xr.grad, a_param.grad, b_param.grad)
    # the definition, fp32, from the same bf16 x / W / g and the fp32 masters
    xd, ad, bd = x.float().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_()
    s = scales[seg][:, None]
    yd = xd @ w.float().t() + torch.einsum("tr,tnr->tn", s * torch.einsum("tk,trk->tr", xd, ad[seg]), bd[seg])
    yd.backward(gy.float())
    return got, (yd.detach(), xd.grad, ad.grad, bd.grad)


@pytest.mark.parametrize("segments", ["aligned", "odd_empty"])
def test_fused_node_cutlass_against_library_and_definition(ext, segments):
    counts = SEGMENTS[segments]
    for fan_in, fan_out in SHAPES["1.7b"]:
        cutlass, definition = _node("cutlass", counts, fan_in, fan_out, 16)
        library, _ = _node("library", counts, fan_in, fan_out, 16)
        for name, got, lib, want in zip(("y", "dx", "dA", "dB"), cutlass, library, definition):
            assert _rel(got, want) <= NODE_TOL, f"{fan_in}x{fan_out} {name} vs definition: {_rel(got, want):.2e}"
            assert _rel(got, lib.float()) <= NODE_TOL, f"{fan_in}x{fan_out} {name} vs library: {_rel(got, lib.float()):.2e}"


def test_auto_measures_once_and_matches(ext):
    from trainer.kernels.cutlass_lora import dispatch

    dispatch.forget()
    counts = SEGMENTS["aligned"]
    auto, definition = _node("auto", counts, 2048, 4096, 16)
    keys = list(dispatch.decisions())
    assert {k[1] for k in keys} == {"nk", "kn"}, keys  # forward and input gradient each measured
    for d in dispatch.decisions().values():
        print("auto decision:", d)
        assert "today" in d.times_ms and len(d.times_ms) == 5
    _node("auto", counts, 2048, 4096, 16)
    assert list(dispatch.decisions()) == keys  # the second call reuses the decisions
    for name, got, want in zip(("y", "dx", "dA", "dB"), auto, definition):
        assert _rel(got, want) <= NODE_TOL, name


# -- TP=2 over NCCL --------------------------------------------------------------------------------

TP_DIMS = {"IN": 256, "OUT": 384, "R": 16, "SLOT_RANKS": [16, 8, 4, 16, 8, 12]}


def _tp_worker(rank, port, out_path):
    """The fused-node TP worker of test_fused_lora_tp at kernel-sized dimensions, lora_gemm = cutlass
    (SlotRouting's default for this process only), recording that the kernel ran."""
    from tests.integration import test_fused_lora_tp as tp_cases
    from trainer.kernels.cutlass_lora import dispatch
    from trainer.lora.multi_lora import SlotRouting

    for name, value in TP_DIMS.items():
        setattr(tp_cases, name, value)
    defaults = list(SlotRouting.__init__.__defaults__)
    defaults[-1] = "cutlass"  # lora_gemm
    SlotRouting.__init__.__defaults__ = tuple(defaults)
    cases = [c for c in tp_cases.CASES if "loop" not in c]  # grouped today's path (the kernel is bf16 only)
    tp_cases._worker(rank, port, out_path, "bfloat16", cases)
    if rank == 0:
        res = torch.load(out_path, weights_only=False)
        res["kernel_keys"] = sorted(k[1] for k in dispatch.decisions())
        torch.save(res, out_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_node_tp2_with_the_kernel_over_nccl(ext, tmp_path):
    import torch.multiprocessing as mp

    from tests.gpu.test_parallel_bf16_gpu import LAYER_BF16_TOL
    from trainer.platform.distributed import free_loopback_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = tmp_path / "results.pt"
    mp.spawn(_tp_worker, args=(free_loopback_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out, weights_only=False)
    assert set(results["kernel_keys"]) == {"nk", "kn"}, results["kernel_keys"]
    failures = []
    for case, res in results.items():
        if case in ("refusals", "kernel_keys"):
            continue
        for name, err in res["errs"].items():
            print(f"tp2 cutlass {case} {name}: {err:.2e}")
            if name.startswith("fused") and not err <= LAYER_BF16_TOL:
                failures.append(f"{case} {name}: {err:.2e}")
        if res["replicated_spread"][0] != 0.0:
            failures.append(f"{case}: replicated gradient spread {res['replicated_spread'][0]}")
    assert not failures, "\n".join(failures)
