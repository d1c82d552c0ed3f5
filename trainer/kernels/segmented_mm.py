"""Segmented matmul: y[t] = x[t] @ W[g(t)].T, where token t lies in segment g(t).

Tokens are grouped in contiguous segments, one per slot (``offsets[g]`` = end of
segment g, int32, cumulative; empty segments allowed). ``W`` is a stacked weight
[G, N, K] in nn.Linear layout, so the stacked LoRA parameters are used as they
are: no per-forward gathering or re-stacking of slot weights.

Two kernels, same math, chosen once per call:

* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (CUDA bf16/fp16 on sm80+, and
  CPU in any float dtype). Three grouped GEMMs cover forward and backward.
* ``loop``: one matmul per non-empty segment (any device/dtype/alignment).

The autograd Function saves ``x`` and the (fp32 master) ``W`` only. ``W`` is cast to
the compute dtype of ``x`` for the GEMMs; its gradient comes back in ``W``'s dtype,
accumulated in fp32 where the kernel allows it.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

Kernel = Literal["grouped_mm", "loop"]


def _row_major_aligned(t: torch.Tensor) -> bool:
    """A 2D operand grouped_mm takes as it is: unit last stride, 16-byte leading stride and
    (on CUDA, for TMA) a 16-byte aligned start."""
    align = 16 // t.element_size()
    return (
        t.stride(-1) == 1 and t.stride(-2) % align == 0 and (not t.is_cuda or t.data_ptr() % 16 == 0)
    )


def grouped_mm_eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [T, K] against W [G, N, K] (and the backward GEMMs) can run on grouped_mm.

    torch checks, on every device: each 2D operand's leading stride a multiple of 16
    bytes, so K and N (in the compute dtype) must be multiples of 16 bytes, since
    the forward, the input gradient and the weight gradient use W, W^T, x and gy^T
    ([T, N]) as operands. x itself is made row-major and aligned by
    ``segmented_matmul`` when it is not. On CUDA only bf16/fp16 have a grouped kernel
    (fp32 falls back to a per-group loop with a host sync inside torch).
    """
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        return False
    align = 16 // x.element_size()
    return w.shape[-1] % align == 0 and w.shape[-2] % align == 0


def pick_kernel(requested: Literal["auto", "grouped_mm", "loop"], x: torch.Tensor, w: torch.Tensor) -> Kernel:
    """The kernel for x [T, K] against W [G, N, K], decided per call from dtype, device and
    shape: ``auto`` takes grouped_mm where it is eligible and the loop elsewhere."""
    if requested == "loop":
        return "loop"
    ok = grouped_mm_eligible(x, w)
    if requested == "grouped_mm" and not ok:
        raise ValueError(
            f"lora_kernel 'grouped_mm' cannot run dtype {x.dtype} with dims {tuple(w.shape[-2:])} on {x.device} "
            f"(needs bf16/fp16 on CUDA, and both dims multiples of {16 // x.element_size()} elements); "
            "use 'auto' or 'loop'"
        )
    return "grouped_mm" if ok else "loop"


def _one_group(counts: list[int] | None, w: torch.Tensor) -> bool:
    return (len(counts) if counts is not None else w.shape[0]) == 1


def _host_counts(counts: list[int] | None) -> list[int]:
    """The loop kernel walks the segments on the host; grouped_mm reads only the device offsets,
    so a caller on that kernel may pass ``counts=None`` (no device-to-host copy, no sync)."""
    if counts is None:
        raise ValueError("the loop kernel needs the segment counts on the host (counts=None is for grouped_mm)")
    return counts


def _bounds(counts: list[int]):
    start = 0
    for g, n in enumerate(counts):
        if n:
            yield g, start, start + n
        start += n


def segment_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None,
               kernel: Kernel) -> torch.Tensor:
    """y[t] = x[t] @ w[g(t)].T: x [T, K], w [G, N, K] in x's dtype -> [T, N] (no autograd).
    ``counts`` (the G segment lengths on the host) may be None on grouped_mm."""
    if _one_group(counts, w):  # one segment: a plain GEMM (cuBLAS picks its split-K and tiles)
        return x @ w[0].t()
    if kernel == "grouped_mm":
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    y = x.new_zeros(x.shape[0], w.shape[1])
    for g, s, e in _bounds(_host_counts(counts)):
        torch.matmul(x[s:e], w[g].t(), out=y[s:e])
    return y


