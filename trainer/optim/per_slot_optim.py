"""Per-slot AdamW, learning-rate schedule and gradient clipping.

Every slot is its own optimizer: own moments (slices of stacked moment tensors
shaped like the stacked LoRA parameters), own step count, own schedule, own
clipping norm. An update of slot i reads and writes only slot i's live blocks
(``A[i, :r]``, ``B[i, :, :r]`` and the same blocks of the moments), so other
slots stay bit-identical and padded rows/columns are never touched.

The update is torch.optim.AdamW's single-tensor algorithm, op for op (checked
bit-exact in tests/unit/test_trainer_optim.py), so an adapter trained here
matches one trained with a plain torch optimizer.

The schedule is a pure function of (hyper-parameters, step), so "scheduler
state" is the step count.

A slot may keep its moments in bfloat16 (``SlotHyperParams.state_dtype``): the same fp32 update
on fp32 copies of them, then stored with stochastic rounding (compact_state.py, which says why).
The slots of one step are updated in groups of one state dtype each; a float32 slot takes exactly
the path it took before the compact state existed (bit-identical).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.kernels import triton_adamw
from trainer.config import SlotHyperParams
from trainer.optim import compact_state


def lr_at(hyper: SlotHyperParams, step: int) -> float:
    """Learning rate of update number ``step`` (1-based).

    Warm-up: lr * step / warmup_steps for step <= warmup_steps. Then constant, or
    cosine from lr down to min_lr_ratio * lr at total_steps (held after it).
    """
    if step < 1:
        raise ValueError(f"update numbers start at 1, got {step}")
    if hyper.warmup_steps and step <= hyper.warmup_steps:
        return hyper.lr * step / hyper.warmup_steps
    if hyper.lr_schedule == "constant":
        return hyper.lr
    assert hyper.total_steps is not None  # validated by SlotHyperParams
    span = max(hyper.total_steps - hyper.warmup_steps, 1)
    progress = min(max(step - hyper.warmup_steps, 0) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return hyper.lr * (hyper.min_lr_ratio + (1.0 - hyper.min_lr_ratio) * cosine)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm is None:
        return 1.0
    return min(max_norm / (total_norm + 1e-6), 1.0)


@torch.no_grad()
def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    hyper: SlotHyperParams,
) -> None:
    """One AdamW update of one block, in place (views into the stacked tensors are fine)."""
    beta1, beta2 = hyper.betas
    if hyper.weight_decay:
        param.mul_(1 - lr * hyper.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = math.sqrt(bias_correction2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


@torch.no_grad()
def adamw_update_slots(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    slots: torch.Tensor | list[int],
    *,
    grad_scale: torch.Tensor,
    lr: torch.Tensor,
    weight_decay: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    step: torch.Tensor,
) -> None:
    """AdamW for several slots of one stacked tensor at once (same math as ``adamw_update``).

    ``param``/``grad``/moments are stacked [N, ...]; ``slots`` (ascending slot ids, [D])
    picks the slots that step; every hyper-parameter is a float64 [D] tensor, one value
    per slot, and ``grad_scale`` folds in the slot's loss normalization and clipping.
    Whole slot slices are updated: padded rows/columns have zero weight, gradient and
    moments, and the update keeps them exactly zero. Ops are elementwise, so a slot's
    result does not depend on which other slots step with it.

    The stepping slots' gradient is consumed: it is left zero. Slots that form one
    contiguous range (the usual mixed step: every resident adapter steps) are updated in
    place through views; otherwise they are gathered, updated and scattered back. Both run
    the same ops, so the result is the same.
    """
    cols = AdamwColumns.build(param.dtype, param.device, grad_scale=grad_scale, lr=lr, weight_decay=weight_decay,
                              beta1=beta1, beta2=beta2, eps=eps, step=step)
    adamw_apply(param, grad, exp_avg, exp_avg_sq, slots, cols)


@dataclass(frozen=True)
class AdamwColumns:
    """Per-slot AdamW factors [D] (compute dtype, on the device), derived once per step and
    shared by every stacked tensor (the trainer has hundreds: one set of tiny kernels)."""

    grad_scale: torch.Tensor
    decay: torch.Tensor  # 1 - lr * weight_decay
    one_minus_beta1: torch.Tensor
    beta2: torch.Tensor
    one_minus_beta2: torch.Tensor
    bias_correction2_sqrt: torch.Tensor
    eps: torch.Tensor
    neg_step_size: torch.Tensor  # -lr / bias_correction1
    table: torch.Tensor | None = None  # [D, 8]: the columns above side by side (they are its views), when built so
    # Per slot (host side): how it stores its moments (SlotHyperParams.state_dtype; empty = every
    # one float32), and for bfloat16 slots the rounding key of this update (compact_state.noise_key).
    state_dtypes: tuple[str, ...] = ()
    noise_keys: tuple[int, ...] = ()

    @staticmethod
    def build(dtype: torch.dtype, device: torch.device, *, grad_scale, lr, weight_decay, beta1, beta2, eps, step,  # noqa: ANN001 - float64 [D] tensors
              state_dtypes: tuple[str, ...] = (), noise_keys: tuple[int, ...] = ()) -> "AdamwColumns":
        """The factors computed in float64 where the inputs are, rounded to ``dtype`` once, and moved
        to ``device`` as one [D, 8] table (one host-to-device copy per step, not eight)."""
        columns = (grad_scale, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, (1 - beta2**step).sqrt(), eps,
                   -lr / (1 - beta1**step))
        table = torch.stack(columns, dim=1).to(dtype).to(device)
        return AdamwColumns(*table.unbind(1), table=table, state_dtypes=tuple(state_dtypes), noise_keys=tuple(noise_keys))

    def kernel_table(self) -> torch.Tensor:
        """The fp32 [D, 8] table the Triton kernel reads (columns in triton_adamw's order)."""
        if self.table is not None:
            return self.table.float()
        return torch.stack([self.grad_scale, self.decay, self.one_minus_beta1, self.beta2, self.one_minus_beta2,
                            self.bias_correction2_sqrt, self.eps, self.neg_step_size], dim=1).float()

    def select(self, rows: list[int]) -> "AdamwColumns":
        """The factors of the slots at positions ``rows`` (values copied exactly)."""
        idx = torch.tensor(rows, device=self.grad_scale.device)
        keys = tuple(self.noise_keys[r] for r in rows) if self.noise_keys else ()
        dtypes = tuple(self.state_dtypes[r] for r in rows) if self.state_dtypes else ()
        if self.table is not None:
            table = self.table.index_select(0, idx)
            return AdamwColumns(*table.unbind(1), table=table, state_dtypes=dtypes, noise_keys=keys)
        factors = (self.grad_scale, self.decay, self.one_minus_beta1, self.beta2, self.one_minus_beta2,
                   self.bias_correction2_sqrt, self.eps, self.neg_step_size)
        return AdamwColumns(*(f.index_select(0, idx) for f in factors), state_dtypes=dtypes, noise_keys=keys)

    def state_groups(self, ids: list[int]) -> list[tuple[str, list[int], "AdamwColumns"]]:
        """The stepping slots ``ids`` (one per row) split by state dtype: (dtype, its slots, their
        factors), float32 first. All float32 (the default): this one group with these very factors."""
        dtypes = self.state_dtypes or ("float32",) * len(ids)
        if len(dtypes) != len(ids):
            raise ValueError(f"{len(ids)} stepping slots but {len(dtypes)} state dtypes")
        if all(d == "float32" for d in dtypes):
            return [("float32", ids, self)]
        groups = []
        for dtype in ("float32", "bfloat16"):
            rows = [i for i, d in enumerate(dtypes) if d == dtype]
            if rows:
                groups.append((dtype, [ids[i] for i in rows], self.select(rows)))
        if sum(len(g[1]) for g in groups) != len(ids):
            raise ValueError(f"state dtypes {sorted(set(dtypes))}: each must be float32 or bfloat16")
        if any(d == "bfloat16" for d in dtypes) and len(self.noise_keys) != len(ids):
            raise ValueError("bfloat16 slots step with a rounding key each (AdamwColumns.noise_keys)")
        return groups


@torch.no_grad()
def adamw_apply(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    slots: torch.Tensor | list[int],
    cols: AdamwColumns,
    compact_moments: torch.Tensor | None = None,
) -> None:
    """``adamw_update_slots`` with the per-slot factors already built (see there). On CUDA
    with Triton, one fused kernel over the rows (triton_adamw.py); else torch ops. Slots whose
    ``cols.state_dtypes`` is bfloat16 keep their moments in ``compact_moments`` (bf16 [N, 2P]:
    exp_avg in [:, :P], exp_avg_sq in [:, P:]; SlotBuffers.compact_moments), not in ``exp_avg``
    / ``exp_avg_sq``."""
    ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
    if not ids:
        return
    for dtype, group, gcols in cols.state_groups(ids):
        if dtype == "float32":
            _apply_float32(param, grad, exp_avg, exp_avg_sq, group, gcols)
        else:
            _apply_compact(param, grad, compact_moments, group, gcols)


def _column_view(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    shape = (-1,) + (1,) * (param.dim() - 1)
    return lambda x: x.view(shape)


def _adamw_ops(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, cols: AdamwColumns,
               col: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The update's torch ops on rows (fp32, in place; ``col`` shapes a [D] factor to broadcast)."""
    g.mul_(col(cols.grad_scale))
    p.mul_(col(cols.decay))
    m.lerp_(g, col(cols.one_minus_beta1))
    v.mul_(col(cols.beta2)).addcmul_(g.mul(col(cols.one_minus_beta2)), g)
    denom = v.sqrt().div_(col(cols.bias_correction2_sqrt)).add_(col(cols.eps))
    update = torch.div(m, denom, out=denom)
    p.addcmul_(update, col(cols.neg_step_size))


def _rows(ids: list[int], *tensors: torch.Tensor) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """Rows ``ids`` (ascending) of each [N, ...] tensor: views when they are one contiguous range
    (the usual step: every resident slot), else gathered copies; and what writes the copies back
    (nothing for views). Both run the same ops on the rows, so the results are the same."""
    lo, hi = ids[0], ids[-1] + 1
    if ids == list(range(lo, hi)):
        return [t[lo:hi] for t in tensors], lambda: None
    idx = torch.tensor(ids, device=tensors[0].device)
    rows = [t.index_select(0, idx) for t in tensors]

    def put_back() -> None:
        for t, r in zip(tensors, rows):
            t.index_copy_(0, idx, r)

    return rows, put_back


def _apply_float32(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   ids: list[int], cols: AdamwColumns) -> None:
    """Float32 moments: the kernel where it runs, else the torch ops on the rows."""
    if param.dim() == 2 and triton_adamw.available(param) and grad.stride() == param.stride():
        triton_adamw.adamw_rows(param, grad, exp_avg, exp_avg_sq, ids, cols.kernel_table())
        return
    (p, g, m, v), put_back = _rows(ids, param, grad, exp_avg, exp_avg_sq)
    _adamw_ops(p, g, m, v, cols, _column_view(param))
    g.zero_()  # consumed
    put_back()


def _apply_compact(param: torch.Tensor, grad: torch.Tensor, moments: torch.Tensor | None, ids: list[int],
                   cols: AdamwColumns) -> None:
    """Bfloat16 moments (compact_state.py): the kernel where it runs, else the same fp32 torch ops
    on fp32 copies of the moments, which are then stored stochastically rounded."""
    width = param.shape[-1]
    if param.dim() != 2 or moments is None or moments.dtype != torch.bfloat16 or moments.shape != (param.shape[0], 2 * width):
        raise ValueError("bfloat16-state slots need [N, P] slot rows and their bf16 [N, 2P] moment rows "
                         "(SlotBuffers.compact_moments)")
    if triton_adamw.available(param) and grad.stride() == param.stride():
        keys = torch.tensor([compact_state.as_int32(k) for k in cols.noise_keys], dtype=torch.int32, device=param.device)
        triton_adamw.adamw_rows_compact(param, grad, moments, ids, cols.kernel_table(), keys)
        return
    (p, g, mv), put_back = _rows(ids, param, grad, moments)
    m, v = mv[:, :width].float(), mv[:, width:].float()
    _adamw_ops(p, g, m, v, cols, _column_view(param))
    compact_state.store_moments(m, v, mv[:, :width], mv[:, width:], list(cols.noise_keys))
    g.zero_()  # consumed
    put_back()
