"""Multi-slot LoRA linears for a Megatron-core model.

Each targeted linear (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``) is wrapped by a ``MultiLoraLinear`` holding N resident slots in
two stacked fp32 parameters:

    lora_A [N, R, in_local]     lora_B [N, out_local, R]      (R = max rank)

Slot i of rank r uses ``A[i, :r]`` and ``B[i, :, :r]``; the rest of its rows and
columns are exactly zero. Zero rows of A give zero hidden units, whose B
columns then get zero gradient, and zero B columns give zero gradient to those
A rows, so padding stays exactly zero; the optimizer also touches only the
``[:r]`` blocks (per_slot_optim.py).

The delta for a micro-batch is ``scale(t) * B[g(t)] @ A[g(t)] @ x[t]`` where g(t) is
the slot of token t. Samples arrive sorted by slot, so in sample-major token
order every slot is one contiguous segment; ``SlotRouting`` (one object shared
by every layer, set by the trainer before each forward) holds the segment
offsets and per-token scales. Megatron's activations are [s, b, h]; the LoRA
branch works on the [b*s, h] sample-major view.

Tensor parallelism (A and B are split like the base weight they adapt):
* column-parallel base (qkv, fc1: output split): A replicated, B split on its
  output rows. h = A x is computed on every rank; its gradient is all-reduced
  over TP (``copy_to_tensor_model_parallel_region``) so dA and the LoRA part of
  dx are complete and identical on every rank.
* row-parallel base (proj, fc2: input split): A split on its input columns, B
  replicated. Partial h = A_local x_local is all-reduced over TP in forward
  (``reduce_from_tensor_model_parallel_region``).
Sequence parallelism is not supported (the trainer turns it off: base_model.py).

The fused node (fused_lora.py) takes a frozen Megatron linear at any TP size: at TP > 1 it
does the same communication itself, with the row-parallel base output and partial h summed
in ONE all-reduce (the module docstring there states the invariants).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer.kernels import triton_lora
from trainer.config import TARGET_GROUPS, is_target_module, target_group
from trainer.lora.fused_lora import ComputeWeights, FusedLoraLinear, SlotSpan, TensorParallel
from trainer.kernels.segmented_mm import grouped_operand, pick_kernel, segmented_matmul
from trainer.lora.awaits_step import AwaitsStep

FusedKind = Literal["qkv", "gate_up", "plain"]
UNEMBED_MODULE = "output_layer"  # GPTModel's output projection (the unembedding); its LoRA: trainer/lora/unembed_lora.py
ParallelMode = Literal["column", "row"]


class SlotScales:
    """Every slot's LoRA scale (alpha / r) per target group (config.TARGET_GROUPS: attention, mlp,
    unembed): ``table`` [G, N] fp32 on the device, read by the layers through the routing, and
    ``host``, the same numbers as lists (which slots train a group, known without a device sync).

    Invariant: a slot's scale in a group is 0 exactly when the slot is free or does not train that
    group; its LoRA weights there are then exactly zero too (trainer/lora/slots.py)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.table = torch.zeros(len(TARGET_GROUPS), num_slots, dtype=torch.float32, device=device)
        self.host = [[0.0] * num_slots for _ in TARGET_GROUPS]

    @classmethod
    def of(cls, scales: "SlotScales | torch.Tensor") -> "SlotScales":
        """``scales`` itself, or an [N] tensor as the same scale in every group."""
        if isinstance(scales, SlotScales):
            return scales
        out = cls(scales.shape[0], scales.device)
        out.table = scales.to(torch.float32).unsqueeze(0).expand(len(TARGET_GROUPS), -1).contiguous()
        out.host = [scales.tolist() for _ in TARGET_GROUPS]
        return out

    def set(self, slot: int, per_group: list[float]) -> None:
        """The slot's scale in each group, in TARGET_GROUPS order."""
        self.table[:, slot] = torch.tensor(per_group, dtype=torch.float32)
        for g, value in enumerate(per_group):
            self.host[g][slot] = float(value)


