"""Calls into the CUTLASS LoRA-GEMM extension, and what it can take.

``run(layout, a, w, rank_side, factor, plan, config)`` computes

    layout "nk" (forward):          a w^T + (per segment g) rank_side_g factor_g^T   w [N, K], factor = LoRA B [G, N, R]
    layout "kn" (input gradient):   a w   + (per segment g) rank_side_g factor_g     w [K, N], factor = LoRA A [G, R, N]

in one kernel (bf16 in and out, fp32 accumulation, one rounding), where rank_side is h = s x A_g^T
(forward) or gh = s g B_g (input gradient), computed beforehand. ``unsupported`` says why a call
cannot run there (None when it can), so the dispatcher falls back without trying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.kernels.cutlass_lora import build
from trainer.kernels.cutlass_lora.plan import TilePlan


@dataclass(frozen=True)
class KernelConfig:
    """One instantiated kernel (lora_gemm_args.h kConfigs, in the same order)."""

    name: str
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_n: int
    pingpong: bool


CONFIGS: tuple[KernelConfig, ...] = (
    KernelConfig("coop_128x256_c1", 128, 256, 64, 1, False),
    KernelConfig("coop_128x256_c2", 128, 256, 64, 2, False),
    KernelConfig("coop_256x128_c2", 256, 128, 64, 2, False),
    KernelConfig("pingpong_128x128_c2", 128, 128, 64, 2, True),
)
LAYOUTS = ("nk", "kn")


def unsupported(layout: str, a: torch.Tensor, w: torch.Tensor, rank_side: torch.Tensor,
                factor: torch.Tensor) -> str | None:
    """Why the kernel cannot take these operands (None when it can): it needs an sm_90 GPU, bf16
    contiguous 16-byte-aligned operands, K a multiple of 64, N and R multiples of 8 (TMA strides)."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if not a.is_cuda:
        return f"operands on {a.device}, not CUDA"
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(a.device)}: the kernel is built for sm_90a only"
    tensors = {"a": a, "w": w, "rank_side": rank_side, "factor": factor}
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            return f"{name} is {t.dtype}, the kernel takes bfloat16"
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} is not contiguous and 16-byte aligned"
    m, k = a.shape
    n = w.shape[0] if layout == "nk" else w.shape[1]
    r = rank_side.shape[1]
    if m == 0 or k % 64 or n % 8 or r % 8:
        return f"needs K % 64 == 0, N % 8 == 0, R % 8 == 0 and M >= 1; got M={m}, K={k}, N={n}, R={r}"
    return None


def run(layout: str, a: torch.Tensor, w: torch.Tensor, rank_side: torch.Tensor, factor: torch.Tensor,
        plan: TilePlan, config: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's output [M, N] (see the module docstring); ``plan`` must be made with
    ``CONFIGS[config].tile_m``. Operands as ``unsupported`` requires (the extension checks again)."""
    if plan.tile_m != CONFIGS[config].tile_m:
        raise ValueError(f"plan made for {plan.tile_m}-row tiles, config {CONFIGS[config].name} has {CONFIGS[config].tile_m}")
    return extension().lora_gemm(a, w, plan.hblk(rank_side), factor, plan.tiles, layout, config, out)


def extension():  # noqa: ANN201 - the compiled module
    """The built extension, checked once against CONFIGS (a mismatch would mean tile tables made for
    the wrong tile height)."""
    ext = build.load()
    if not getattr(ext, "_lorafleet_checked", False):
        built = [KernelConfig(*row[:6]) for row in ext.configs()]
        if tuple(built) != CONFIGS:
            raise RuntimeError(f"the extension's kernel configs {built} differ from kernels.CONFIGS {CONFIGS}")
        ext._lorafleet_checked = True
    return ext
