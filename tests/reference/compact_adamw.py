"""Reference of the compact (bfloat16, stochastically rounded) AdamW state, tests only.

Written from the definition in trainer/optim/compact_state.py's module doc, not from its code:
the noise and the rounding in numpy uint32 arithmetic (multiplication wraps modulo 2^32 there,
where the product computes in int64 tensors and masks), and the fp32 update by torch.optim.AdamW
itself, started from the stored moments converted to fp32. Definition, per slot row:

    m32, v32 = fp32(m_bf16), fp32(v_bf16)           # exact
    weight, m32, v32 = AdamW step number ``step``    # torch.optim.AdamW, single tensor
    h = mix32(key ^ column),  key = mix32(mix32(mix32(step) ^ seed_lo) ^ seed_hi)
    m_bf16 = bits_to_f32((bits(m32) + (h >> 16)) & 0xFFFF0000)
    v_bf16 = bits_to_f32((bits(v32) + (h & 0xFFFF)) & 0xFFFF0000)
    mix32(x): x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15  (mod 2^32)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

U32 = np.uint32


def mix32(x: np.ndarray) -> np.ndarray:
    x = np.atleast_1d(np.asarray(x, dtype=U32))  # arrays: their products wrap without a warning
    x = x ^ (x >> U32(16))
    x = x * U32(0x21F0AAAD)
    x = x ^ (x >> U32(15))
    x = x * U32(0x735A2D97)
    return x ^ (x >> U32(15))


def key(seed: int, step: int) -> np.uint32:
    lo, hi = U32(seed % 2**32), U32((seed >> 32) % 2**32)
    return mix32(mix32(mix32(step % 2**32) ^ lo) ^ hi)[0]


def noise(seed: int, step: int, ncols: int) -> np.ndarray:
    """h of every column of a row: uint32 [ncols]."""
    return mix32(key(seed, step) ^ np.arange(ncols, dtype=U32))


def round_with(x: torch.Tensor, r: np.ndarray) -> torch.Tensor:
    """fp32 ``x`` rounded with the 16-bit noise ``r`` (uint32 values below 2^16): bf16."""
    bits = x.detach().cpu().contiguous().numpy().view(U32)
    kept = (bits + r.astype(U32)) & U32(0xFFFF0000)
    return torch.from_numpy(kept.view(np.float32).copy()).to(torch.bfloat16)


@dataclass
class Hyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_scale: float = 1.0


@dataclass
class RowStep:
    weight: torch.Tensor  # fp32 [P]
    m: torch.Tensor  # bf16 [P], stored
    v: torch.Tensor
    m32: torch.Tensor  # fp32 [P], before rounding
    v32: torch.Tensor
    h: np.ndarray  # uint32 [P], the noise


def adamw_row(weight: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: Hyper, *,
              step: int, seed: int | None) -> RowStep:
    """One update of one slot row (fp32 weight and gradient, moments fp32 or bf16): torch.optim.AdamW
    from these moments at update number ``step``; ``seed`` None: fp32 moments (stored as they are),
    else bf16 moments rounded with that tenant's noise."""
    p = torch.nn.Parameter(weight.detach().cpu().clone().float())
    p.grad = grad.detach().cpu().float() * hyper.grad_scale
    opt = torch.optim.AdamW([p], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                            foreach=False, fused=False)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.detach().cpu().float().clone(),
                    "exp_avg_sq": v.detach().cpu().float().clone()}
    opt.step()
    m32, v32 = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    if seed is None:
        return RowStep(p.detach(), m32, v32, m32, v32, np.zeros(0, dtype=U32))
    h = noise(seed, step, p.numel())
    return RowStep(p.detach(), round_with(m32, h >> U32(16)), round_with(v32, h & U32(0xFFFF)), m32, v32, h)


def rounding_mismatches(got: torch.Tensor, ref32: torch.Tensor, r: np.ndarray, rtol: float = 2e-6) -> int:
    """Elements where ``got`` (bf16, the product's) differs from rounding ``ref32`` with noise ``r``;
    AssertionError unless each is the neighbouring bf16 value and ``ref32`` lies within ``rtol``
    times the row's largest magnitude of the value where that rounding turns (two fp32 computations
    of the same update differ by that much, e.g. a lerp by 1 - beta1 = 0.5 written two ways; such a
    difference can flip a rounding near its turning point, and nothing else can)."""
    want = round_with(ref32, r)
    g = got.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    w = want.view(torch.int16).numpy().view(np.uint16).astype(np.int64)
    bad = np.nonzero(g != w)[0]
    if bad.size == 0:
        return 0
    x = ref32.detach().cpu().contiguous().numpy()
    s = x.view(U32).astype(np.int64)[bad] + r.astype(np.int64)[bad]
    # the fp32 pattern where the rounding turns: up to the next boundary, or down to this one
    up = g[bad] == w[bad] + 1  # neighbours differ by one in the (sign-magnitude) pattern
    turn = np.where(up, (s & ~0xFFFF) + 0x10000, s & ~0xFFFF) - r.astype(np.int64)[bad]
    turn_value = turn.astype(np.uint32).view(np.float32)
    atol = rtol * float(np.abs(x).max())
    near = np.abs(turn_value.astype(np.float64) - x[bad].astype(np.float64)) <= atol
    explained = (up | (g[bad] == w[bad] - 1)) & near
    unexplained = bad[~explained]
    assert unexplained.size == 0, (f"{unexplained.size} of {got.numel()} stored moments differ from the reference's "
                                   f"rounding, e.g. at {unexplained[:5].tolist()}: got "
                                   f"{got.flatten()[unexplained[:5]].tolist()}, want {want[unexplained[:5]].tolist()}")
    return int(bad.size)
