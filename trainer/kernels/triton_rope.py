"""Rotary position embedding in one Triton kernel per direction (no TransformerEngine).

Megatron-core's unfused RoPE (``_apply_rotary_pos_emb_bshd``) makes, per call, cos and
sin of the frequencies, the rotated half through ``chunk`` + ``neg`` + ``cat``, two
products, a sum and a final ``cat`` with the (empty) pass-through part: about eight
passes over q or k, twice as many in backward. This kernel reads t and the
frequencies once and writes the result once, computing in fp32 and rounding once.

For non-interleaved RoPE over the first ``D`` = ``freqs.shape[-1]`` features of each
head (halves x1, x2; frequencies f1, f2):

    y1 = x1 cos f1 - x2 sin f1          y2 = x2 cos f2 + x1 sin f2
    dx1 = g1 cos f1 + g2 sin f2         dx2 = g2 cos f2 - g1 sin f1

Features past ``D`` pass through. ``install`` makes it megatron-core's
``fused_apply_rotary_pos_emb`` (the hook its ``apply_rope_fusion`` switch calls, None
without TransformerEngine); the trainer turns the switch on only on CUDA with Triton.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope(x_ptr, f_ptr, y_ptr, stride_xs, stride_xb, stride_xh, stride_fs, B, H, D_ROT, D_TOTAL,
             BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
        row = tl.program_id(0)  # one (s, b) position: all its heads
        s = row // B
        b = row % B
        half = D_ROT // 2
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < H) & (cols < half)
        x_row = x_ptr + s.to(tl.int64) * stride_xs + b.to(tl.int64) * stride_xb + heads * stride_xh
        y_row = y_ptr + row.to(tl.int64) * H * D_TOTAL + heads * D_TOTAL  # y is contiguous [S, B, H, D_TOTAL]
        f1 = tl.load(f_ptr + s.to(tl.int64) * stride_fs + cols, mask=cols < half, other=0.0).to(tl.float32)
        f2 = tl.load(f_ptr + s.to(tl.int64) * stride_fs + half + cols, mask=cols < half, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        c1, s1, c2, s2 = tl.cos(f1), tl.sin(f1), tl.cos(f2), tl.sin(f2)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(y_row + cols, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + half + cols, y2.to(y_ptr.dtype.element_ty), mask=mask)
        if BLOCK_PASS > 0:  # features past the rotary ones are copied
            pcols = tl.arange(0, BLOCK_PASS)[None, :]
            pmask = (heads < H) & (pcols < D_TOTAL - D_ROT)
            xp = tl.load(x_row + D_ROT + pcols, mask=pmask, other=0.0)
            tl.store(y_row + D_ROT + pcols, xp, mask=pmask)

    return rope


def _launch(x: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    import triton

    S, B, H, D = x.shape
    d_rot = freqs.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = freqs.reshape(freqs.shape[0], d_rot)
    if f.stride(-1) != 1:
        f = f.contiguous()
    y = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    if y.numel():
        _kernel()[(S * B,)](
            x, f, y, x.stride(0), x.stride(1), x.stride(2), f.stride(0), B, H, d_rot, D,
            BACKWARD=backward, BLOCK_H=triton.next_power_of_2(H), BLOCK_HALF=triton.next_power_of_2(d_rot // 2),
            BLOCK_PASS=triton.next_power_of_2(D - d_rot) if D > d_rot else 0,
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):  # noqa: ANN001 - autograd signature
        ctx.save_for_backward(freqs)
        return _launch(t, freqs, backward=False)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        (freqs,) = ctx.saved_tensors
        return _launch(g, freqs, backward=True), None


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE of ``t`` [s, b, heads, dim] with ``freqs`` [s, 1, 1, rot_dim] (rot_dim <= dim, even;
    Megatron's sbhd/bshd convention: freqs broadcast over b and heads). Same signature as
    TransformerEngine's ``fused_apply_rotary_pos_emb`` for the cases it covers."""
    if interleaved:
        raise NotImplementedError("interleaved RoPE has no Triton kernel here; leave apply_rope_fusion off")
    if t.dim() != 4 or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"apply_rope wants t [s, b, h, d] and freqs [s, 1, 1, d_rot], got {tuple(t.shape)} "
                         f"and {tuple(freqs.shape)}")
    if freqs.shape[0] != t.shape[0] or freqs.shape[-1] % 2 or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(f"freqs {tuple(freqs.shape)} do not fit t {tuple(t.shape)} (same s, even d_rot <= d)")
    return _Rope.apply(t, freqs)


def install() -> bool:
    """Make ``apply_rope`` megatron-core's fused RoPE hook where that hook is empty (no
    TransformerEngine). Returns whether the hook now points at it."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _fused_hook
    return rope_utils.fused_apply_rotary_pos_emb is _fused_hook


def _fused_hook(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                interleaved: bool = False) -> torch.Tensor:
    return apply_rope(t, freqs, interleaved=interleaved)
