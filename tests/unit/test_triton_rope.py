"""The Triton RoPE kernel (trainer/kernels/triton_rope.py) against megatron-core's unfused RoPE
(the path it replaces), forward and backward, run by Triton's interpreter on the CPU:
strided q/k views, partial rotary dims, unequal frequency halves."""

import pytest
import torch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("d_rot", [16, 8])
def test_rope_equals_megatron_unfused(kernel_device, d_rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from trainer.kernels.triton_rope import apply_rope

    torch.manual_seed(d_rot)
    s, b, h, d = 9, 2, 3, 16
    qkv = torch.randn(s, b, h + 2, d, device=kernel_device)  # q as a view that skips heads, like a qkv split
    f = torch.randn(s, 1, 1, d_rot // 2, device=kernel_device)
    freqs = torch.cat([f, 1.3 * f], dim=-1)  # unequal halves: the general formula, not only cat(f, f)
    ref_in = qkv[:, :, 1 : h + 1].clone().requires_grad_()
    got_in = qkv[:, :, 1 : h + 1].detach().requires_grad_()
    ref = _apply_rotary_pos_emb_bshd(ref_in, freqs)
    got = apply_rope(got_in, freqs)
    g = torch.randn_like(ref)
    ref.backward(g)
    got.backward(g)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=0, atol=2e-6)


def test_rope_refuses_what_it_does_not_cover(kernel_device):
    from trainer.kernels.triton_rope import apply_rope

    t = torch.zeros(4, 1, 2, 8, device=kernel_device)
    with pytest.raises(NotImplementedError, match="interleaved"):
        apply_rope(t, torch.zeros(4, 1, 1, 8, device=kernel_device), interleaved=True)
    with pytest.raises(ValueError, match="do not fit"):
        apply_rope(t, torch.zeros(4, 1, 1, 10, device=kernel_device))
