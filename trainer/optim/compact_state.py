"""The compact AdamW state (``SlotHyperParams.state_dtype: bfloat16``): both moments stored in
bfloat16 with stochastic rounding; the update itself in fp32.

Why bf16 with stochastic rounding, not 8-bit block-wise quantization (Dettmers et al. 2022,
"8-bit Optimizers via Block-wise Quantization"). Both cut the optimizer step's memory traffic,
which is what bounds it (AdamW reads and writes every LoRA parameter's weight, gradient and two
moments: 32 bytes per parameter in fp32, plus 4 for the gradient norm; at MoE N = 32 that is
3.4 B parameters at the HBM's rate). 8-bit state would take it to 20 bytes, bf16 takes it to 24.
But block-wise quantization couples the elements of a block through its scale (absmax), and
this trainer's step is partitioned in ways a block would have to respect: the step overlap
(step_overlap.py) updates a row's columns layer by layer, at boundaries that are not multiples
of any block size, and must give bit-identical results to the whole-row launch; a block
straddling two launches would need its scale written by both. Its nonlinear code (dynamic tree
quantization) also needs a search per element in the kernel, and a scale buffer per block.
Stochastically rounded bf16 is elementwise: every element's stored value depends on its own
fp32 value and its own noise only, so any partition of the columns, any set of slots stepping
together and any launch order give the same bits, and a slot's state is its own rows.

Why stochastic rounding: with round-to-nearest a bf16 second moment cannot decay at the usual
beta2 = 0.999: v * 0.999 moves v by 0.1%, less than half a bf16 ulp (at least 2^-9, 0.2%, of the
value), so it rounds back to v and the moment only ever grows (Zamirai et al. 2020, "Revisiting BFloat16 Training": pure
bf16 training needs stochastic rounding or Kahan summation where updates are small relative to
the value). Stochastic rounding is unbiased (the stored value's expectation is the fp32 value),
so the moments follow their fp32 recurrences in expectation; Kahan-style compensation would
need a second 2-byte buffer per moment and save nothing against fp32.

The definition (tests/reference/compact_adamw.py implements it again from this text):
* the state of a bf16 slot is m and v in bf16; an update converts them to fp32 (exactly), runs
  the fp32 AdamW update of per_slot_optim.py (weight, m, v; the weight update uses these fp32
  moments), then stores ``round(m)`` and ``round(v)``: rounding comes after the moment update,
  and it is the only rounding the state sees;
* ``round(x)`` with 16 noise bits r (0 <= r < 2^16): add r to x's fp32 bit pattern (an unsigned
  32-bit integer) and clear its low 16 bits. fp32 is sign-magnitude, so this rounds |x| up with
  probability (the dropped fraction) / 2^16 and down otherwise, for either sign; zero stays zero
  (the padding of a slot's rows stays exactly zero, as in fp32), inf stays inf;
* the noise of update number ``step`` of a slot with seed ``seed`` at column c of the slot's
  row: h = mix32(key ^ c) with key = ``noise_key(seed, step)``; m takes h's high 16 bits, v its
  low 16 bits. ``mix32`` is a 32-bit integer finalizer (xor-shift, multiply, xor-shift, multiply,
  xor-shift; both multipliers below 2^31, so int64 tensors compute it without overflow). The
  noise depends on the tenant (its seed), the update number and the column, never on the slot
  index or on which slots step with it: a tenant trained alone or mixed, or swapped into
  another slot, gets the same bits.

Storage (trainer/lora/slot_buffers.py): a bf16 slot's m and v both live in the bytes of its own
exp_avg row (m in the first half, v in the second, ``SlotBuffers.compact_moments``); its
exp_avg_sq row stays zero. The step then moves 24 bytes per parameter instead of 32 (weight and
gradient read and written in fp32: 16; m and v read and written in bf16: 8), 28 instead of 36
with the gradient norm's read. The resident rows keep the fp32 width (every slot has the same
row layout, so any tenant fits any slot); a swapped-out bf16 slot takes 12 bytes per parameter
instead of 16 (its exp_avg_sq row is not copied out: trainer/swap/slot_swap.py), and a
checkpoint stores the moments as bf16 (trainer/swap/slot_checkpoint.py).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
LOW16 = 0xFFFF
HIGH16 = 0xFFFF0000
# mix32's multipliers (C. Wellons' hash-prospector 32-bit finalizer family); both below 2^31.
MIX1, MIX2 = 0x21F0AAAD, 0x735A2D97


def mix32(x):  # noqa: ANN001, ANN201 - a Python int or an int64 tensor of values in [0, 2^32)
    """The 32-bit finalizer: the same function of a Python int and of an int64 tensor."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 15)


def noise_key(seed: int, step: int) -> int:
    """The rounding key (uint32) of update number ``step`` of the tenant seeded ``seed``."""
    return mix32(mix32(mix32(step & MASK32) ^ (seed & MASK32)) ^ ((seed >> 32) & MASK32))


def as_int32(key: int) -> int:
    """A uint32 as the int32 with the same bits (the kernel's key table is int32)."""
    return key - (1 << 32) if key >= 1 << 31 else key


def row_noise(keys: list[int], ncols: int, device: torch.device) -> torch.Tensor:
    """int64 [D, ncols]: h = mix32(key ^ column) of each slot's row (``keys``: uint32, one per row)."""
    cols = torch.arange(ncols, dtype=torch.int64, device=device)
    key = torch.tensor(keys, dtype=torch.int64, device=device).unsqueeze(1)
    return mix32(key ^ cols)


def round_stochastic(x: torch.Tensor, noise16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16: ``noise16`` (int64, 0 <= r < 2^16, broadcastable) added to x's bit
    pattern, the low 16 bits cleared (module doc). The result is exact in bf16."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
    kept = (bits + noise16) & HIGH16
    signed = kept - ((kept >> 31) << 32)  # the same 32 bits as an int32 value
    return signed.to(torch.int32).view(torch.float32).to(torch.bfloat16)


def store_moments(m: torch.Tensor, v: torch.Tensor, m_out: torch.Tensor, v_out: torch.Tensor, keys: list[int]) -> None:
    """Round the fp32 moments ``m``, ``v`` ([D, P], rows of slots with rounding ``keys``) into
    the bf16 ``m_out``, ``v_out``."""
    h = row_noise(keys, m.shape[1], m.device)
    m_out.copy_(round_stochastic(m, h >> 16))
    v_out.copy_(round_stochastic(v, h & LOW16))