class SlotRouting:
    """Token -> slot assignment of the micro-batch being processed (shared by all layers).

    Invariant while enabled: samples are sorted by slot, so in sample-major order
    (token index = sample * seq_len + position) slot g owns tokens
    [offsets[g-1], offsets[g]).
    """

    def __init__(self, num_slots: int, kernel: Literal["auto", "grouped_mm", "loop"] = "auto", fused: bool = True,
                 rank_kernels: Literal["auto", "triton", "library"] = "auto",
                 lora_gemm: Literal["library", "cutlass", "auto"] = "library") -> None:
        self.num_slots = num_slots
        self.kernel = kernel
        self.fused = fused  # layers that can take FusedLoraLinear (fused_lora.py) do
        self.rank_kernels = rank_kernels  # the fused node's rank-R reductions (triton_lora.py)
        self.lora_gemm = lora_gemm  # the fused node's base GEMM with the LoRA term (kernels/cutlass_lora)
        self.enabled = False
        self.batch = 0
        self.seq_len = 0
        self.offsets: torch.Tensor | None = None  # int32 [N] cumulative segment ends
        self.counts: list[int] = []  # tokens per slot (host copy, for the loop kernel)
        self.token_scale: torch.Tensor | None = None  # fp32 [G, b*s]: each token's slot's scale per target group
        self.token_slots: torch.Tensor | None = None  # int64 [b*s]: each token's slot (MoE dispatch, moe_lora.py)
        self.scales: SlotScales | None = None  # the slots' scales this routing was set from (host flags)
        self._scale_columns: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # token_scale[g] as [b*s, 1]
        self._span: SlotSpan | None = None

    @property
    def span(self) -> SlotSpan:
        """The slots this micro-batch touches (made once per routing, not once per layer)."""
        if self._span is None:
            self._span = SlotSpan.of(self.offsets, self.counts)
        return self._span

    def scale_column(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """The per-token scales of target group ``group`` (an index into TARGET_GROUPS) as a
        [b*s, 1] column in ``dtype`` (made once per routing, not once per layer)."""
        col = self._scale_columns.get((dtype, group))
        if col is None:
            col = self._scale_columns[(dtype, group)] = self.token_scale[group].to(dtype).unsqueeze(1)
        return col

    def segments_training(self, group: int) -> list[tuple[int, int, int]]:
        """(slot, first token, end token) of every non-empty segment whose slot trains ``group``
        (scale != 0), in token order; host data only."""
        out, start = [], 0
        for slot, n in enumerate(self.counts):
            if n and self.scales.host[group][slot] != 0.0:
                out.append((slot, start, start + n))
            start += n
        return out

    def set(self, slot_of_sample: torch.Tensor, seq_len: int, slot_scales: SlotScales | torch.Tensor) -> None:
        """Route a micro-batch: ``slot_of_sample`` [b] (non-decreasing), ``slot_scales`` the slots'
        scales (or one [N] fp32 tensor: the same scale in every target group)."""
        slot_scales = SlotScales.of(slot_scales)
        slots = slot_of_sample.tolist()
        if any(a > b for a, b in zip(slots, slots[1:])):
            raise ValueError(f"samples must be sorted by slot, got slot order {slots}")
        if slots and not (0 <= slots[0] and slots[-1] < self.num_slots):
            raise ValueError(f"slot ids {slots} outside 0..{self.num_slots - 1}")
        per_slot = torch.bincount(slot_of_sample.cpu(), minlength=self.num_slots) * seq_len
        self.counts = per_slot.tolist()
        device = slot_scales.table.device
        self.offsets = torch.cumsum(per_slot, 0).to(torch.int32).to(device)
        self.token_slots = slot_of_sample.to(device).repeat_interleave(seq_len)
        self.token_scale = slot_scales.table[:, self.token_slots]
        self.scales = slot_scales
        self._scale_columns = {}
        self._span = None
        self.batch = len(slots)
        self.seq_len = seq_len
        self.enabled = True

    def set_packed(self, packed, slot_scales: SlotScales | torch.Tensor) -> None:  # noqa: ANN001 - trainer.base.packing.PackedBatch
        """Route one packed stream (Megatron ``thd``: activations [T, 1, h], so b = 1, s = T).

        Packing orders sequences by slot, so each slot's tokens are one contiguous
        segment of the stream; its segment ends (``slot_offsets``) are the offsets as they
        are, and every token takes its slot's scale.
        """
        if packed.num_slots != self.num_slots:
            raise ValueError(f"stream packed for {packed.num_slots} slots, routing has {self.num_slots}")
        slot_scales = SlotScales.of(slot_scales)
        slots = list(packed.sample_slots)
        if any(a > b for a, b in zip(slots, slots[1:])):
            raise ValueError(f"packed sequences must be sorted by slot, got slot order {slots}")
        self.counts = packed.slot_token_counts.tolist()
        device = slot_scales.table.device
        self.offsets = packed.slot_offsets.to(device)
        self.token_slots = packed.token_slots.to(device)
        self.token_scale = slot_scales.table[:, self.token_slots]
        self.scales = slot_scales
        self._scale_columns = {}
        self._span = None
        self.batch = 1
        self.seq_len = packed.num_tokens
        self.enabled = True

    def disable(self) -> None:
        """LoRA off: every layer returns the base output (reference policy, frozen base)."""
        self.enabled = False
        self.offsets = self.token_scale = self.token_slots = self.scales = None
        self.counts = []
        self._scale_columns = {}
        self._span = None


class MultiLoraLinear(AwaitsStep, nn.Module):
    """A Megatron linear plus N stacked LoRA slots. Returns what the base returns."""

    def __init__(
        self,
        base: nn.Module,
        *,
        name: str,
        kind: FusedKind,
        parallel: ParallelMode,
        num_slots: int,
        max_rank: int,
        routing: SlotRouting,
        tp_group,  # noqa: ANN001 - torch ProcessGroup
        device: torch.device,
        weight_shape: tuple[int, int] | None = None,
    ) -> None:
        """``weight_shape``: the base weight's local [out, in] where the base holds none of its own
        (the output layer of tied embeddings); default ``base.weight.shape``."""
        super().__init__()
        self.base = base
        self.name = name
        # Which of the slot's scales applies here: the target group of the module's name; a bare
        # linear outside a model (unit tests, benchmarks: routed with one [N] scale for every
        # group) reads the first row.
        self.group = TARGET_GROUPS.index(target_group(name)) if is_target_module(name) else 0
        self.kind = kind
        self.parallel = parallel
        self.routing = routing
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        out_local, in_local = weight_shape if weight_shape is not None else base.weight.shape
        self.in_local, self.out_local = in_local, out_local
        self.in_full = in_local * self.tp_size if parallel == "row" else in_local
        self.out_full = out_local * self.tp_size if parallel == "column" else out_local
        self.max_rank = max_rank
        self.lora_A = nn.Parameter(torch.zeros(num_slots, max_rank, in_local, device=device))
        self.lora_B = nn.Parameter(torch.zeros(num_slots, out_local, max_rank, device=device))
        # Which of A/B is split over TP (the other is replicated): grad-norm bookkeeping.
        self.a_is_tp_split = parallel == "row"
        self.b_is_tp_split = parallel == "column"
        self._compute = ComputeWeights()
        # FusedLoraLinear computes x @ W.T and the linear's TP communication itself, so only for
        # a plain Megatron linear without bias whose communication it knows (fused_tp_refusal;
        # TE's fused layernorm-linear keeps the general path).
        self.fusable = (
            type(base).__name__ in ("ColumnParallelLinear", "RowParallelLinear")
            and getattr(base, "bias", None) is None
            and not hasattr(base, "return_layernorm_output")
            and fused_tp_refusal(base, parallel, self.tp_size) is None
        )
        self._fused_tp = TensorParallel(parallel, tp_group) if self.tp_size > 1 else None
        if hasattr(base, "return_layernorm_output"):
            # TransformerEngine's fused LayerNorm+linear: LoRA must see the normed input.
            base.return_layernorm_output = True
            if hasattr(base, "return_layernorm_output_gathered"):
                base.return_layernorm_output_gathered = True

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *args, **kwargs):
        self.await_step()
        r = self.routing
        if r.enabled and r.fused and self.fusable and not args and not kwargs and x.shape[1] == 1 \
                and not self.base.weight.requires_grad:
            return self._fused_forward(x), None
        out = self.base(x, *args, **kwargs)
        if not self.routing.enabled:
            return _strip_layernorm_output(out)
        linear_out, bias, lora_in = _split_base_output(out, x)
        return linear_out + self._delta(lora_in), bias

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base GEMM + delta in one node, for one packed stream x [T, 1, in] (fused_lora.py)."""
        r = self.routing
        if x.shape[0] != r.seq_len or r.batch != 1:
            raise RuntimeError(f"{self.name}: activations [s={x.shape[0]}, b=1] but routing was set for "
                               f"s={r.seq_len}, b={r.batch}")
        a_c, b_c = self._compute.get(self.lora_A, self.lora_B, x.dtype)
        x_tok = x.reshape(x.shape[0], x.shape[-1])
        kernel = pick_kernel(r.kernel, x_tok, a_c)
        if kernel == "grouped_mm" and pick_kernel(r.kernel, x_tok, b_c) == "loop":
            kernel = "loop"  # one kernel for all GEMMs of the node
        if kernel == "grouped_mm":
            x_tok = grouped_operand(x_tok)
        y = FusedLoraLinear.apply(x_tok, self.base.weight, self.lora_A, self.lora_B, a_c, b_c, r.span,
                                  r.scale_column(x.dtype, self.group), kernel,
                                  triton_lora.pick(r.rank_kernels, x_tok, r.span.segments), self._fused_tp,
                                  r.lora_gemm)
        return y.view(x.shape[0], 1, -1)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        r = self.routing
        s, b = x.shape[0], x.shape[1]
        if (s, b) != (r.seq_len, r.batch):
            raise RuntimeError(f"{self.name}: activations [s={s}, b={b}] but routing was set for s={r.seq_len}, b={r.batch}")
        x_tok = x.transpose(0, 1).reshape(b * s, x.shape[-1])  # sample-major tokens
        kernel = pick_kernel(r.kernel, x_tok, self.lora_A)
        h = segmented_matmul(x_tok, self.lora_A, r.offsets, r.counts, kernel)
        if self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import (
                copy_to_tensor_model_parallel_region,
                reduce_from_tensor_model_parallel_region,
            )

            if self.parallel == "column":  # backward: all-reduce dh (B is split on outputs)
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            else:  # forward: sum the partial h of the split inputs
                h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        h = h * r.scale_column(h.dtype, self.group)
        kernel_b = pick_kernel(r.kernel, h, self.lora_B)
        y = segmented_matmul(h, self.lora_B, r.offsets, r.counts, kernel_b)
        return y.view(b, s, -1).transpose(0, 1)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    # -- slot blocks in this rank's layout ----------------------------------------------------

    def a_block(self, tensor: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
        """View of slot's live A block in ``tensor`` (lora_A, its grad or a moment)."""
        return tensor[slot, :rank, :]

    def b_block(self, tensor: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
        return tensor[slot, :, :rank]

    def a_full_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of a slot's full (TP=1) A of this rank (checkpoints, init)."""
        return (rank, self.in_full)

    def b_full_shape(self, rank: int) -> tuple[int, ...]:
        return (self.out_full, rank)

    # -- local shard <-> full (TP=1 Megatron layout) --------------------------------------------

    def _gather(self, local: torch.Tensor, dim: int) -> list[torch.Tensor]:
        if self.tp_size == 1:
            return [local]
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return parts

    def full_a(self, local: torch.Tensor) -> torch.Tensor:
        """[r, in_local] on this rank -> [r, in_full] (collective over TP for row-parallel); a fresh tensor."""
        if self.parallel == "column" or self.tp_size == 1:
            return local.clone()
        return self.assemble_a(self._gather(local, 1))

    def full_b(self, local: torch.Tensor) -> torch.Tensor:
        """[out_local, r] on this rank -> [out_full, r] (collective over TP for column-parallel); a fresh tensor."""
        if self.parallel == "row" or self.tp_size == 1:
            return local.clone()
        return self.assemble_b(self._gather(local, 0))

    def assemble_a(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full A from every TP rank's block (in rank order; a replicated A: one block, returned
        as is). No collective: a publish writer assembles a snapshot's host copy with it."""
        if not self.a_is_tp_split or len(shards) == 1:
            return shards[0]
        return torch.cat(shards, dim=1)

    def assemble_b(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full B from every TP rank's block (see assemble_a)."""
        if not self.b_is_tp_split or len(shards) == 1:
            return shards[0]
        if self.kind == "gate_up":
            # Each rank holds [gate_shard; up_shard]; the full layout is [gate; up].
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=0)

    def local_a(self, full: torch.Tensor) -> torch.Tensor:
        if full.shape[1] != self.in_full:
            raise ValueError(f"{self.name}: lora_A has {full.shape[1]} input features, expected {self.in_full}")
        if self.parallel == "column":
            return full
        return full.chunk(self.tp_size, dim=1)[self.tp_rank]

    def local_b(self, full: torch.Tensor) -> torch.Tensor:
        if full.shape[0] != self.out_full:
            raise ValueError(f"{self.name}: lora_B has {full.shape[0]} output features, expected {self.out_full}")
        if self.parallel == "row":
            return full
        if self.kind == "gate_up":
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(self.tp_size)[self.tp_rank], up.chunk(self.tp_size)[self.tp_rank]], dim=0)
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]


