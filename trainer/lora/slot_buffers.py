"""Every slot's LoRA state in four slot-major buffers: one row per slot.

The trainer holds, for N slots, the stacked ``lora_A`` / ``lora_B`` of every wrapped
linear (hundreds of tensors for a real model), their gradients and two Adam moments.
Here all of them are views into four fp32 buffers shaped [N, P] (P = LoRA elements
per slot over all layers):

    weight[i], grad[i], exp_avg[i], exp_avg_sq[i]  =  everything slot i owns.

Each layer keeps its ``lora_A``/``lora_B`` parameters (views into ``weight``, so the
layers compute as before) and their ``.grad`` is preset to the matching view of
``grad``: autograd accumulates into it in place. Per-slot work that used to loop over
every tensor (gradient norms, the AdamW update, zeroing, clearing a slot, the DP
all-reduce of stepping slots) is then a few ops on whole rows, whatever the number
of layers.

On CUDA the optimizer step may still be writing these buffers on a stream of its own after
``train`` returns (trainer/optim/step_overlap.py): every accessor below first makes the current
stream wait for it (``settle``, a device-side wait; the layers' forwards wait per layer).

A slot whose moments are bfloat16 (``SlotHyperParams.state_dtype``; trainer/optim/compact_state.py)
keeps both of them in the bytes of its own exp_avg row: ``compact_moments`` is the [N, 2P] bf16
view of ``exp_avg``, a slot's exp_avg in ``[:, :P]`` and its exp_avg_sq in ``[:, P:]``; that slot's
exp_avg_sq row stays zero. Every row keeps one layout, so a tenant of either kind fits any slot,
and a slot's state is still its own rows. ``views`` names those moments ``exp_avg.bfloat16`` and
``exp_avg_sq.bfloat16`` (``state_kind``).

Columns hold the tensors split over tensor parallelism first (``split_cols`` of
them), then the replicated ones, so a slot's squared gradient norm is
``|row[:split_cols]|^2`` summed over TP plus ``|row[split_cols:]|^2`` counted once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch
from torch import nn

from trainer.lora.multi_lora import MultiLoraLinear

# The four buffers, by the name checkpoints, snapshots and swaps use for them.
BUFFER_KINDS = ("weight", "grad", "exp_avg", "exp_avg_sq")
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # SlotHyperParams.state_dtype -> storage


def state_kind(kind: str, state_dtype: str) -> str:
    """The ``views`` kind that holds a slot's ``kind`` (a BUFFER_KINDS name) for its state dtype:
    the moments of a bfloat16 slot are ``exp_avg.bfloat16`` / ``exp_avg_sq.bfloat16``."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state_dtype!r}: allowed are {', '.join(STATE_DTYPES)}")
    return f"{kind}.{state_dtype}" if kind in MOMENT_KINDS and state_dtype != "float32" else kind


def row_kinds(state_dtype: str) -> tuple[str, ...]:
    """The buffers whose rows hold a slot's state: all four for float32; a bfloat16 slot's
    exp_avg_sq row is unused (zero), both its moments being in its exp_avg row."""
    return BUFFER_KINDS if state_kind("exp_avg", state_dtype) == "exp_avg" else ("weight", "grad", "exp_avg")


class SlotBuffers:
    def __init__(self, layers: list[MultiLoraLinear], num_slots: int, device: torch.device) -> None:
        entries = [(layer, name, split) for layer in layers
                   for name, split in (("lora_A", layer.a_is_tp_split), ("lora_B", layer.b_is_tp_split))]
        ordered = [e for e in entries if e[2]] + [e for e in entries if not e[2]]
        sizes = {id(getattr(layer, name)): getattr(layer, name)[0].numel() for layer, name, _ in entries}
        total = sum(sizes.values())
        self.split_cols = sum(sizes[id(getattr(layer, name))] for layer, name, split in entries if split)
        dtype = layers[0].lora_A.dtype
        self.settle: Callable[[], None] = lambda: None  # StepOverlap.settle once the trainer has one
        self.behind_step: Callable[[], ContextManager] = contextlib.nullcontext  # StepOverlap.behind_step likewise
        self.weight, self.grad, self.exp_avg, self.exp_avg_sq = (
            torch.zeros(num_slots, total, dtype=dtype, device=device) for _ in range(4)
        )
        # bf16 moments of bfloat16-state slots (module doc); None when the rows are not fp32
        self.compact_moments: torch.Tensor | None = (self.exp_avg.view(torch.bfloat16)
                                                     if self.exp_avg.dtype == torch.float32 else None)
        offsets, col = {}, 0
        for layer, name, _ in ordered:
            offsets[(id(layer), name)] = col
            col += sizes[id(getattr(layer, name))]
        # params, grads and moments in layer order (A, B per layer), as the trainer lists them
        self.params: list[nn.Parameter] = []
        self.exp_avg_views: list[torch.Tensor] = []
        self.exp_avg_sq_views: list[torch.Tensor] = []
        # per parameter (same order): where its block starts in a row, its shape without the slot
        # dimension, and whether it is split over TP (row_views)
        self.row_layout: list[tuple[int, torch.Size, bool]] = []
        self._compact_views: dict[str, list[torch.Tensor]] = {state_kind(k, "bfloat16"): [] for k in MOMENT_KINDS}
        for layer, name, split in entries:
            old = getattr(layer, name)
            start = offsets[(id(layer), name)]

            def view(buf: torch.Tensor, start=start, old=old) -> torch.Tensor:
                return buf[:, start : start + old[0].numel()].view(old.shape)

            with torch.no_grad():
                view(self.weight).copy_(old)
            param = nn.Parameter(view(self.weight), requires_grad=True)
            param.grad = view(self.grad)
            setattr(layer, name, param)
            self.params.append(param)
            self.exp_avg_views.append(view(self.exp_avg))
            self.exp_avg_sq_views.append(view(self.exp_avg_sq))
            self.row_layout.append((start, old.shape[1:], split))
            if self.compact_moments is not None:
                for half, kind in enumerate(MOMENT_KINDS):
                    first = half * total + start
                    self._compact_views[state_kind(kind, "bfloat16")].append(
                        self.compact_moments[:, first : first + old[0].numel()].view(old.shape))

    def layer_columns(self) -> list[list[tuple[int, int]]]:
        """Per layer (the constructor's order), the half-open column ranges of its A and B in a row."""
        blocks = [(start, start + shape.numel()) for start, shape, _ in self.row_layout]
        return [blocks[i : i + 2] for i in range(0, len(blocks), 2)]

    def by_kind(self) -> dict[str, torch.Tensor]:
        """The four [N, P] buffers by their BUFFER_KINDS names."""
        self.settle()
        return {"weight": self.weight, "grad": self.grad, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def views(self, kind: str) -> list[torch.Tensor]:
        """Every parameter's [N, ...] view of the ``kind`` buffer, in layer order (A, B per layer);
        ``kind`` also ``exp_avg.bfloat16`` / ``exp_avg_sq.bfloat16``: the bf16 moments of bfloat16-state
        slots (module doc), meaningful in those slots' rows only."""
        self.settle()
        if kind == "weight":
            return [p.data for p in self.params]
        if kind == "grad":
            return [p.grad for p in self.params]
        if kind in self._compact_views:
            if self.compact_moments is None:
                raise ValueError(f"{kind}: bfloat16 moments need fp32 slot rows; these are {self.exp_avg.dtype}")
            return self._compact_views[kind]
        return {"exp_avg": self.exp_avg_views, "exp_avg_sq": self.exp_avg_sq_views}[kind]

    def row_views(self, split_parts: list[torch.Tensor], replicated: torch.Tensor) -> list[list[torch.Tensor]]:
        """One slot's row, taken apart: per parameter (layer order, A and B), the block of each TP
        rank, as views. ``split_parts[t]`` is TP rank t's ``row[:split_cols]``; ``replicated`` is
        ``row[split_cols:]`` (the same on every rank), which gives one block. The row may be on
        any device and in any dtype (a publish snapshot's host copy)."""
        out = []
        for start, shape, split in self.row_layout:
            n = shape.numel()
            if split:
                out.append([part[start : start + n].view(shape) for part in split_parts])
            else:
                s = start - self.split_cols
                out.append([replicated[s : s + n].view(shape)])
        return out

    def check_grads_in_place(self) -> None:
        """Autograd must have accumulated into the preset gradient views (it does so in place
        when a .grad exists and no graph is built); anything else would be lost here."""
        base = self.grad.untyped_storage().data_ptr()
        for p in self.params:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != base:
                raise RuntimeError("a LoRA gradient was not accumulated into the slot buffers (was backward run "
                                   "with create_graph, or .grad replaced?)")

    def rows(self, buf: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The rows of ``slots`` (ascending): a view for one contiguous range, else a gathered copy."""
        self.settle()
        lo, hi = slots[0], slots[-1] + 1
        if slots == list(range(lo, hi)):
            return buf[lo:hi]
        return buf.index_select(0, torch.tensor(slots, device=buf.device))

    def put_rows(self, buf: torch.Tensor, slots: list[int], values: torch.Tensor) -> None:
        self.settle()
        lo, hi = slots[0], slots[-1] + 1
        if slots == list(range(lo, hi)):
            if values.data_ptr() != buf[lo:hi].data_ptr():
                buf[lo:hi].copy_(values)
        else:
            buf.index_copy_(0, torch.tensor(slots, device=buf.device), values)

    @torch.no_grad()
    def zero_slot(self, slot: int) -> None:
        self.settle()
        for buf in (self.weight, self.grad, self.exp_avg, self.exp_avg_sq):
            buf[slot].zero_()
