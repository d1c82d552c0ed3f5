"""FusedLoraLinear (trainer/lora/fused_lora.py) against the general path of MultiLoraLinear
(base, then delta, then add) on one packed stream: output, input gradient and slot
gradients; only the slots present get gradients; the compute-dtype weight cache follows
every in-place change of the fp32 masters."""

import pytest
import torch
from torch import nn

from tests.numerics import max_rel_err
from trainer.lora.fused_lora import SlotSpan
from trainer.lora.multi_lora import MultiLoraLinear, SlotRouting
from trainer.base.packing import pack_sequences

pytestmark = pytest.mark.unit

N, R, IN, OUT = 6, 8, 32, 48


class _FrozenLinear(nn.Module):
    """A bias-free linear with Megatron's (output, bias) return convention."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(OUT, IN, dtype=torch.float64).to(dtype), requires_grad=False)
        self.bias = None

    def forward(self, x):
        return x @ self.weight.t(), None


def _layer(kernel, dtype, fused, master=torch.float32, rank_kernels="library"):
    torch.manual_seed(0)
    routing = SlotRouting(N, kernel=kernel, fused=fused, rank_kernels=rank_kernels)
    layer = MultiLoraLinear(_FrozenLinear(dtype), name="l", kind="plain", parallel="column", num_slots=N,
                            max_rank=R, routing=routing, tp_group=None, device=torch.device("cpu"))
    layer.fusable = True  # the stand-in base is what the fused node assumes: x @ W.T, no bias, TP 1
    with torch.no_grad():
        layer.lora_A.data = layer.lora_A.data.to(master)
        layer.lora_B.data = layer.lora_B.data.to(master)
        for i, r in enumerate([4, 8, 2, 8, 3, 5]):
            layer.lora_A[i, :r] = torch.randn(r, IN, dtype=torch.float64).to(master)
            layer.lora_B[i, :, :r] = torch.randn(OUT, r, dtype=torch.float64).to(master)
    # preset gradient buffers, as SlotBuffers does (the fused node accumulates into them)
    layer.lora_A.grad = torch.full_like(layer.lora_A, 0.25)
    layer.lora_B.grad = torch.full_like(layer.lora_B, -0.5)
    return layer, routing


def _run(layer, routing, dtype, seed=1):
    """One packed stream over slots 1, 1, 3, 4 (slots 0, 2 and 5 absent, 2 empty inside the span)."""
    g = torch.Generator().manual_seed(seed)
    lengths, slots = [5, 9, 7, 4], [1, 1, 3, 4]
    packed = pack_sequences([torch.randint(0, 50, (n,), generator=g) for n in lengths], slots, N)
    routing.set_packed(packed, torch.tensor([2.0, 0.5, 1.0, 3.0, 1.5, 0.75]))
    x = torch.randn(packed.num_tokens, 1, IN, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    y, bias = layer(x)
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dtype)
    y.backward(gy)
    routing.disable()
    return y.detach(), x.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()


@pytest.mark.parametrize("kernel, dtype, tol", [("loop", torch.float64, 1e-12), ("grouped_mm", torch.float32, 2e-6),
                                                ("loop", torch.float32, 2e-6)])
def test_fused_equals_general_path(kernel, dtype, tol):
    ref_layer, ref_routing = _layer(kernel, dtype, fused=False, master=dtype)
    layer, routing = _layer(kernel, dtype, fused=True, master=dtype)
    ref, got = _run(ref_layer, ref_routing, dtype), _run(layer, routing, dtype)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, ref):
        err = max_rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_fused_with_triton_rank_kernels_equals_general_path(kernel):
    """The same node with its four rank-R reductions in Triton (triton_lora.py; run through
    Triton's interpreter here), fp32."""
    ref_layer, ref_routing = _layer(kernel, torch.float32, fused=False, master=torch.float32)
    layer, routing = _layer(kernel, torch.float32, fused=True, master=torch.float32, rank_kernels="triton")
    ref, got = _run(ref_layer, ref_routing, torch.float32), _run(layer, routing, torch.float32)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, ref):
        err = max_rel_err(a, b)
        assert err <= 2e-6, f"{name}: relative error {err:.2e}"
    for slot in (0, 2, 5):  # absent or empty: never written
        assert torch.equal(got[2][slot], torch.full_like(got[2][slot], 0.25))
        assert torch.equal(got[3][slot], torch.full_like(got[3][slot], -0.5))


def test_only_present_slots_get_gradients():
    layer, routing = _layer("grouped_mm", torch.float32, fused=True)
    _, _, dA, dB = _run(layer, routing, torch.float32)
    for slot in (0, 5):  # outside the span 1:5: never touched, bit for bit
        assert torch.equal(dA[slot], torch.full_like(dA[slot], 0.25))
        assert torch.equal(dB[slot], torch.full_like(dB[slot], -0.5))
    for slot in (2,):  # inside the span but empty: the GEMM's zero group, added exactly
        assert torch.equal(dA[slot], torch.full_like(dA[slot], 0.25))
    for slot in (1, 3, 4):
        assert not torch.equal(dA[slot], torch.full_like(dA[slot], 0.25))


def test_compute_dtype_cache_follows_in_place_changes():
    """bf16 activations over fp32 masters: the cached bf16 weights are re-cast after an
    in-place update (as the optimizer makes), so the fused path equals the general one."""
    for step in range(2):
        ref_layer, ref_routing = _layer("grouped_mm", torch.bfloat16, fused=False)
        layer, routing = _layer("grouped_mm", torch.bfloat16, fused=True)
        _run(layer, routing, torch.bfloat16)  # fills the cache
        if step:
            with torch.no_grad():
                for lay in (layer, ref_layer):
                    lay.lora_B.mul_(3.0)
                    lay.lora_A[3, :2] += 1.0
        ref, got = _run(ref_layer, ref_routing, torch.bfloat16, seed=7), _run(layer, routing, torch.bfloat16, seed=7)
        err = max_rel_err(got[0].float(), ref[0].float())
        assert err <= 1e-2, f"after update {step}: fused output off by {err:.2e} (stale bf16 weights?)"


def test_span_of_segments():
    offsets = torch.tensor([0, 0, 5, 5, 9, 9], dtype=torch.int32)
    span = SlotSpan.of(offsets, [0, 0, 5, 0, 4, 0])
    assert (span.lo, span.hi, span.counts) == (2, 5, [5, 0, 4])
    assert span.offsets.tolist() == [5, 5, 9]
    with pytest.raises(ValueError, match="no tokens"):
        SlotSpan.of(offsets[:2], [0, 0])


def test_gradients_without_preset_buffers():
    """Outside the trainer (no SlotBuffers), the node creates the .grad tensors as autograd
    would, and they hold exactly the gradients a zero-preset buffer receives."""
    preset, routing = _layer("grouped_mm", torch.float32, fused=True)
    bare, bare_routing = _layer("grouped_mm", torch.float32, fused=True)
    with torch.no_grad():
        preset.lora_A.grad.zero_()
        preset.lora_B.grad.zero_()
    bare.lora_A.grad = bare.lora_B.grad = None
    want, got = _run(preset, routing, torch.float32), _run(bare, bare_routing, torch.float32)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