def fused_tp_refusal(base: nn.Module, parallel: ParallelMode, tp_size: int) -> str | None:
    """Why the fused node cannot stand in for Megatron linear ``base`` under tensor parallelism
    (None where it can). The node does the communication of a column-parallel linear with
    replicated input and split output (the input-gradient all-reduce) and of a row-parallel
    one with split input and all-reduced output (fused_lora.py); any other arrangement
    (sequence parallelism, gathered output, expert or disabled communication) keeps the
    general path, which runs Megatron's own linear."""
    if tp_size == 1:
        return None
    if getattr(base, "sequence_parallel", False):
        return "sequence parallelism"
    if getattr(base, "explicit_expert_comm", False):
        return "explicit expert communication"
    if parallel == "column":
        if getattr(base, "gather_output", False):
            return "gathered output"
        if getattr(base, "disable_grad_reduce", False):
            return "input-gradient reduce disabled"
    elif not getattr(base, "input_is_parallel", False):
        return "row-parallel input not split"
    return None


def _split_base_output(out, x):
    """(linear_out, bias, layernorm_out) from the patterns Megatron/TE linears return."""
    if not isinstance(out, tuple):
        raise TypeError(f"expected the wrapped linear to return a tuple, got {type(out).__name__}")
    if len(out) == 3:
        return out
    linear_out, bias = out
    if isinstance(linear_out, tuple):  # TE: ((out, ln_out), bias)
        return linear_out[0], bias, linear_out[1]
    return linear_out, bias, x


