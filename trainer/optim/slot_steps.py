"""Per-slot optimizer steps on whole rows of the slot buffers, and what a train call reports.

* ``step_due_slots``: the loop's steps: reduce the due slots' gradients over DP, normalize each
  by its own loss normalization, skip a non-finite one, clip, AdamW with each slot's own
  hyper-parameters and schedule; a handful of ops whatever the number of slots and layers.
* ``adam_step``: a tenant-driven step (the Tinker API's optim_step): the gradient as is (under
  DP the sum of the ranks' parts), the call's AdamW parameters.

Each slot's moments are stored as its ``hyper.state_dtype`` says (float32, or bfloat16 rounded with
the key of its seed and update number: compact_state.py).

Invariants: every op touches only the stepping slots' rows; a non-finite slot's accumulated
gradient is discarded and its counters do not advance; each slot's pending samples and
statistics are reset by its step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from pydantic import BaseModel

from trainer.platform.distributed import ParallelLayout, dp_group, tp_group
from trainer.optim.compact_state import noise_key
from trainer.optim.per_slot_optim import AdamwColumns, adamw_apply, clip_coefficient, lr_at
from trainer.lora.slot_buffers import SlotBuffers
from trainer.optim.step_overlap import StepOverlap
from trainer.lora.slots import CLIPPED, KL, NUM, RATIO, RL_TOKENS, SAMPLES, TOKENS, SlotState, zero_stats


class StepReport(BaseModel):
    step: int  # the update number just taken (or attempted)
    lr: float
    grad_norm: float  # before clipping, after normalization
    loss: float  # the step's normalized loss (what the gradient is the gradient of)
    skipped_nonfinite: bool = False


class SlotMetrics(BaseModel):
    samples: int = 0
    loss_tokens: int = 0
    loss: float = 0.0  # this call's samples, normalized like the slot's steps
    clip_frac: float = 0.0
    ratio_mean: float = 0.0
    kl_mean: float = 0.0
    pending_samples: int = 0  # accumulated toward the next step after this call
    steps: list[StepReport] = []


class TrainResult(BaseModel):
    slots: dict[int, SlotMetrics]
    stepped: list[int]  # slots that applied at least one update in this call
    skipped_nonfinite: list[int]
    dropped_foreign: dict[int, int]  # slot -> samples dropped for a registration mismatch


def raw_grad_norms(buf: SlotBuffers, slots: list[int], grads: torch.Tensor, layout: ParallelLayout) -> list[float]:
    """Norms per slot of the raw gradient rows ``grads`` (of ``slots``). TP: columns split over
    TP are summed over the group, replicated ones counted once."""
    sq_split = torch.linalg.vector_norm(grads[:, : buf.split_cols], dim=1, dtype=torch.float32).square()
    sq_repl = torch.linalg.vector_norm(grads[:, buf.split_cols :], dim=1, dtype=torch.float32).square()
    if layout.tp_size > 1:
        dist.all_reduce(sq_split, group=tp_group())
    return (sq_split + sq_repl).sqrt().double().cpu().tolist()


def normalizer(state: SlotState, stats: torch.Tensor) -> float:
    """What the slot's summed loss numerators are divided by (its loss_normalization)."""
    h = state.hyper
    if h.loss_normalization == "sequence_mean":
        return float(stats[SAMPLES]) if stats[SAMPLES] > 0 else 1.0
    if h.loss_normalization == "token_mean":
        return max(float(stats[TOKENS]), 1.0)
    return float(stats[SAMPLES]) * h.loss_norm_tokens


def slot_metrics(state: SlotState, stats: torch.Tensor, steps: list[StepReport]) -> SlotMetrics:
    rl_tokens = max(float(stats[RL_TOKENS]), 1.0)
    return SlotMetrics(
        samples=int(stats[SAMPLES]), loss_tokens=int(stats[TOKENS]),
        loss=float(stats[NUM]) / normalizer(state, stats),
        clip_frac=float(stats[CLIPPED]) / rl_tokens, ratio_mean=float(stats[RATIO]) / rl_tokens,
        kl_mean=float(stats[KL]) / rl_tokens, pending_samples=state.pending_samples, steps=steps,
    )


