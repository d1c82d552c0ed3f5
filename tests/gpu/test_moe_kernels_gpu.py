"""GPU tier: the segmented expert-LoRA Triton kernels (trainer/kernels/triton_expert_lora.py) against
today's grouped_mm path and an fp32 per-token reference, compiled on the device.

* bf16, one node at a time (Qwen3-MoE-like widths cut down: 16 experts, hidden 256, expert
  width 192, rank 16, 4 slots of a span starting at slot 1): the delta node on the Triton
  kernels and the fused expert linear (base GEMM + delta in one node) are at least as close
  to the fp32 reference as the grouped_mm path is, output and every gradient. Groups: empty
  ones, an expert with one routed pair, a slot routed to every expert, skewed counts, groups
  longer than a row tile.
* fp32, the whole trainer on the tiny Qwen3-MoE: the Triton path trains what grouped_mm
  trains (the MoE equivalence scenario's first two calls, weights / moments / losses /
  gradient norms within the CPU tests' 1e-5), and each adapter mixed equals it alone.

The fp32 unit tests of the kernels and nodes (tests/unit/test_triton_expert_lora.py,
tests/unit/test_moe_lora.py) run compiled here too when run on this machine.
"""

from __future__ import annotations

import pytest
import torch

from tests.numerics import max_rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, SPAN, LO, R, HID, OUT = 16, 4, 1, 16, 256, 384  # experts, slots in the span, its first slot, rank, in, out


