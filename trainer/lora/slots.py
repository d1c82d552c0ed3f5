"""The trainer's slots: who holds each one (``SlotState``), its LoRA scales, and its buffer rows
read and written in the full (TP=1) layout.

Invariants:
* slot i is free exactly when ``table[i]`` is None; a free slot's four buffer rows are zero
  and its scales 0, so a layer routed to it adds nothing;
* a slot's scales (alpha / r in each target group it trains, 0 in the others) and expert scale
  are set with its state (``occupy``) and zeroed with it (``vacate``): the layers read them from
  ``scales`` (multi_lora.SlotScales) / ``expert_scales``;
* a target group the slot does not train (``SlotHyperParams.targets``; experts: ``lora_experts``
  too) has exactly zero weights and scale 0 in every layer of it, so it adds nothing and gets a
  zero gradient, hence no update (AdamW keeps zero weights, moments and gradient at zero);
* only the live ``[:rank]`` blocks of a slot are ever written; the padding stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.config import TARGET_GROUPS, SlotHyperParams, target_group
from trainer.lora.multi_lora import SlotScales
from trainer.lora.slot_buffers import SlotBuffers

# Columns of the per-slot statistics accumulators (SlotState.pending, a train call's statistics).
NUM, SAMPLES, TOKENS, CLIPPED, RATIO, KL, RL_TOKENS = range(7)
N_STATS = 7


def zero_stats() -> torch.Tensor:
    return torch.zeros(N_STATS, dtype=torch.float64)


@dataclass
class SlotState:
    hyper: SlotHyperParams
    rank: int  # live rows of A / columns of B (hyper.rank, or more for a stacked PEFT import)
    scale: float  # alpha / r
    seed: int
    registration: str | None
    step: int = 0  # optimizer updates taken (the schedule's position)
    pending_samples: int = 0  # samples accumulated toward the next step (global over DP)
    pending: torch.Tensor = field(default_factory=zero_stats)  # local stats

    def counters(self) -> dict:
        """Everything but the pending statistics, JSON-able (checkpoints and swap snapshots)."""
        return {"hyper": self.hyper.model_dump(mode="json"), "rank": self.rank, "scale": self.scale,
                "seed": self.seed, "registration": self.registration, "step": self.step,
                "pending_samples": self.pending_samples}

    @classmethod
    def from_counters(cls, counters: dict, pending: torch.Tensor, registration: str | None = None) -> "SlotState":
        """The state ``counters`` describe; ``registration`` replaces the saved one when given."""
        c = counters
        return cls(hyper=SlotHyperParams(**c["hyper"]), rank=c["rank"], scale=c["scale"], seed=c["seed"],
                   registration=registration if registration is not None else c["registration"],
                   step=c["step"], pending_samples=c["pending_samples"], pending=pending)


class SlotTable:
    """The N slots of one trainer rank: their states, scales and rows (``buffers``)."""

    def __init__(self, layers: list, buffers: SlotBuffers, device: torch.device) -> None:
        n = buffers.weight.shape[0]
        self.layers = layers  # every LoRA layer (dense and expert), in the buffers' order
        self.buffers = buffers
        self.device = device
        self.scales = SlotScales(n, device)
        self.expert_scales = torch.zeros(n, dtype=torch.float32, device=device)  # 0 for attention-only adapters
        self._states: list[SlotState | None] = [None] * n

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, slot: int) -> SlotState | None:
        return self._states[slot]

    def check(self, slot: int) -> None:
        if not 0 <= slot < len(self._states):
            raise ValueError(f"slot {slot} out of range 0..{len(self._states) - 1}")

    def state(self, slot: int) -> SlotState:
        """The state of an initialized slot (ValueError otherwise)."""
        self.check(slot)
        state = self._states[slot]
        if state is None:
            raise ValueError(f"slot {slot} is not initialized")
        return state

    def require_free(self, slot: int, before: str) -> None:
        """ValueError unless ``slot`` is free; ``before`` says what to do first ("clear it before ...")."""
        self.check(slot)
        if self._states[slot] is not None:
            raise ValueError(f"slot {slot} is in use; {before}")

    def occupy(self, slot: int, state: SlotState) -> None:
        """Give the (written) slot its state and scales."""
        self._states[slot] = state
        self.scales.set(slot, [state.scale if g in state.hyper.targets else 0.0 for g in TARGET_GROUPS])
        self.expert_scales[slot] = state.scale if trains_experts(state.hyper) else 0.0

    def vacate(self, slot: int) -> None:
        """Weights, gradients, optimizer state and pending samples of the slot, all gone."""
        self.check(slot)
        self.buffers.zero_slot(slot)
        self.scales.set(slot, [0.0] * len(TARGET_GROUPS))
        self.expert_scales[slot] = 0.0
        self._states[slot] = None

    def status(self, slot: int) -> dict:
        self.check(slot)
        s = self._states[slot]
        if s is None:
            return {"slot": slot, "active": False}
        return {"slot": slot, "active": True, "rank": s.rank, "scale": s.scale, "step": s.step,
                "pending_samples": s.pending_samples, "registration": s.registration}

    def trained_layers(self, hyper: SlotHyperParams) -> list:
        """The layers (in buffer order) a slot with ``hyper`` trains; its blocks in every other layer
        stay exactly zero."""
        return [layer for layer in self.layers if layer_trained(layer, hyper)]

    # -- rows <-> full (TP=1 Megatron layout) tensors --------------------------------------------

    @torch.no_grad()
    def write_full(self, slot: int, kind: str, rank: int, a_full: dict, b_full: dict) -> None:
        """Place full-layout A/B per layer (padded to ``rank``) into the slot's ``kind`` blocks; a
        None (or absent) tensor leaves its block as it is (zero in a freshly vacated slot)."""
        views = self.buffers.views(kind)
        for layer, a_view, b_view in zip(self.layers, views[0::2], views[1::2]):
            a, b = a_full.get(layer.name), b_full.get(layer.name)
            # rank is A's second-to-last dim and B's last (dense [r, in] / [out, r], experts [E, r, in] / [E, out, r])
            if a is not None:
                if a.shape[-2] < rank:
                    a = torch.cat([a, a.new_zeros(*a.shape[:-2], rank - a.shape[-2], a.shape[-1])], dim=-2)
                layer.a_block(a_view, slot, rank).copy_(layer.local_a(a).to(self.device))
            if b is not None:
                if b.shape[-1] < rank:
                    b = torch.cat([b, b.new_zeros(*b.shape[:-1], rank - b.shape[-1])], dim=-1)
                layer.b_block(b_view, slot, rank).copy_(layer.local_b(b).to(self.device))

    @torch.no_grad()
    def read_full(self, slot: int, kind: str, rank: int, layers: list | None = None) -> tuple[dict, dict]:
        """The slot's ``kind`` blocks gathered to the full layout, per layer (of ``layers``, default
        every layer), fp32 on the host. Collective over TP."""
        views = self.buffers.views(kind)
        names = None if layers is None else {layer.name for layer in layers}
        a_full, b_full = {}, {}
        for layer, a, b in zip(self.layers, views[0::2], views[1::2]):
            if names is not None and layer.name not in names:
                continue
            a_full[layer.name] = layer.full_a(layer.a_block(a, slot, rank)).float().cpu()
            b_full[layer.name] = layer.full_b(layer.b_block(b, slot, rank)).float().cpu()
        return a_full, b_full


def trains_experts(hyper: SlotHyperParams) -> bool:
    """Whether a slot with ``hyper`` trains the routed experts of an MoE base (they are MLP)."""
    return hyper.lora_experts and "mlp" in hyper.targets


def layer_trained(layer, hyper: SlotHyperParams) -> bool:  # noqa: ANN001 - a LoRA layer
    """Whether a slot with ``hyper`` trains ``layer`` (its target group is on; experts: trains_experts)."""
    if getattr(layer, "is_expert", False):
        return trains_experts(hyper)
    return target_group(layer.name) in hyper.targets