@torch.no_grad()
def step_due_slots(buf: SlotBuffers, due: list[int], states: list[SlotState], layout: ParallelLayout,
                   device: torch.device, overlap: StepOverlap) -> dict[int, StepReport]:
    """Reduce over DP, normalize, check, clip and update the ``due`` slots (ascending; ``states``
    theirs, in that order), then reset their pending samples and statistics. ``overlap``: the
    trainer's step runner (the update may run on its stream and outlive this call, step_overlap.py)."""
    pending = torch.stack([st.pending for st in states])
    grads = buf.rows(buf.grad, due)  # a view when the due slots are one contiguous range
    if layout.dp_size > 1:  # only the due slots' gradients (and counters) cross DP
        reduced = grads.contiguous()
        dist.all_reduce(reduced, group=dp_group())
        buf.put_rows(buf.grad, due, reduced)
        grads = buf.rows(buf.grad, due)
        pending_dev = pending.to(device)
        dist.all_reduce(pending_dev, group=dp_group())
        pending = pending_dev.cpu()
    raw_norms = raw_grad_norms(buf, due, grads, layout)

    reports, stepping, scale, hyper_rows, stores = {}, [], [], [], []
    for row, (slot, st) in enumerate(zip(due, states)):
        stats = pending[row]
        norm_by = normalizer(st, stats)
        grad_norm = raw_norms[row] / norm_by  # the normalized gradient's norm
        loss = float(stats[NUM]) / norm_by
        lr = lr_at(st.hyper, st.step + 1)
        finite = math.isfinite(grad_norm) and math.isfinite(loss)
        if finite:
            st.step += 1
            stepping.append(slot)
            scale.append(clip_coefficient(grad_norm, st.hyper.max_grad_norm) / norm_by)
            h = st.hyper
            hyper_rows.append((lr, h.weight_decay, h.betas[0], h.betas[1], h.eps, st.step))
            stores.append((h.state_dtype, noise_key(st.seed, st.step)))
        reports[slot] = StepReport(step=st.step if finite else st.step + 1, lr=lr, grad_norm=grad_norm,
                                   loss=loss, skipped_nonfinite=not finite)
    if stepping:
        hp = torch.tensor(hyper_rows, dtype=torch.float64)

        def make_cols() -> AdamwColumns:
            return AdamwColumns.build(
                buf.weight.dtype, device, grad_scale=torch.tensor(scale, dtype=torch.float64),
                lr=hp[:, 0], weight_decay=hp[:, 1], beta1=hp[:, 2], beta2=hp[:, 3], eps=hp[:, 4], step=hp[:, 5],
                state_dtypes=tuple(d for d, _ in stores), noise_keys=tuple(k for _, k in stores),
            )

        overlap.apply(buf, stepping, make_cols)  # zeroes their grads
    stepped = set(stepping)
    skipped = [slot for slot in due if slot not in stepped]
    if skipped:  # a non-finite slot's accumulated batch is discarded
        buf.grad.index_fill_(0, torch.tensor(skipped, device=device), 0.0)
    for st in states:
        st.pending_samples = 0
        st.pending = zero_stats()
    return reports


@torch.no_grad()
def adam_step(buf: SlotBuffers, slot: int, state: SlotState, layout: ParallelLayout, device: torch.device, *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              max_grad_norm: float | None) -> dict:
    """Apply the slot's accumulated gradient AS IS (no normalization: the caller's loss defines
    the scale) with these AdamW parameters, then zero it; ``state.step`` advances by one (Adam's
    bias correction uses it). A non-finite gradient changes nothing but zeroes the gradient and
    is reported. Collective over TP and DP.

    DP: each rank's rows hold the part of the gradient its share of the datums gave (the loss is
    a SUM over datums, so the gradient is the SUM of the parts, not their mean); the rows are
    all-reduced first, so every rank then holds the whole gradient, bit-identical, and takes the
    same norm, clip and update."""
    if layout.dp_size > 1:
        dist.all_reduce(buf.rows(buf.grad, [slot]), group=dp_group())  # one row: a view, reduced in place
    grad_norm = raw_grad_norms(buf, [slot], buf.rows(buf.grad, [slot]), layout)[0]
    if not math.isfinite(grad_norm):
        buf.grad.index_fill_(0, torch.tensor([slot], device=device), 0.0)
        return {"grad_norm": grad_norm, "skipped_nonfinite": True, "step": state.step}
    state.step += 1
    f64 = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    cols = AdamwColumns.build(
        buf.weight.dtype, device, grad_scale=f64(clip_coefficient(grad_norm, max_grad_norm)), lr=f64(lr),
        weight_decay=f64(weight_decay), beta1=f64(beta1), beta2=f64(beta2), eps=f64(eps), step=f64(state.step),
        state_dtypes=(state.hyper.state_dtype,), noise_keys=(noise_key(state.seed, state.step),),
    )
    adamw_apply(buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq, [slot], cols, buf.compact_moments)  # zeroes its gradient
    return {"grad_norm": grad_norm, "skipped_nonfinite": False, "step": state.step}