def _routed_case(seed=0):
    """Pairs sorted by group g = e * SPAN + s, with a planted shape: slot 0 of the span routed to
    every expert, expert 3 holding a single pair, a handful of empty groups, skewed counts."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 200, (E, SPAN), generator=g) * (torch.rand(E, SPAN, generator=g) < 0.8)
    counts[:, 0] = torch.randint(1, 90, (E,), generator=g)  # every expert for slot 0 of the span
    counts[3] = torch.tensor([1, 0, 0, 0])  # one pair in all on expert 3
    counts[5, 2] = 700  # longer than several tiles
    counts = counts.reshape(-1)
    m = int(counts.sum())
    group = torch.repeat_interleave(torch.arange(E * SPAN), counts)
    n_slots = LO + SPAN + 1  # resident slots: the span is 1 .. 4 of 6
    dev = "cuda"
    case = dict(
        counts=counts.to(dev), group=group.to(dev), x=torch.randn(m, HID, generator=g).to(dev),
        gy=torch.randn(m, OUT, generator=g).to(dev) * 0.1, base=torch.randn(E, OUT, HID, generator=g).to(dev) * 0.05,
        a=torch.randn(n_slots, E, R, HID, generator=g).to(dev) * 0.05, b=torch.randn(n_slots, E, OUT, R, generator=g).to(dev) * 0.05,
        scale=(torch.rand(m, generator=g) + 0.5).to(dev),
    )
    return case


def _reference(c):
    """fp32, per pair: y = x W_e^T + s * B_g A_g x, plain autograd."""
    slot, expert = c["group"] % SPAN + LO, c["group"] // SPAN
    x, a, b = (c[k].clone().requires_grad_() for k in ("x", "a", "b"))
    h = torch.einsum("trk,tk->tr", a[slot, expert], x) * c["scale"][:, None]
    y = torch.einsum("tor,tr->to", b[slot, expert], h) + torch.einsum("tok,tk->to", c["base"][expert], x)
    (y * c["gy"]).sum().backward()
    return y.detach(), x.grad, a.grad, b.grad


def _ours(c, path):
    """bf16 compute, fp32 slot weights and gradients: ``library`` (grouped_mm, today's path),
    ``triton`` (the delta node on the Triton kernels) or ``fused`` (ExpertLinearLora)."""
    from trainer.lora.expert_lora_nodes import ExpertLinearLora, ExpertLoraDelta, GroupLayout, LibraryExpertOps, TritonExpertOps
    from trainer.lora.moe_lora import _expert_major
    from trainer.kernels.segmented_mm import segmented_matmul
    from trainer.kernels.triton_expert_lora import GroupTiles

    bf = torch.bfloat16
    x = c["x"].to(bf, copy=True).requires_grad_()
    a_p, b_p = torch.nn.Parameter(c["a"].clone()), torch.nn.Parameter(c["b"].clone())
    e_counts = c["counts"].view(E, SPAN).sum(1)
    e_offsets, e_list = e_counts.cumsum(0).to(torch.int32), e_counts.tolist()
    base = c["base"].to(bf)
    tiles = GroupTiles.of(c["counts"], x.shape[0], SPAN)
    if path == "fused":
        y = ExpertLinearLora.apply(x, base, e_offsets, e_list, "grouped_mm", a_p, b_p, tiles, c["scale"], LO)
    else:
        if path == "triton":
            ops = TritonExpertOps(tiles, a_p, b_p, LO)
        else:
            ops = LibraryExpertOps(GroupLayout.of(c["counts"].tolist(), x.device), "grouped_mm",
                                   _expert_major(a_p.detach()[LO : LO + SPAN]).to(bf),
                                   _expert_major(b_p.detach()[LO : LO + SPAN]).to(bf))
        y = segmented_matmul(x, base, e_offsets, e_list, "grouped_mm") + ExpertLoraDelta.apply(
            x, a_p, b_p, ops, c["scale"].to(bf).unsqueeze(1), LO)
    (y.float() * c["gy"]).sum().backward()
    return y.detach().float(), x.grad.float(), a_p.grad, b_p.grad


def test_bf16_triton_nodes_as_close_to_fp32_as_grouped_mm():
    c = _routed_case()
    ref = _reference(c)
    errs = {path: [max_rel_err(got, want) for got, want in zip(_ours(c, path), ref)] for path in ("library", "triton", "fused")}
    print({p: [f"{e:.2e}" for e in v] for p, v in errs.items()})
    for path in ("triton", "fused"):
        for name, e, e_lib in zip(("y", "dx", "dA", "dB"), errs[path], errs["library"]):
            # bf16 rounding of the operands sets both; the kernels round once from fp32 accumulators
            assert e <= 1.5 * e_lib + 1e-3 and e <= 2e-2, (path, name, e, e_lib)
    # the slots outside the span got no gradient
    _, _, d_a, d_b = _ours(c, "fused")
    assert torch.count_nonzero(d_a[0]) == 0 and torch.count_nonzero(d_b[LO + SPAN :]) == 0


@pytest.fixture(scope="module")
def moe_trainer():
    from examples.tiny_moe.build import ensure_tiny_moe_world
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    world = ensure_tiny_moe_world()
    t = MultiLoraTrainer(TrainerConfig(base_model_path=str(world / "model"), num_slots=4, max_rank=8,
                                       micro_batch_tokens=40, dtype="float32"))
    assert t.device.type == "cuda"
    return t


def test_fp32_moe_trainer_triton_equals_grouped_mm_on_cuda(moe_trainer):
    from tests.integration.test_moe_trainer import moe_hypers
    from tests.integration.test_trainer_equivalence import assert_equivalent, make_batches, run_scenario
    from trainer.kernels import triton_expert_lora

    batches = make_batches(moe_trainer)[:2]  # as the CPU test: two calls, accumulation across them
    runs = {}
    calls = []
    real = triton_expert_lora.shrink
    for kernels in ("library", "triton"):
        moe_trainer.routing.rank_kernels = kernels
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(triton_expert_lora, "shrink", lambda *a, **k: calls.append(kernels) or real(*a, **k))
            runs[kernels] = run_scenario(moe_trainer, moe_hypers("mixed"), batches)
    moe_trainer.routing.rank_kernels = "auto"
    assert "triton" in calls and "library" not in calls
    across = assert_equivalent(runs["triton"]["mixed"], runs["library"]["mixed"])
    inside = assert_equivalent(runs["triton"]["mixed"], runs["triton"]["alone"])
    print(f"fp32 CUDA MoE: triton vs grouped_mm {across:.2e}, triton mixed vs alone {inside:.2e}")