def segment_mm_nt(gy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None,
                  kernel: Kernel) -> torch.Tensor:
    """gx[t] = gy[t] @ w[g(t)]: gy [T, N], w [G, N, K] in gy's dtype -> [T, K] (the input
    gradient of ``segment_mm``; no autograd; ``counts`` as there)."""
    if _one_group(counts, w):
        return gy @ w[0]
    if kernel == "grouped_mm":
        return F.grouped_mm(gy, w, offs=offsets)
    gx = gy.new_zeros(gy.shape[0], w.shape[2])
    for g, s, e in _bounds(_host_counts(counts)):
        torch.matmul(gy[s:e], w[g], out=gx[s:e])
    return gx


def segment_weight_grad(gy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, counts: list[int], kernel: Kernel,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """dW[g] = gy[seg g].T @ x[seg g]: gy [T, N], x [T, K] -> [G, N, K] (zeros for empty
    groups), accumulated in fp32 by the GEMM and returned in ``dtype`` (default the inputs')."""
    dtype = dtype or gy.dtype
    counts = _host_counts(counts)
    if len(counts) == 1:
        return (gy.t() @ x).to(dtype).unsqueeze(0)
    if kernel == "grouped_mm":
        return _grouped_weight_grad(gy, x, offsets, dtype)
    gw = gy.new_zeros(len(counts), gy.shape[1], x.shape[1], dtype=dtype)
    for g, s, e in _bounds(counts):
        gw[g] = (gy[s:e].t() @ x[s:e]).to(dtype)
    return gw


class SegmentedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, counts, kernel):  # noqa: ANN001 - autograd signature
        y = segment_mm(x, w.to(x.dtype), offsets, counts, kernel)
        ctx.save_for_backward(x, w, offsets)
        ctx.counts = counts
        ctx.kernel = kernel
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: ANN001
        x, w, offsets = ctx.saved_tensors
        gy = gy.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = segment_mm_nt(gy, w.to(x.dtype), offsets, ctx.counts, ctx.kernel)
        if ctx.needs_input_grad[1]:
            gw = segment_weight_grad(gy, x, offsets, ctx.counts, ctx.kernel, w.dtype)
        return gx, gw, None, None, None


@functools.cache
def _grouped_out_dtype_supported(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether grouped_mm accumulates ``in_dtype`` inputs into an ``out_dtype`` result here.

    Probed once per (device, dtypes) with a tiny call: torch 2.11's sm90 kernel refuses
    (\"Grouped gemm output dtype must match mat_a dtype\"), and raising and catching that
    in every backward of every layer costs real CPU time."""
    gy = torch.zeros(16, 8, dtype=in_dtype, device=device)  # [T, N]
    x = torch.zeros(16, 16, dtype=in_dtype, device=device)  # [T, K]; one group of all 16 tokens
    try:
        F.grouped_mm(gy.t(), x, offs=torch.tensor([16], dtype=torch.int32, device=device), out_dtype=out_dtype)
    except RuntimeError:
        return False
    return True


def _grouped_weight_grad(gy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dW[g] = gy[seg g].T @ x[seg g] for every group (zeros for empty groups), in ``dtype``:
    accumulated in fp32 by the kernel; written in ``dtype`` directly where the kernel can,
    else in the input dtype and converted."""
    if gy.is_cuda and gy.dtype != dtype and _grouped_out_dtype_supported(gy.device, gy.dtype, dtype):
        return F.grouped_mm(gy.t(), x, offs=offsets, out_dtype=dtype)
    return F.grouped_mm(gy.t(), x, offs=offsets).to(dtype)


def segmented_matmul(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None, kernel: Kernel
) -> torch.Tensor:
    """x [T, K], w [G, N, K], offsets int32 [G] (cumulative ends, offsets[-1] == T) -> [T, N].
    ``counts`` None (grouped_mm only): the offsets are trusted as they are, unchecked on the host."""
    if counts is not None and x.shape[0] != sum(counts):
        raise ValueError(f"segments cover {sum(counts)} tokens but x has {x.shape[0]}")
    if kernel == "grouped_mm":
        x = grouped_operand(x)
    return SegmentedMatmul.apply(x, w, offsets, counts, kernel)


def grouped_operand(x: torch.Tensor) -> torch.Tensor:
    """x itself when grouped_mm takes it as it is, else a fresh (row-major, aligned) copy."""
    if _row_major_aligned(x):
        return x
    return x.contiguous() if not x.is_contiguous() else x.clone()  # a fresh allocation is aligned
