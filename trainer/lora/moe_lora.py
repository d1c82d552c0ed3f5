"""Mixture-of-experts bases: LoRA slots on every routed expert, grouped by (expert, slot).

Each Megatron ``MoELayer`` of the frozen base is replaced by a ``MoeLoraLayer`` that
runs the same math (frozen router, top-k, SwiGLU experts, probability-weighted sum)
with one grouped GEMM per expert linear instead of megatron-core's per-expert loop,
and adds the LoRA delta of each routed token's own adapter slot:

    y(t, e) = W2_e act(W1_e x_t + d1) + d2,    d = scale(slot(t)) * B[slot(t), e] A[slot(t), e] x

Dispatch keeps the adapter id: every (token, expert) pair of the top-k gets the key
``expert * N + slot(token)`` (N = resident slots) and the pairs are sorted by it once
(stable, so token order is kept inside a group). Then
* the base GEMMs see one contiguous segment per expert (the union of its slot segments):
  one ``grouped_mm`` per expert linear (segmented_mm.py);
* the LoRA GEMMs see one contiguous segment per (expert, slot) group, G = E * N groups
  (group g = e * N + s), forward and backward, with no Python loop over adapters or
  experts. Only the slots from the first to the last one present in the micro-batch
  take part (N above is that span, as in fused_lora.py): one adapter's micro-batch among
  32 resident ones neither reads nor writes the other 31.

Two kernel sets run the LoRA GEMMs (expert_lora_nodes.py), chosen per micro-batch by
``lora_rank_kernels`` (``ExpertLoraPlan``): the segmented Triton kernels
(triton_expert_lora.py; ``auto`` on CUDA), one launch over every group, which at tensor
parallel 1 also add the delta into the expert GEMM's output in place (``ExpertLinearLora``);
or ``grouped_mm`` / the loop of ``lora_kernel`` (the CPU default, and the reference in
tests), on expert-major compute copies of the weights, the group range cut into chunks
of at most 1023 groups (grouped_mm's group-count limit: ``GroupLayout``).

The slot weights live slot-major (``lora_A [N, E, R, in]``, ``lora_B [N, E, out, R]``)
like every other LoRA tensor of the trainer, so a slot is one row of the slot buffers
(slot_buffers.py: norms, AdamW, zeroing are row operations). The Triton kernels read
them in place; the library path's expert-major compute copy is made when the weights
(or the span) change, not per micro-batch. Either way the gradients of the (expert,
slot) groups are added into the slot-major fp32 gradient in place.

Per adapter: ``SlotHyperParams.lora_experts`` (default true) chooses attention (and any
dense MLP) only, or attention and experts. An attention-only slot keeps exactly zero
expert weights (A and B start at zero and its expert scale is 0, so they never get a
gradient) and exports without expert parameters (PEFT format of expert LoRA: moe_peft.py).

Router and auxiliary losses: the router is frozen; aux / z losses are off for every
adapter (``moe_provider_overrides``). Parallelism: tensor parallel (experts split like
Megatron's expert tensor parallelism: fc1 column-, fc2 row-parallel, their LoRA split as in
multi_lora.py) and data parallel; one expert-parallel rank (every rank holds every
expert). Shared experts, where a model
has them, are dense MLPs whose linears get ordinary multi-slot LoRA (multi_lora.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.kernels import triton_expert_lora
from trainer.kernels import triton_lora
from trainer.platform.cpu_compat import transformer_engine_available
from trainer.lora.expert_lora_nodes import (
    ExpertLinearLora,
    ExpertLoraDelta,
    GroupLayout,
    LibraryExpertOps,
    TritonExpertOps,
)
from trainer.kernels.segmented_mm import grouped_operand, pick_kernel, segmented_matmul
from trainer.lora.awaits_step import AwaitsStep

EXPERT_TARGETS = ("linear_fc1", "linear_fc2")


def moe_provider_overrides() -> dict[str, Any]:
    """Provider fields for an MoE base, set before the model is built.

    * No auxiliary losses (load balancing, z-loss) and no input jitter: the router is
      frozen, so a load-balancing loss could only move the LoRA weights upstream of the
      router, and it is a statistic over *all* tokens of a micro-batch (expert load x
      mean router probability), which couples the adapters that share it: with it, an
      adapter would not get the gradient it gets alone. Off for every adapter.
    * Dropless (no capacity factor): with token dropping, whether a token is processed
      depends on the other tokens of the micro-batch (the same coupling).
    * No fused permutation without TransformerEngine (megatron-core refuses it).
    """
    out: dict[str, Any] = {
        "moe_aux_loss_coeff": 0.0,
        "moe_router_load_balancing_type": "none",
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_expert_capacity_factor": None,
        # The all-to-all dispatcher makes a CUDA stream when built; all-gather does not, and
        # with one expert-parallel rank both are a local permutation (MoeLoraLayer uses neither).
        "moe_token_dispatcher_type": "allgather",
    }
    if not transformer_engine_available():
        out["moe_permute_fusion"] = False
    return out


# -- the slot weights of one expert linear -----------------------------------------------------


class ExpertLoraWeights(AwaitsStep, nn.Module):
    """N slots of LoRA for one linear (fc1 or fc2) of every routed expert of a layer.

    ``lora_A [N, E, R, in]``, ``lora_B [N, E, out, R]``; slot i of rank r uses
    ``A[i, :, :r]`` and ``B[i, :, :, :r]`` (the rest stays exactly zero, as in
    multi_lora.py). Same slot-block and full-layout interface as ``MultiLoraLinear``
    (tensor parallel 1: the local layout is the full one)."""

    is_expert = True

    def __init__(self, *, name: str, kind: str, parallel: str, num_experts: int, in_local: int, out_local: int,
                 num_slots: int, max_rank: int, device: torch.device, tp_group=None) -> None:  # noqa: ANN001
        super().__init__()
        self.name = name  # e.g. decoder.layers.0.mlp.experts.linear_fc1
        self.kind = kind  # "gate_up" | "plain"
        self.parallel = parallel  # "column" (fc1: outputs split over TP) | "row" (fc2: inputs split)
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.num_experts = num_experts
        self.in_full = in_local * self.tp_size if parallel == "row" else in_local
        self.out_full = out_local * self.tp_size if parallel == "column" else out_local
        self.a_is_tp_split = parallel == "row" and self.tp_size > 1
        self.b_is_tp_split = parallel == "column" and self.tp_size > 1
        self.max_rank = max_rank
        self.lora_A = nn.Parameter(torch.zeros(num_slots, num_experts, max_rank, in_local, device=device))
        self.lora_B = nn.Parameter(torch.zeros(num_slots, num_experts, out_local, max_rank, device=device))
        self._compute_key: tuple | None = None
        self._compute: tuple[torch.Tensor, torch.Tensor] | None = None

    def compute_weights(self, dtype: torch.dtype, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [E*S, R, in], B [E*S, out, R]) of slots lo .. hi - 1 (S = hi - lo), expert-major, in
        ``dtype``; made again only when the weights or the span change (torch's version counter:
        every in-place update of the slot buffers bumps it, as for fused_lora.ComputeWeights)."""
        a, b = self.lora_A, self.lora_B
        key = (dtype, lo, hi, a.data_ptr(), a._version, b.data_ptr(), b._version)
        if key != self._compute_key:
            self._compute = (_expert_major(a.detach()[lo:hi]).to(dtype), _expert_major(b.detach()[lo:hi]).to(dtype))
            self._compute_key = key
        return self._compute

    def a_block(self, tensor: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
        return tensor[slot, :, :rank, :]

    def b_block(self, tensor: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
        return tensor[slot, :, :, :rank]

    def a_full_shape(self, rank: int) -> tuple[int, ...]:
        return (self.num_experts, rank, self.in_full)

    def b_full_shape(self, rank: int) -> tuple[int, ...]:
        return (self.num_experts, self.out_full, rank)

    # local shard <-> full (TP=1) layout, as MultiLoraLinear: A [E, r, in], B [E, out, r]

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return parts

    def full_a(self, local: torch.Tensor) -> torch.Tensor:
        """Collective over TP for row-parallel fc2; a fresh tensor."""
        if not self.a_is_tp_split:
            return local.clone()
        return self.assemble_a(self._gather(local))

    def full_b(self, local: torch.Tensor) -> torch.Tensor:
        """Collective over TP for column-parallel fc1; a fresh tensor."""
        if not self.b_is_tp_split:
            return local.clone()
        return self.assemble_b(self._gather(local))

    def assemble_a(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full A [E, r, in] from every TP rank's block, no collective (MultiLoraLinear.assemble_a)."""
        if not self.a_is_tp_split or len(shards) == 1:
            return shards[0]
        return torch.cat(shards, dim=-1)

    def assemble_b(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full B [E, out, r] (each rank holds [gate_shard; up_shard] of fc1)."""
        if not self.b_is_tp_split or len(shards) == 1:
            return shards[0]
        halves = [shard.chunk(2, dim=1) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)

    def local_a(self, full: torch.Tensor) -> torch.Tensor:
        if tuple(full.shape[:1]) + tuple(full.shape[2:]) != (self.num_experts, self.in_full):
            raise ValueError(f"{self.name}: lora_A {tuple(full.shape)}, expected [{self.num_experts}, r, {self.in_full}]")
        if self.parallel == "column" or self.tp_size == 1:
            return full
        return full.chunk(self.tp_size, dim=-1)[self.tp_rank]

    def local_b(self, full: torch.Tensor) -> torch.Tensor:
        if tuple(full.shape[:2]) != (self.num_experts, self.out_full):
            raise ValueError(f"{self.name}: lora_B {tuple(full.shape)}, expected [{self.num_experts}, {self.out_full}, r]")
        if self.parallel == "row" or self.tp_size == 1:
            return full
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(self.tp_size, dim=1)[self.tp_rank], up.chunk(self.tp_size, dim=1)[self.tp_rank]], dim=1)


def _expert_major(t: torch.Tensor) -> torch.Tensor:
    """[N, E, ...] slot-major -> [E * N, ...] expert-major (a fresh tensor)."""
    n, e = t.shape[:2]
    return t.transpose(0, 1).reshape(e * n, *t.shape[2:])


def is_expert_layer(layer: nn.Module) -> bool:
    return getattr(layer, "is_expert", False)


# -- the MoE layer ------------------------------------------------------------------------------


class MoeLoraLayer(nn.Module):
    """Replaces a Megatron ``MoELayer``: frozen router, grouped expert GEMMs, expert LoRA.

    Returns what MoELayer returns, ``(output [s, b, h], None)``. Megatron's own experts'
    weights are re-pointed into one stacked tensor per linear (no copy kept), so the
    model's parameters stay where Bridge put them."""

    def __init__(self, moe: nn.Module, *, name: str, routing, targets: tuple[str, ...],  # noqa: ANN001 - SlotRouting
                 num_slots: int, max_rank: int, device: torch.device) -> None:
        super().__init__()
        cfg = moe.config
        if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
            raise NotImplementedError(f"{name}: expert LoRA supports SwiGLU experts (gated silu) only")
        experts = moe.experts
        local = getattr(experts, "local_experts", None)
        if local is None:
            raise NotImplementedError(f"{name}: expected megatron-core's SequentialMLP experts, got {type(experts).__name__}")
        if experts.ep_group.size() > 1:
            raise NotImplementedError(f"{name}: expert LoRA needs one expert-parallel rank (experts replicated)")
        self.tp_group = experts.tp_group if experts.tp_group.size() > 1 else None  # expert tensor parallelism
        self.base = moe  # router (and shared experts) come from here
        self.name = name
        self.routing = routing
        self.num_slots = num_slots
        self.num_experts = len(local)
        w1 = torch.stack([m.linear_fc1.weight.detach() for m in local])  # [E, 2I, H]: rows [gate; up]
        w2 = torch.stack([m.linear_fc2.weight.detach() for m in local])  # [E, H, I]
        for e, m in enumerate(local):  # keep one copy: Megatron's params become views of the stacks
            m.linear_fc1.weight.data = w1[e]
            m.linear_fc2.weight.data = w2[e]
        self.register_buffer("w1", w1, persistent=False)
        self.register_buffer("w2", w2, persistent=False)
        self.slot_expert_scales: torch.Tensor | None = None  # [N] fp32, set by the trainer
        hidden, ffn2_local = w1.shape[2], w1.shape[1]  # fc1 outputs on this rank: [gate_shard; up_shard]
        self.fc1 = self.fc2 = None
        if "linear_fc1" in targets:
            self.fc1 = ExpertLoraWeights(name=f"{name}.experts.linear_fc1", kind="gate_up", parallel="column",
                                         num_experts=self.num_experts, in_local=hidden, out_local=ffn2_local,
                                         num_slots=num_slots, max_rank=max_rank, device=device, tp_group=self.tp_group)
        if "linear_fc2" in targets:
            self.fc2 = ExpertLoraWeights(name=f"{name}.experts.linear_fc2", kind="plain", parallel="row",
                                         num_experts=self.num_experts, in_local=w2.shape[2], out_local=hidden,
                                         num_slots=num_slots, max_rank=max_rank, device=device, tp_group=self.tp_group)

    def lora_weights(self) -> list[ExpertLoraWeights]:
        return [w for w in (self.fc1, self.fc2) if w is not None]

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):  # noqa: ANN001
        if intermediate_tensors is not None:
            raise NotImplementedError("MoeLoraLayer does not run partial (CUDA-graph) MoE forwards")
        for weights in self.lora_weights():  # the last optimizer step's rows (trainer/optim/step_overlap.py)
            weights.await_step()
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)  # token t = position * b + sample (Megatron's s-major order)
        probs, routing_map = self.base.router(hidden_states)  # [T, E] each; probs 0 where not routed
        tok, exp = routed_pairs(routing_map, self.base.router.topk)
        r = self.routing
        lora = r.enabled and bool(self.lora_weights())
        lo, n_slots = 0, 1  # the slots taking part: lo .. lo + n_slots - 1 (only those present)
        if lora:
            if (s, b) != (r.seq_len, r.batch):
                raise RuntimeError(f"{self.name}: activations [s={s}, b={b}] but routing was set for "
                                   f"s={r.seq_len}, b={r.batch}")
            lo, n_slots = r.span.lo, r.span.hi - r.span.lo
            slot_of_token = r.token_slots.view(b, s).t().reshape(-1)  # sample-major -> s-major
            pair_slot = slot_of_token[tok]
            key = exp * n_slots + (pair_slot - lo)
        else:
            key = exp
        order = torch.argsort(key, stable=True)
        rows = tok[order]
        group_counts = key_counts(key, self.num_experts * n_slots)
        expert_counts = group_counts.view(self.num_experts, n_slots).sum(1)
        xp = x[rows]  # [M, h] sorted by (expert, slot)
        # Expert TP: the input is replicated; the base's partial input gradients are summed over
        # TP (Megatron's copy-to-region), the LoRA's are complete on every rank (ExpertLoraDelta).
        xp_base = xp if self.tp_group is None else _tp_mappings().copy_to_tensor_model_parallel_region(
            x, group=self.tp_group)[rows]
        kernel = pick_kernel(r.kernel, xp, self.w1)
        if kernel == "grouped_mm" and pick_kernel(r.kernel, xp, self.w2) == "loop":
            kernel = "loop"
        # grouped_mm reads the device offsets only: no host copy of the counts (a sync per layer)
        e_counts = expert_counts.tolist() if kernel == "loop" else None
        e_offsets = torch.cumsum(expert_counts, 0).to(torch.int32)
        w1, w2 = self.w1.to(xp.dtype), self.w2.to(xp.dtype)
        plan = None
        if lora:
            plan = ExpertLoraPlan.of(r, xp, group_counts, self.slot_expert_scales[pair_slot[order]], lo, n_slots)
        # Triton at TP 1: each expert linear is one node, its delta added into the base GEMM's output
        fused = plan is not None and plan.path == "triton" and self.tp_group is None
        if fused and self.fc1 is not None:
            fc1 = plan.fused(self.fc1, xp, w1, e_offsets, e_counts, kernel)
        else:
            fc1 = segmented_matmul(xp_base, w1, e_offsets, e_counts, kernel)  # frozen base
            if plan is not None and self.fc1 is not None:
                fc1 = fc1 + plan.delta(self.fc1, xp)
        gate, up = fc1.chunk(2, dim=-1)
        act = F.silu(gate) * up
        if fused and self.fc2 is not None:
            y = plan.fused(self.fc2, act, w2, e_offsets, e_counts, kernel)
        else:
            y = segmented_matmul(act, w2, e_offsets, e_counts, kernel)
            if self.tp_group is not None:  # partial sums over the split expert width, per (token, expert) pair
                y = _tp_mappings().reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
            if plan is not None and self.fc2 is not None:
                y = y + plan.delta(self.fc2, act)
        y = y * probs[tok[order], exp[order]].to(y.dtype).unsqueeze(1)
        out = x.new_zeros(s * b, h).index_add(0, rows, y).view(s, b, h)
        if self.base.shared_experts is not None:
            out = out + self.base.shared_experts(hidden_states)
        return out, None


def routed_pairs(routing_map: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, expert) of every routed pair of ``routing_map`` [T, E] (bool): token-major, the
    experts of a token ascending; exactly ``routing_map.nonzero(as_tuple=True)``, without its
    host sync (nonzero must copy its count to the host to size its output).

    Invariant: every token is routed to exactly ``topk`` experts (Megatron's top-k router;
    dropless, no capacity factor: moe_provider_overrides), so there are T * topk pairs; checked
    on the device (``_assert_async``: a CUDA error at the next sync, no host wait). Each row's
    experts are placed by a permutation of its E columns: a routed expert at its rank among the
    routed ones (0 .. topk - 1), an unrouted one after them; the first topk columns are the
    routed experts in ascending order (one cumsum and one scatter: no sort of the row)."""
    t, e = routing_map.shape
    dev = routing_map.device
    routed_upto = routing_map.cumsum(1)  # [T, E]: routed experts among 0 .. j
    torch._assert_async((routed_upto[:, -1] == topk).all(), "MoE routing: a token not routed to exactly top-k experts")
    ids = torch.arange(e, device=dev)
    place = torch.where(routing_map, routed_upto - 1, topk + ids - routed_upto)  # a permutation of 0 .. E - 1
    exp = torch.empty(t, e, dtype=torch.int64, device=dev).scatter_(1, place, ids.expand(t, e))[:, :topk]
    tok = torch.arange(t * topk, device=dev) // topk
    return tok, exp.reshape(-1)


def key_counts(key: torch.Tensor, groups: int) -> torch.Tensor:
    """int64 [groups]: how many entries of ``key`` (values in 0 .. groups - 1) hold each value;
    ``torch.bincount`` without its host syncs (on CUDA it reads the key's min and max on the host).
    Integer atomics: the counts are exact and the same run to run."""
    return torch.zeros(groups, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))


@dataclass(frozen=True)
class ExpertLoraPlan:
    """The expert LoRA of one micro-batch in one MoE layer (shared by its fc1 and fc2): the
    kernel set (``triton``: triton_expert_lora.py, picked by ``lora_rank_kernels``; else
    ``library``: grouped_mm / the loop, ``lora_kernel``), the groups' rows, the slots
    lo .. hi - 1 and the per-pair scale (fp32 [M], and as a [M, 1] column in the compute dtype)."""

    path: str
    requested_kernel: str
    groups: GroupLayout | triton_expert_lora.GroupTiles
    lo: int
    hi: int
    scale: torch.Tensor
    row_scale: torch.Tensor

    @staticmethod
    def of(routing, xp: torch.Tensor, group_counts: torch.Tensor, scale: torch.Tensor, lo: int,  # noqa: ANN001
           n_slots: int) -> "ExpertLoraPlan":
        path = triton_lora.pick(routing.rank_kernels, xp, group_counts.numel())
        if path == "triton":  # tile tables made on the device: no host copy of the E * N counts
            groups = triton_expert_lora.GroupTiles.of(group_counts, xp.shape[0], n_slots)
        else:
            groups = GroupLayout.of(group_counts.tolist(), xp.device)
        return ExpertLoraPlan(path, routing.kernel, groups, lo, lo + n_slots, scale,
                              scale.to(xp.dtype).unsqueeze(1))

    def delta(self, w: ExpertLoraWeights, x: torch.Tensor) -> torch.Tensor:
        """The delta of ``w`` for the routed pairs ``x`` as its own node (any TP)."""
        if self.path == "triton":
            ops = TritonExpertOps(self.groups, w.lora_A, w.lora_B, self.lo)
        else:
            a_c, b_c = w.compute_weights(x.dtype, self.lo, self.hi)
            kernel = pick_kernel(self.requested_kernel, x, a_c)
            if kernel == "grouped_mm" and pick_kernel(self.requested_kernel, x, b_c) == "loop":
                kernel = "loop"
            if kernel == "grouped_mm":
                x = grouped_operand(x)
            ops = LibraryExpertOps(self.groups, kernel, a_c, b_c)
        return ExpertLoraDelta.apply(x, w.lora_A, w.lora_B, ops, self.row_scale, self.lo, w.parallel, w.tp_group)

    def fused(self, w: ExpertLoraWeights, x: torch.Tensor, weight: torch.Tensor, e_offsets: torch.Tensor,
              e_counts: list[int], kernel: str) -> torch.Tensor:
        """x W_e^T + the delta of ``w``, one node (Triton, TP 1: ExpertLinearLora)."""
        if kernel == "grouped_mm":
            x = grouped_operand(x)
        return ExpertLinearLora.apply(x, weight, e_offsets, e_counts, kernel, w.lora_A, w.lora_B, self.groups,
                                      self.scale, self.lo)


def _tp_mappings():
    from megatron.core.tensor_parallel import mappings

    return mappings


def install_moe_lora(
    base,  # noqa: ANN001 - FrozenBase
    *,
    target_modules: tuple[str, ...],
    num_slots: int,
    max_rank: int,
    routing,  # noqa: ANN001 - SlotRouting
) -> list[ExpertLoraWeights]:
    """Replace every MoE layer of ``base.model`` by a ``MoeLoraLayer``; return the expert
    LoRA weights (fc1 then fc2 per layer, model order). No MoE layer: nothing changes."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moes = [(n, m) for n, m in base.model.named_modules() if isinstance(m, MoELayer)]
    if not moes:
        return []
    targets = tuple(t for t in target_modules if t in EXPERT_TARGETS)
    out: list[ExpertLoraWeights] = []
    for name, moe in moes:
        layer = MoeLoraLayer(moe, name=name, routing=routing, targets=targets, num_slots=num_slots,
                             max_rank=max_rank, device=base.device)
        parent, _, child = name.rpartition(".")
        setattr(base.model.get_submodule(parent), child, layer)
        out.extend(layer.lora_weights())
    return out


def moe_layers(model: nn.Module) -> list[MoeLoraLayer]:
    return [m for m in model.modules() if isinstance(m, MoeLoraLayer)]


def kaiming_a(shape: tuple[int, ...], in_features: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's default LoRA A init (kaiming-uniform with a = sqrt(5): bound 1 / sqrt(in))."""
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(*shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound
