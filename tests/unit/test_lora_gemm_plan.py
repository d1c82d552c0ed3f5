"""The CPU-checkable parts of LoRA in the GEMM (trainer/kernels/cutlass_lora): the row-tile table the
CUDA kernel reads, the kernel's contract computed from that table against the definition, the
dispatch rule on the CPU (today's path, bit for bit, and the extension never touched), and the
kernel configuration table the C++ header and Python share. The kernel itself runs in
tests/gpu/test_lora_gemm_gpu.py.

The definitions here are written from the formulas, not from the product code:
  forward          y[t]  = x[t] W^T + h[t] B_{g(t)}^T
  input gradient   gx[t] = g[t] W   + gh[t] A_{g(t)}
with g(t) the segment of token t (segments in order, empty ones allowed).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from trainer.kernels.cutlass_lora import build, dispatch, kernels
from trainer.kernels.cutlass_lora.plan import TilePlan, emulate

pytestmark = pytest.mark.unit

HEADER = Path(build.__file__).parent / "lora_gemm_args.h"
# (segment token counts, tile height): odd offsets, empty segments inside and at the ends, a tile
# spanning many segments, a segment spanning many tiles, one segment, a partial last tile
COUNTS = {
    "odd_with_empty": ([0, 5, 9, 0, 7, 4, 0], 8),
    "many_in_one_tile": ([1, 2, 3, 1, 1, 9, 30], 16),
    "long_segments": ([37, 0, 70, 21], 16),
    "one_segment": ([45], 16),
    "aligned": ([32, 16, 48], 16),
}


def segment_of_rows(counts: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


def tiles_by_definition(counts: list[int], tile_m: int) -> list[list[int]]:
    """For every tile of tile_m rows: the segments with a row in it, in order."""
    seg = segment_of_rows(counts)
    return [sorted(set(seg[t:t + tile_m].tolist())) for t in range(0, len(seg), tile_m)]


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_tile_table_lists_each_tiles_segments_and_masks_the_others(name):
    counts, tm = COUNTS[name]
    plan = TilePlan.of(counts, tm)
    want = tiles_by_definition(counts, tm)
    assert plan.pairs_per_tile == max(len(s) for s in want)
    assert plan.identity == (plan.pairs_per_tile == 1)
    seg = segment_of_rows(counts)
    t_rows = len(seg)
    h = torch.arange(1, t_rows + 1, dtype=torch.float32)[:, None].repeat(1, 8)  # row r holds r + 1: no zero rows
    hblk = plan.hblk(h)
    padded = torch.zeros(plan.blocks * tm, 8)
    padded[: min(len(hblk), len(padded))] = hblk[: len(padded)]
    for t, segments in enumerate(want):
        entries = plan.tiles[t].tolist()
        assert [g for g, _ in entries[: len(segments)]] == segments, f"tile {t}"
        for j, (g, block) in enumerate(entries):
            got = padded[block * tm:(block + 1) * tm]
            rows = torch.arange(t * tm, (t + 1) * tm)
            keep = (rows < t_rows) & (seg[rows.clamp(max=t_rows - 1)] == g) if j < len(segments) else torch.zeros(tm, dtype=torch.bool)
            want_rows = torch.where(keep[:, None], h[rows.clamp(max=t_rows - 1)], 0.0)
            assert torch.equal(got, want_rows), f"tile {t} entry {j} (segment {g}, block {block})"


def test_identity_plan_reads_h_itself():
    plan = TilePlan.of([32, 0, 16, 48], 16)
    h = torch.randn(96, 8)
    assert plan.identity and plan.hblk(h) is h and plan.tiles[:, 0, 1].tolist() == list(range(6))


def _operands(counts, k=64, n=40, r=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, groups = sum(counts), len(counts)
    x = torch.randn(t, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    a = torch.randn(groups, r, k, generator=g, dtype=torch.float64)  # LoRA A [G, R, in]
    b = torch.randn(groups, n, r, generator=g, dtype=torch.float64)  # LoRA B [G, out, R]
    h = torch.randn(t, r, generator=g, dtype=torch.float64)
    gy = torch.randn(t, n, generator=g, dtype=torch.float64)
    gh = torch.randn(t, r, generator=g, dtype=torch.float64)
    return x, w, a, b, h, gy, gh


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_kernel_contract_from_the_table_equals_the_definition(name):
    counts, tm = COUNTS[name]
    x, w, a, b, h, gy, gh = _operands(counts)
    seg = segment_of_rows(counts)
    plan = TilePlan.of(counts, tm)
    forward = x @ w.t() + torch.einsum("tr,tnr->tn", h, b[seg])
    input_grad = gy @ w + torch.einsum("tr,trk->tk", gh, a[seg])
    got_fwd = emulate(x, w.t(), plan.hblk(h), b.transpose(1, 2), plan)
    got_dx = emulate(gy, w, plan.hblk(gh), a, plan)
    assert (got_fwd.double() - forward).abs().max() <= 1e-5 * forward.abs().max()
    assert (got_dx.double() - input_grad).abs().max() <= 1e-5 * input_grad.abs().max()


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="at least one token"):
        TilePlan.of([0, 0], 16)
    with pytest.raises(ValueError, match="non-negative"):
        TilePlan.of([4, -1], 16)
    with pytest.raises(ValueError, match="h has 5 rows, the plan 6"):
        TilePlan.of([6], 16).hblk(torch.zeros(5, 8))


def _fused_node(lora_gemm: str):
    """A FusedLoraLinear forward + backward on the CPU (fp32, odd segments with an empty one)."""
    from trainer.lora.fused_lora import ComputeWeights, FusedLoraLinear, SlotSpan

    counts = [5, 0, 9, 7]
    x, w, a, b, _, gy, _ = (v.float() for v in _operands(counts, k=64, n=48, r=8, seed=3))
    a_param, b_param = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    a_c, b_c = ComputeWeights().get(a_param, b_param, torch.float32)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    span = SlotSpan.of(offsets, counts)
    scale = torch.tensor([2.0, 0.5, 1.5])[segment_of_rows([5, 9, 7])][:, None]
    x = x.clone().requires_grad_()
    y = FusedLoraLinear.apply(x, w, a_param, b_param, a_c, b_c, span, scale, "loop", "library", None, lora_gemm)
    y.backward(gy)
    return y.detach(), x.grad, a_param.grad, b_param.grad


def test_cpu_dispatch_is_todays_path_bit_for_bit_and_never_builds(monkeypatch):
    def no_build():
        raise AssertionError("the CUTLASS extension was loaded on the CPU")

    monkeypatch.setattr(build, "load", no_build)
    library = _fused_node("library")
    auto = _fused_node("auto")
    for got, want in zip(auto, library):
        assert torch.equal(got, want)
    assert dispatch.decisions() == {}
    with pytest.raises(ValueError, match="'cutlass' cannot run here: operands on cpu, not CUDA"):
        _fused_node("cutlass")
    with pytest.raises(ValueError, match=r"lora_gemm must be one of \('library', 'cutlass', 'auto'\)"):
        _fused_node("cublas")


def test_unsupported_names_what_the_kernel_needs():
    x, w, a, b = torch.zeros(4, 64), torch.zeros(8, 64), torch.zeros(1, 8, 64), torch.zeros(1, 8, 8)
    assert "not CUDA" in kernels.unsupported("nk", x, w, torch.zeros(4, 8), b)
    assert "layout must be one of" in kernels.unsupported("tn", x, w, torch.zeros(4, 8), b)


def test_python_configs_match_the_cuda_header():
    """kernels.CONFIGS (the tile heights plans are made for) against lora_gemm_args.h's kConfigs, and
    the header's and build.py's lists of instantiated configs."""
    text = HEADER.read_text()
    rows = re.findall(r'\{"(\w+)", (\d+), (\d+), (\d+), (\d+), (true|false)\}', text)
    from_header = tuple(kernels.KernelConfig(n, int(m), int(nn), int(k), int(c), p == "true") for n, m, nn, k, c, p in rows)
    assert from_header == kernels.CONFIGS
    listed = re.search(r"#define LORAFLEET_FOR_EACH_CONFIG\(X\) (.*)", text).group(1)
    assert listed.split() == [f"X({i})" for i in range(len(kernels.CONFIGS))]
    assert build.CONFIG_COUNT == len(kernels.CONFIGS)


def test_kernel_units_one_per_layout_and_config(tmp_path):
    units = build.kernel_units(tmp_path)
    assert [u.name for u in units] == [f"lora_gemm_{lay}_c{c}.cu" for lay in ("nk", "kn") for c in range(build.CONFIG_COUNT)]
    assert units[5].read_text() == '#include "lora_gemm.cuh"\nLORAFLEET_INSTANTIATE(kn, 1)\n'
    before = units[0].stat().st_mtime_ns
    build.kernel_units(tmp_path)  # unchanged text: not rewritten (ninja's timestamps hold)
    assert units[0].stat().st_mtime_ns == before