def _strip_layernorm_output(out):
    linear_out, bias, _ = _split_base_output(out, None)
    return linear_out, bias


def _parallel_mode(module: nn.Module) -> ParallelMode | None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)  # TransformerEngine linears
    return mode if mode in ("column", "row") else None


def fused_kind(hf_mapping) -> FusedKind:  # noqa: ANN001 - Bridge MegatronParamMapping
    hf = hf_mapping.hf_param
    if isinstance(hf, str):
        return "plain"
    if set(hf) == {"q", "k", "v"}:
        return "qkv"
    if set(hf) == {"gate", "up"}:
        return "gate_up"
    raise ValueError(f"unsupported fused projection {sorted(hf)} (supported: q/k/v, gate/up, single)")


def install_multi_lora(
    base,  # noqa: ANN001 - FrozenBase
    *,
    target_modules: tuple[str, ...],
    num_slots: int,
    max_rank: int,
    routing: SlotRouting,
    tp_group,  # noqa: ANN001
) -> list[MultiLoraLinear]:
    """Wrap every targeted linear of ``base.model`` in place; return the wrappers in model order."""
    targets: list[tuple[str, nn.Module]] = [
        (name, module)
        for name, module in base.model.named_modules()
        if name.rsplit(".", 1)[-1] in target_modules and not isinstance(module, MultiLoraLinear)
        and ".experts.local_experts." not in name  # routed experts: grouped expert LoRA (moe_lora.py)
        and name != UNEMBED_MODULE  # the unembedding: trainer/lora/unembed_lora.py
    ]
    if not targets and UNEMBED_MODULE not in target_modules:
        raise ValueError(f"no module of the model matches target_modules {list(target_modules)}")
    layers = []
    for name, module in targets:
        mode = _parallel_mode(module)
        if mode is None:
            raise TypeError(f"{name} is a {type(module).__name__}, not a column- or row-parallel linear")
        mapping = base.hf_mapping(f"{name}.weight")
        if mapping is None:
            raise ValueError(f"Megatron-Bridge has no Hugging Face mapping for {name}.weight")
        wrapper = MultiLoraLinear(
            module,
            name=name,
            kind=fused_kind(mapping),
            parallel=mode,
            num_slots=num_slots,
            max_rank=max_rank,
            routing=routing,
            tp_group=tp_group,
            device=base.device,
        )
        parent_name, _, child = name.rpartition(".")
        setattr(base.model.get_submodule(parent_name), child, wrapper)
        layers.append(wrapper)
    return layers
