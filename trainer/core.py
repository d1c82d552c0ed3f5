"""MultiLoraTrainer: N resident LoRA slots on one frozen Megatron base (no Ray here).

One process per device (tp * dp processes in all; see distributed.py). The
public methods are collective: every rank of the trainer calls them with the
same arguments (the Ray actor group does that), and rank 0 writes files.

Invariants:
* A slot's weights, gradients and optimizer moments live in its own slice of
  the stacked tensors; every operation on slot i touches only slot i's slices
  (isolation), and only the live ``[:rank]`` blocks get updated.
* The backward pass sums per-sample loss numerators of all slots; the base is
  frozen and samples never interact, so slot i's gradient is exactly the sum
  over its own samples. Per-slot normalization, clipping and AdamW run on that
  gradient alone when the slot's ``samples_per_step`` samples have all been
  accumulated (possibly across micro-batches and train calls).
* A non-finite gradient or loss in one slot skips that slot's step (its
  accumulated batch is discarded) and is reported; other slots are unaffected.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from pydantic import BaseModel

from trainer.base_model import (
    attention_mask,
    build_frozen_base,
    packed_token_logprobs,
    token_logprobs,
    trainer_layer_spec,
)
from trainer.batch import PlannedSample, TrainBatch, TrainSample, assign_phases, dp_shard, pack_micro_batches
from trainer.config import SlotHyperParams, TrainerConfig
from trainer.distributed import dp_group, init_parallel, tp_group
from trainer.export_writer import ExportLayout, ExportWriter, PeftSnapshot, export_dtype, pinned_host_copy, replace_folder_atomically
from trainer.losses import TokenLossInputs, sample_loss_numerators
from trainer.moe_lora import install_moe_lora, is_expert_layer, kaiming_a, moe_layers
from trainer.moe_peft import expert_peft_tensors, expert_target_parameters, read_expert_peft
from trainer.multi_lora import SlotRouting, install_multi_lora
from trainer.packing import pack_sequences, split_by_token_budget
from trainer.peft_io import (
    hf_short_names,
    json_target_parameters,
    peft_config_dict,
    read_peft_folder,
    slot_to_hf,
    write_peft_folder_packed,
)
from trainer.per_slot_optim import AdamwColumns, adamw_apply, clip_coefficient, lr_at
from trainer.safetensors_stream import file_order
from trainer.slot_buffers import SlotBuffers
from trainer.slot_checkpoint import load_slot_checkpoint, save_slot_checkpoint
from trainer.slot_swap import SlotSnapshot, SwapError, SwapStore, copy_rows_in, copy_rows_out, timed

# Columns of the per-slot statistics accumulators.
NUM, SAMPLES, TOKENS, CLIPPED, RATIO, KL, RL_TOKENS = range(7)
N_STATS = 7


@dataclass
class SlotState:
    hyper: SlotHyperParams
    rank: int  # live rows of A / columns of B (hyper.rank, or more for a stacked PEFT import)
    scale: float  # alpha / r
    seed: int
    registration: str | None
    step: int = 0  # optimizer updates taken (the schedule's position)
    pending_samples: int = 0  # samples accumulated toward the next step (global over DP)
    pending: torch.Tensor = field(default_factory=lambda: torch.zeros(N_STATS, dtype=torch.float64))  # local stats


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


@dataclass
class RiderSequence:
    """A tenant-driven sequence that rides in a train call beside the loop's samples (the
    Tinker API's datums, trainer/tinker_ops.py), in the same packed micro-batches.

    It brings its own per-position targets and loss; its gradient ACCUMULATES in its slot's
    gradient rows. Its slot must not be trained by the call's batch, and it never steps in
    the call: no statistics, no normalization, no optimizer (the tenant's optim_step does)."""

    slot: int
    tokens: list[int]
    targets: list[int]  # targets[t]: the token position t predicts (one per token)
    loss: Callable[[torch.Tensor], torch.Tensor]  # its [len(tokens)] log-probs (differentiable) -> scalar


class MultiLoraTrainer:
    def __init__(self, config: TrainerConfig, *, rank: int = 0, master_addr: str = "127.0.0.1", master_port: int | None = None):
        self.config = config
        self.layout = init_parallel(tp=config.tp, dp=config.dp, rank=rank, master_addr=master_addr, master_port=master_port, seed=config.seed)
        self.base = build_frozen_base(
            config.base_model_path, tp=config.tp, dtype=config.dtype, layer_spec=trainer_layer_spec(config.layer_spec),
            random_init=config.random_init, seed=config.seed, recompute=config.recompute,
        )
        self.device = self.base.device
        self.routing = SlotRouting(config.num_slots, kernel=config.lora_kernel, fused=config.fused_lora,
                                   rank_kernels=config.lora_rank_kernels)
        self.layers = install_multi_lora(
            self.base, target_modules=config.target_modules, num_slots=config.num_slots,
            max_rank=config.max_rank, routing=self.routing, tp_group=tp_group() if config.tp > 1 else None,
        )
        # MoE bases: every routed expert's fc1/fc2 gets slots too, grouped by (expert, slot)
        # (moe_lora.py); a slot's expert scale is 0 when its adapter trains attention only.
        self.layers += install_moe_lora(
            self.base, target_modules=config.target_modules, num_slots=config.num_slots,
            max_rank=config.max_rank, routing=self.routing,
        )
        self.expert_scales = torch.zeros(config.num_slots, dtype=torch.float32, device=self.device)
        for moe in moe_layers(self.base.model):
            moe.slot_expert_scales = self.expert_scales
        # Weights, gradients and Adam moments of all slots: rows of four slot-major buffers,
        # every layer's tensors views into them (slot_buffers.py). Lists in layer order.
        self.buffers = SlotBuffers(self.layers, config.num_slots, self.device)
        self.params = self.buffers.params
        self.exp_avg = self.buffers.exp_avg_views
        self.exp_avg_sq = self.buffers.exp_avg_sq_views
        self.scales = torch.zeros(config.num_slots, dtype=torch.float32, device=self.device)
        self.slots: list[SlotState | None] = [None] * config.num_slots
        self.vocab_size: int = self.base.model.vocab_size
        budget = config.swap_host_budget_mb
        self.swap = SwapStore(None if budget is None else int(budget * 2**20), config.swap_spill_dir, rank=self.layout.rank)
        self._export_writer: ExportWriter | None = None  # rank 0's background writer (export_peft_in_background)
        self._export_writer_lock = threading.Lock()  # the writer is made by whichever thread asks first
        self._copy_stream = None  # CUDA stream of the snapshots' device->host copies (snapshot_peft)
        self._export_layouts: dict[tuple[int, bool], ExportLayout] = {}  # export_layout's cache

    # -- slot blocks ------------------------------------------------------------------------

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.config.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.config.num_slots - 1}")

    def _state(self, slot: int) -> SlotState:
        self._check_slot(slot)
        state = self.slots[slot]
        if state is None:
            raise ValueError(f"slot {slot} is not initialized")
        return state

    # -- lifecycle ----------------------------------------------------------------------------

    @torch.no_grad()
    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | Path | None = None, registration: str | None = None) -> dict:
        """A random (seeded, PEFT's kaiming-uniform), B zero; or the weights of a PEFT folder."""
        self._check_slot(slot)
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use; clear it before initializing it again")
        if hyper.rank > self.config.max_rank:
            raise ValueError(f"rank {hyper.rank} exceeds the trainer's max_rank {self.config.max_rank}")
        g = torch.Generator().manual_seed(seed)
        # None: the block stays as _write_slot's zeroing leaves it (B, and an attention-only
        # adapter's expert A), so no host tensor is built or copied for it (at the 8B shape the
        # B blocks alone are 22 M zeros per slot).
        a_full: dict[str, torch.Tensor | None] = {}
        b_full: dict[str, torch.Tensor | None] = {}
        for layer in self.layers:  # the full (TP=1) A, so every TP layout gets the same init
            if is_expert_layer(layer) and not hyper.lora_experts:
                a_full[layer.name] = None  # attention-only adapter: experts stay exactly zero
            else:
                a_full[layer.name] = kaiming_a(layer.a_full_shape(hyper.rank), layer.in_full, g)
            b_full[layer.name] = None
        rank, scale = hyper.rank, hyper.scale
        if init_from is not None:
            if json_target_parameters(init_from) and not self._expert_layers():
                raise ValueError(f"init_from {init_from}: the adapter has expert LoRA (target_parameters) but "
                                 "this base has no expert layers with LoRA")
            expert_a, expert_b, expert_modules = read_expert_peft(init_from, self.base, self._expert_layers(), hyper)
            peft_cfg, imported = read_peft_folder(init_from, self.base, self._dense_layers(), expert_modules)
            if int(peft_cfg["r"]) != hyper.rank or not math.isclose(float(peft_cfg["lora_alpha"]), hyper.alpha):
                raise ValueError(
                    f"init_from adapter has r={peft_cfg['r']}, lora_alpha={peft_cfg['lora_alpha']}; "
                    f"the slot's hyper-parameters say rank={hyper.rank}, alpha={hyper.alpha}: make them equal"
                )
            if imported.rank > self.config.max_rank:
                raise ValueError(
                    f"init_from adapter needs rank {imported.rank} in the slot (different lora_A per fused "
                    f"projection are stacked), above max_rank {self.config.max_rank}"
                )
            rank = imported.rank
            a_full.update(imported.a_full | expert_a)
            b_full.update(imported.b_full | expert_b)
        self._write_slot(slot, rank, a_full, b_full)
        self.slots[slot] = SlotState(hyper=hyper, rank=rank, scale=scale, seed=seed, registration=registration)
        self._set_scales(slot, scale, hyper)
        return self.slot_status(slot)

    def _set_scales(self, slot: int, scale: float, hyper: SlotHyperParams | None) -> None:
        self.scales[slot] = scale
        self.expert_scales[slot] = scale if hyper is not None and hyper.lora_experts else 0.0

    def _dense_layers(self) -> list:
        return [layer for layer in self.layers if not is_expert_layer(layer)]

    def _expert_layers(self) -> list:
        return [layer for layer in self.layers if is_expert_layer(layer)]

    def _write_slot(self, slot: int, rank: int, a_full: dict, b_full: dict) -> None:
        """Zero the slot everywhere, then place full-layout weights (padded to ``rank``) into its
        blocks; a None weight leaves its block zero."""
        self._zero_slot(slot)
        for layer in self.layers:
            a, b = a_full[layer.name], b_full[layer.name]
            # rank is A's second-to-last dim and B's last (dense [r, in] / [out, r], experts [E, r, in] / [E, out, r])
            if a is not None:
                if a.shape[-2] < rank:
                    a = torch.cat([a, a.new_zeros(*a.shape[:-2], rank - a.shape[-2], a.shape[-1])], dim=-2)
                layer.a_block(layer.lora_A.data, slot, rank).copy_(layer.local_a(a).to(self.device))
            if b is not None:
                if b.shape[-1] < rank:
                    b = torch.cat([b, b.new_zeros(*b.shape[:-1], rank - b.shape[-1])], dim=-1)
                layer.b_block(layer.lora_B.data, slot, rank).copy_(layer.local_b(b).to(self.device))

    @torch.no_grad()
    def _zero_slot(self, slot: int) -> None:
        self.buffers.zero_slot(slot)

    def clear_slot(self, slot: int) -> None:
        """Weights, gradients, optimizer state and pending samples of the slot, all gone."""
        self._check_slot(slot)
        self._zero_slot(slot)
        self._set_scales(slot, 0.0, None)
        self.slots[slot] = None

    def slot_status(self, slot: int) -> dict:
        self._check_slot(slot)
        s = self.slots[slot]
        if s is None:
            return {"slot": slot, "active": False}
        return {"slot": slot, "active": True, "rank": s.rank, "scale": s.scale, "step": s.step,
                "pending_samples": s.pending_samples, "registration": s.registration}

    # -- export --------------------------------------------------------------------------------

    @torch.no_grad()
    def _full_slot_tensors(self, slot: int, tensors: list[torch.Tensor], rank: int) -> tuple[dict, dict]:
        """Gathered (TP=1 layout) A/B blocks of ``tensors`` for this slot, fp32 on the host.
        Collective over TP."""
        a_full, b_full = {}, {}
        for layer, a, b in zip(self.layers, tensors[0::2], tensors[1::2]):
            a_full[layer.name] = layer.full_a(layer.a_block(a, slot, rank)).float().cpu()
            b_full[layer.name] = layer.full_b(layer.b_block(b, slot, rank)).float().cpu()
        return a_full, b_full

    @torch.no_grad()
    def snapshot_peft(self, slot: int, *, to_host: bool = True, dtype: str = "float32") -> PeftSnapshot:
        """The slot's weights as they are now, as the data of its PEFT safetensors file, in
        ``dtype`` (an EXPORT_DTYPES name: a publish folder in the engines' dtype): the in-order
        half of an export. Collective over TP.

        The whole slot is one row of the slot buffers (slot_buffers.py). The snapshot casts that
        row, under TP all-gathers its TP-split columns, and gathers it by the export layout's
        index (export_layout) into the file's data: every PEFT tensor back to back in file order,
        q/k/v split and permuted, experts in PEFT's layout. That is three or four kernels per
        adapter whatever the number of layers, and a fresh tensor (a gather), never a view of the
        live weights, so a later step cannot change it. On CUDA it then goes to pinned host memory
        by one non-blocking copy on a copy stream of its own, behind one event
        (`PeftSnapshot.ready` waits for it): no synchronization on this thread, and the copy
        overlaps the next train call. The writer thread only adds the header and writes the data
        in one call. ``to_host=False``: a rank that writes nothing takes part in the gather only."""
        state = self._state(slot)
        to = export_dtype(dtype)
        row = self.buffers.weight[slot].to(to)
        tp, split = self.layout.tp_size, self.buffers.split_cols
        if tp > 1:
            gathered = torch.empty(tp, split, dtype=to, device=self.device)
            dist.all_gather(list(gathered), row[:split].contiguous(), group=tp_group())
        if not to_host:  # this rank's part was the gather
            return PeftSnapshot(config={}, entries=[], body=None)
        if tp > 1:
            row = torch.cat([gathered.view(-1), row[split:]])
        layout = self.export_layout(state.rank, state.hyper.lora_experts)
        cfg = peft_config_dict(rank=state.rank, scale=state.scale, target_modules=layout.target_modules,
                               base_model=self.config.base_model_path, target_parameters=layout.target_parameters)
        body = row.index_select(0, layout.index)
        copied = None
        if self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            body, copied = pinned_host_copy(body, self._copy_stream)
        return PeftSnapshot(config=cfg, entries=layout.entries, body=body, header=layout.header(to), copied=copied)

    def export_layout(self, rank: int, lora_experts: bool) -> ExportLayout:
        """Where each element of a PEFT file's data comes from in a snapshot's row (the row cast,
        TP-split columns of every TP rank first, then the replicated ones), for slots of LoRA rank
        ``rank``. Built by taking apart a row of positions (0, 1, 2, ...) instead of weights with
        the same functions the weights would go through (row_views, assemble_a/b, slot_to_hf,
        expert_peft_tensors): the layout is by construction the one they define, and a gather by
        it does all their copies and permutations in one kernel. With it, the PEFT config's module
        lists (Bridge's name mappings: about 0.2 ms per layer, so worth computing once). Cached
        per (rank, experts)."""
        key = (rank, lora_experts)
        layout = self._export_layouts.get(key)
        if layout is None:
            tp, split = self.layout.tp_size, self.buffers.split_cols
            positions = torch.arange(tp * split + self.buffers.weight.shape[1] - split, dtype=torch.int64)
            tensors = self._peft_from_row(positions, tp, rank, lora_experts)
            names = file_order({k: (torch.float32, t.shape) for k, t in tensors.items()})  # one dtype: by name
            index = torch.cat([tensors[k].reshape(-1) for k in names])
            small = index.numel() < 2**31 and positions.numel() < 2**31  # int32 indices: half the memory
            layout = ExportLayout(entries=[(k, tuple(tensors[k].shape)) for k in names],
                                  index=index.to(torch.int32 if small else torch.int64).to(self.device),
                                  target_modules=hf_short_names(self.base, self._dense_layers()),
                                  target_parameters=expert_target_parameters(self._expert_layers() if lora_experts else []))
            if len(self._export_layouts) >= 8:  # a few distinct ranks in practice; bound the device memory anyway
                self._export_layouts.pop(next(iter(self._export_layouts)))
            self._export_layouts[key] = layout
        return layout

    def _peft_from_row(self, row: torch.Tensor, tp: int, rank: int, lora_experts: bool) -> dict[str, torch.Tensor]:
        """PEFT-named TP=1 tensors of a slot's row (TP-split columns of each TP rank in rank order,
        then the replicated): views where the layout allows, else copies. No collective."""
        split = self.buffers.split_cols
        blocks = self.buffers.row_views(list(row[: tp * split].view(tp, split)), row[tp * split :])
        a_full, b_full = {}, {}
        for layer, a_shards, b_shards in zip(self.layers, blocks[0::2], blocks[1::2]):
            a_full[layer.name] = layer.assemble_a([layer.a_block(x.unsqueeze(0), 0, rank) for x in a_shards])
            b_full[layer.name] = layer.assemble_b([layer.b_block(x.unsqueeze(0), 0, rank) for x in b_shards])
        experts = self._expert_layers() if lora_experts else []
        return slot_to_hf(self.base, self._dense_layers(), a_full, b_full) | expert_peft_tensors(self.base, experts, a_full, b_full)

    def peft_from_snapshot(self, snap: PeftSnapshot) -> tuple[dict, dict[str, torch.Tensor]]:
        """(adapter_config dict, PEFT-named tensors in the snapshot's dtype): views of its data."""
        snap.ready()
        tensors, offset = {}, 0
        for name, shape in snap.entries:
            n = math.prod(shape)
            tensors[name] = snap.body[offset : offset + n].view(shape)
            offset += n
        return snap.config, tensors

    def peft_tensors(self, slot: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """(adapter_config dict, PEFT-named tensors) of the slot, as SGLang/peft load them. Collective."""
        return self.peft_from_snapshot(self.snapshot_peft(slot))

    def export_peft(self, slot: int, out_dir: str | Path, *, dtype: str = "float32") -> str:
        """Write the slot as a PEFT adapter folder in ``dtype`` (rank 0 writes; all ranks must call).
        Synchronous: when it returns the folder is written. float32 (the weights as trained) unless
        told: checkpoints and retire exports keep every bit; only publish folders take the engines' dtype."""
        writes = self.layout.rank == 0
        snap = self.snapshot_peft(slot, to_host=writes, dtype=dtype)
        if writes:
            self._write_peft(out_dir, snap)
        return str(out_dir)

    # Background export (issue 18): the snapshot in call order, the write off the critical path.
    def export_peft_in_background(self, slot: int, out_dir: str | Path, *, dtype: str = "float32") -> str:
        """Snapshot the slot now in ``dtype`` (collective, before any later call changes its weights) and queue
        the folder's write on this rank's writer thread (rank 0; trainer/export_writer.py); returns
        at once unless the writer's memory bound is full. `wait_export(out_dir)` waits for the
        write. The folder appears whole (written under a temporary name, then renamed)."""
        out_dir = str(out_dir)
        writes = self.layout.rank == 0
        try:
            snap = self.snapshot_peft(slot, to_host=writes, dtype=dtype)
        except BaseException as e:
            if writes:
                self.export_writer().fail(out_dir, e)  # its waiter raises this instead of waiting forever
            raise
        if writes:
            self.export_writer().submit(out_dir, snap, snap.nbytes)
        return out_dir

    def wait_export(self, out_dir: str | Path) -> str:
        """Block until the background export to ``out_dir`` is written; raises its error (a failed
        snapshot or write). Safe to call from another thread than the one that queued it, and
        before it is queued. Ranks other than 0 write nothing and return at once."""
        if self.layout.rank != 0:
            return str(out_dir)
        return self.export_writer().wait(str(out_dir))

    def export_writer(self) -> ExportWriter:
        """This rank's writer thread (started on first use)."""
        with self._export_writer_lock:
            if self._export_writer is None:
                self._export_writer = ExportWriter(self._write_snapshot, threads=self.config.export_writer_threads)
            return self._export_writer

    def _write_snapshot(self, out_dir: str, snap: PeftSnapshot) -> None:
        replace_folder_atomically(lambda tmp: self._write_peft(tmp, snap), out_dir)

    @staticmethod
    def _write_peft(out_dir: str | Path, snap: PeftSnapshot) -> None:
        """The snapshot's folder: its header and packed data in one write, and the config."""
        snap.ready()
        write_peft_folder_packed(out_dir, snap.config, snap.header, snap.body)

    # -- checkpoint ------------------------------------------------------------------------------

    def slot_state_tensors(self, slot: int) -> dict[str, tuple[dict, dict]]:
        """{"weight"|"exp_avg"|"exp_avg_sq"|"grad": (A per layer, B per layer)}: the slot's live
        blocks gathered to TP=1 Megatron layout, fp32 on CPU (grad = this DP rank's pending part).
        Collective over TP."""
        state = self._state(slot)
        return {
            key: self._full_slot_tensors(slot, tensors, state.rank)
            for key, tensors in (("weight", [p.data for p in self.params]), ("exp_avg", self.exp_avg),
                                 ("exp_avg_sq", self.exp_avg_sq), ("grad", self._grads()))
        }

    def save_slot_state(self, slot: int, out_dir: str | Path) -> str:
        """LoRA weights, Adam moments, pending gradient and counters, step (= schedule state).

        Tensors are stored gathered in TP=1 layout and summed over DP, so a state
        reloads under any tp/dp. Collective; rank 0 writes.
        """
        state = self._state(slot)
        parts = self.slot_state_tensors(slot)
        pending = state.pending.clone()
        if self.layout.dp_size > 1:  # pending gradient and statistics are per DP rank: save their sum
            for d in parts["grad"]:
                for name, t in d.items():
                    t = t.to(self.device)
                    dist.all_reduce(t, group=dp_group())
                    d[name] = t.cpu()
            pending_dev = pending.to(self.device)
            dist.all_reduce(pending_dev, group=dp_group())
            pending = pending_dev.cpu()
        if self.layout.rank == 0:
            save_slot_checkpoint(out_dir, state, pending, parts, self.config)
        return str(out_dir)

    @torch.no_grad()
    def load_slot_state(self, slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
        """Restore a slot saved by save_slot_state. ``registration``: the tenant that resumes it
        (a run resumed under a new registration id); default the one that saved it."""
        self._check_slot(slot)
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use; clear it before loading a state into it")
        meta, parts, pending = load_slot_checkpoint(in_dir, self.layers, self.config)
        rank = meta["rank"]
        self._write_slot(slot, rank, *parts["weight"])
        for key, tensors in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("grad", self._grads())):
            a_full, b_full = parts[key]
            keep = key != "grad" or self.layout.dp_rank == 0  # the summed pending gradient lives on DP rank 0
            for layer, a, b in zip(self.layers, tensors[0::2], tensors[1::2]):
                if keep:
                    layer.a_block(a, slot, rank).copy_(layer.local_a(a_full[layer.name]).to(self.device))
                    layer.b_block(b, slot, rank).copy_(layer.local_b(b_full[layer.name]).to(self.device))
        state = SlotState(
            hyper=SlotHyperParams(**meta["hyper"]), rank=rank, scale=meta["scale"], seed=meta["seed"],
            registration=registration if registration is not None else meta["registration"],
            step=meta["step"], pending_samples=meta["pending_samples"],
            pending=pending if self.layout.dp_rank == 0 else torch.zeros(N_STATS, dtype=torch.float64),
        )
        self.slots[slot] = state
        self._set_scales(slot, state.scale, state.hyper)
        return self.slot_status(slot)

    # -- keep-warm eviction (trainer/slot_swap.py) -----------------------------------------------

    def _buffer_rows(self) -> dict[str, torch.Tensor]:
        b = self.buffers
        return {"weight": b.weight, "grad": b.grad, "exp_avg": b.exp_avg, "exp_avg_sq": b.exp_avg_sq}

    def swap_out(self, slot: int, key: str) -> dict:
        """Evict the slot: its rows and counters go to this rank's swap store under ``key``
        (host memory, or the spill folder beyond the budget), then the slot is cleared.
        Raises SwapError with the slot unchanged when the snapshot cannot be stored (S1).
        Collective: every rank stores its own part."""
        state = self._state(slot)
        if key in self.swap:
            raise SwapError(f"a snapshot {key!r} is already stored on this trainer")
        rows, seconds = timed(lambda: copy_rows_out(self._buffer_rows(), slot))
        meta = {"hyper": state.hyper.model_dump(mode="json"), "rank": state.rank, "scale": state.scale,
                "seed": state.seed, "registration": state.registration, "step": state.step,
                "pending_samples": state.pending_samples}
        snap = SlotSnapshot(meta=meta, pending=state.pending.clone(), rows=rows)
        nbytes = snap.nbytes
        where = self.swap.put(key, snap)
        self.clear_slot(slot)
        return {"key": key, "slot": slot, "where": where, "bytes": nbytes, "seconds": seconds, "step": state.step}

    def swap_in(self, slot: int, key: str) -> dict:
        """Bring the snapshot ``key`` back into the free ``slot`` (any slot: every row has the
        same layout), bit-exact (S2). Collective."""
        self._check_slot(slot)
        if self.slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use; clear or swap it out before swapping {key!r} in")
        t0 = time.perf_counter()
        snap = self.swap.take(key)
        try:
            copy_rows_in(self._buffer_rows(), slot, snap.rows)
        except BaseException:
            self._zero_slot(slot)
            self.swap.put(key, snap)  # keep it for another try (the slot stays free)
            raise
        m = snap.meta
        self.slots[slot] = SlotState(
            hyper=SlotHyperParams(**m["hyper"]), rank=m["rank"], scale=m["scale"], seed=m["seed"],
            registration=m["registration"], step=m["step"], pending_samples=m["pending_samples"],
            pending=snap.pending.clone(),
        )
        self._set_scales(slot, m["scale"], self.slots[slot].hyper)
        return {"key": key, "slot": slot, "seconds": time.perf_counter() - t0, "step": m["step"],
                "from": "disk" if snap.spill_path is not None else "host"}

    def drop_swapped(self, key: str) -> bool:
        """Forget an evicted slot (its run retired or failed while out). Collective."""
        return self.swap.drop(key)

    def swapped(self) -> dict:
        """What this rank holds evicted: keys, host bytes, and which are spilled."""
        return {"keys": self.swap.keys(), "host_bytes": self.swap.host_bytes(),
                "spilled": self.swap.spilled_keys()}

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, slot: int | None) -> torch.Tensor:
        """Full-vocab logits [b, s, V] of the base with ``slot``'s LoRA on (None = base only)."""
        ids = input_ids.to(self.device)
        b, s = ids.shape
        if slot is not None:
            self._state(slot)
            self.routing.set(torch.full((b,), slot), s, self.scales)
        try:
            pos = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
            return self.base.model(ids, pos, attention_mask(self.base, s, self.device), runtime_gather_output=True).float()
        finally:
            self.routing.disable()

    # -- training --------------------------------------------------------------------------------

    def train(self, batch: TrainBatch | None, riders: list[RiderSequence] | None = None) -> TrainResult:
        """Forward/backward the batch (one mixed pass per micro-batch); step every slot whose
        samples_per_step is reached. Collective: all ranks pass the same batch.

        ``riders`` (tenant-driven sequences, see RiderSequence) join the FIRST phase's packed
        micro-batches under the same token budget: one forward/backward over the union, their
        gradients accumulating in their own slots, which never step here. ``batch`` None: riders
        only (the Tinker forward_backward alone). Everything is validated before anything changes."""
        samples = batch.samples if batch is not None else []
        riders = riders or []
        self.check_batch(batch)  # validate everything before changing anything
        self._check_riders(riders, {s.slot for s in samples})
        dropped: dict[int, int] = {}
        kept: list[int] = []
        for i, s in enumerate(samples):
            reg = self.slots[s.slot].registration
            if s.registration is not None and s.registration != reg:
                dropped[s.slot] = dropped.get(s.slot, 0) + 1
            else:
                kept.append(i)
        slots_in_call = sorted({samples[i].slot for i in kept})
        planned = assign_phases(
            [samples[i].slot for i in kept],
            {k: self.slots[k].pending_samples for k in slots_in_call},
            {k: self.slots[k].hyper.samples_per_step for k in slots_in_call},
        )
        planned = [type(p)(kept[p.index], p.slot, p.phase) for p in planned]  # index into samples
        call_stats = torch.zeros(self.config.num_slots, N_STATS, dtype=torch.float64)
        reports: dict[int, list[StepReport]] = {}
        n_phases = max(1 + max((p.phase for p in planned), default=-1), 1 if riders else 0)
        lengths = [len(s.tokens) for s in samples]
        for phase in range(n_phases):
            in_phase = [p for p in planned if p.phase == phase]
            local = dp_shard(in_phase, self.layout.dp_rank, self.layout.dp_size)
            for mb, mb_riders in self._micro_batches(local, lengths, riders if phase == 0 else []):
                self._forward_backward([samples[p.index] for p in mb], call_stats, mb_riders)
            due = []
            for slot in sorted({p.slot for p in in_phase}):
                state = self.slots[slot]
                state.pending_samples += sum(1 for p in in_phase if p.slot == slot)
                if state.pending_samples == state.hyper.samples_per_step:
                    due.append(slot)
            if due:
                for slot, report in self._step_slots(due).items():
                    reports.setdefault(slot, []).append(report)
        if self.layout.dp_size > 1:
            stats_dev = call_stats.to(self.device)
            dist.all_reduce(stats_dev, group=dp_group())
            call_stats = stats_dev.cpu()
        metrics = {slot: self._metrics(slot, call_stats[slot], reports.get(slot, [])) for slot in slots_in_call}
        stepped = sorted(s for s, rs in reports.items() if any(not r.skipped_nonfinite for r in rs))
        skipped = sorted(s for s, rs in reports.items() if any(r.skipped_nonfinite for r in rs))
        return TrainResult(slots=metrics, stepped=stepped, skipped_nonfinite=skipped, dropped_foreign=dropped)

    def check_batch(self, batch: TrainBatch | None) -> None:
        """ValueError naming the first sample ``train`` would refuse (its slot is not initialized,
        or a token id is outside the vocabulary); nothing changes either way."""
        for i, s in enumerate(batch.samples if batch is not None else []):
            try:
                self._state(s.slot)
            except ValueError as err:
                raise ValueError(f"sample {i}: {err}") from None
            if max(s.tokens) >= self.vocab_size:
                raise ValueError(f"sample {i}: token id {max(s.tokens)} >= vocab size {self.vocab_size}")

    def _check_riders(self, riders: list[RiderSequence], batch_slots: set[int]) -> None:
        """Riders need the packed path and dp == 1 (they are not sharded), initialized slots that
        the batch does not train (a loop slot never accumulates a rider's gradient), and one
        target per token."""
        if not riders:
            return
        if not self.config.packed:
            raise ValueError("riders need TrainerConfig.packed (fused or TransformerEngine layer spec)")
        if self.layout.dp_size > 1:
            raise ValueError("riders support dp == 1 only")
        for k, r in enumerate(riders):
            self._state(r.slot)
            if r.slot in batch_slots:
                raise ValueError(f"rider {k}: slot {r.slot} is trained by the batch; a rider's slot must not be")
            if not r.tokens or len(r.targets) != len(r.tokens):
                raise ValueError(f"rider {k}: needs tokens and one target per token, got {len(r.tokens)} and {len(r.targets)}")

    def _micro_batches(self, local: list[PlannedSample], lengths: list[int],
                       riders: list[RiderSequence] | None = None) -> list[tuple[list[PlannedSample], list[RiderSequence]]]:
        """This rank's samples of a phase (and the riders joining it) cut into micro-batches:
        (samples sorted by slot, riders in their order) each.

        Packed: at most ``micro_batch_tokens`` real tokens each, loop samples and riders filled
        together in slot order, so a slot's sequences share as few micro-batches as possible.
        Padded (no riders there): at most that many (samples x longest) tokens each, longest
        first (less padding)."""
        budget = self.config.micro_batch_tokens
        riders = riders or []
        if not self.config.packed:
            return [(mb, []) for mb in pack_micro_batches(local, lengths, budget)]
        n = len(local)
        groups = split_by_token_budget([lengths[p.index] for p in local] + [len(r.tokens) for r in riders],
                                       [p.slot for p in local] + [r.slot for r in riders], budget)
        return [(sorted((local[i] for i in g if i < n), key=lambda p: (p.slot, p.index)),
                 [riders[i - n] for i in sorted(g) if i >= n]) for g in groups]

    @torch.no_grad()
    def packed_lora_pass(self, sequences: list[list[int]], slot_ids: list[int], targets: list[list[int]]) -> torch.Tensor:
        """One packed stream with each sequence's slot LoRA on, no gradient: log p(targets[i][t] |
        sequences[i][:t+1]) for every position, as one fp32 [T] tensor in the given order.

        For tenant-driven forward calls (the Tinker API's ``forward``, trainer/tinker_ops.py),
        whose targets are given per position; their forward_backward rides in ``train`` as
        RiderSequences. ``slot_ids`` must be non-decreasing (each slot one contiguous segment).
        Collective over TP (same arguments on every rank); needs ``TrainerConfig.packed``."""
        if not self.config.packed:
            raise ValueError("packed_lora_pass needs TrainerConfig.packed (fused or TransformerEngine layer spec)")
        if any(a > b for a, b in zip(slot_ids, slot_ids[1:])):
            raise ValueError(f"slot_ids must be non-decreasing, got {slot_ids}")
        for s in set(slot_ids):
            self._state(s)
        flat_targets = torch.tensor([t for seq in targets for t in seq], dtype=torch.long, device=self.device)
        self.routing.disable()
        try:
            return self._stream_logprobs(sequences, slot_ids, flat_targets, lora=True)[0].float()
        finally:
            self.routing.disable()

    @torch.no_grad()
    def adam_step_slot(self, slot: int, *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, max_grad_norm: float | None) -> dict:
        """Apply the slot's accumulated gradient AS IS (no normalization: the caller's loss
        defines the scale) with per-call AdamW parameters, then zero it. The slot's update
        count ``step`` advances by one (Adam's bias correction uses it). A non-finite gradient
        changes nothing but zeroes the gradient and is reported. Only dp == 1 (the gradient
        would first need a DP reduction). Collective over TP."""
        state = self._state(slot)
        if self.layout.dp_size > 1:
            raise ValueError("adam_step_slot supports dp == 1 only")
        buf = self.buffers
        grads = buf.rows(buf.grad, [slot])
        sq_split = torch.linalg.vector_norm(grads[:, : buf.split_cols], dim=1, dtype=torch.float32).square()
        sq_repl = torch.linalg.vector_norm(grads[:, buf.split_cols :], dim=1, dtype=torch.float32).square()
        if self.config.tp > 1:
            dist.all_reduce(sq_split, group=tp_group())
        grad_norm = float((sq_split + sq_repl).sqrt()[0])
        if not math.isfinite(grad_norm):
            buf.grad.index_fill_(0, torch.tensor([slot], device=self.device), 0.0)
            return {"grad_norm": grad_norm, "skipped_nonfinite": True, "step": state.step}
        state.step += 1
        f64 = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
        cols = AdamwColumns.build(
            buf.weight.dtype, self.device, grad_scale=f64(clip_coefficient(grad_norm, max_grad_norm)), lr=f64(lr),
            weight_decay=f64(weight_decay), beta1=f64(beta1), beta2=f64(beta2), eps=f64(eps), step=f64(state.step),
        )
        adamw_apply(buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq, [slot], cols)  # zeroes its gradient
        return {"grad_norm": grad_norm, "skipped_nonfinite": False, "step": state.step}

    @torch.no_grad()
    def reset_optimizer(self, slot: int) -> None:
        """Adam moments, update count and pending gradient of the slot to zero (weights kept)."""
        state = self._state(slot)
        idx = torch.tensor([slot], device=self.device)
        for t in (self.buffers.exp_avg, self.buffers.exp_avg_sq, self.buffers.grad):
            t.index_fill_(0, idx, 0.0)
        state.step, state.pending_samples = 0, 0
        state.pending = torch.zeros(N_STATS, dtype=torch.float64)

    def _normalizer(self, state: SlotState, stats: torch.Tensor) -> float:
        h = state.hyper
        if h.loss_normalization == "sequence_mean":
            return float(stats[SAMPLES]) if stats[SAMPLES] > 0 else 1.0
        if h.loss_normalization == "token_mean":
            return max(float(stats[TOKENS]), 1.0)
        return float(stats[SAMPLES]) * h.loss_norm_tokens

    def _metrics(self, slot: int, stats: torch.Tensor, steps: list[StepReport]) -> SlotMetrics:
        state = self.slots[slot]
        rl_tokens = max(float(stats[RL_TOKENS]), 1.0)
        return SlotMetrics(
            samples=int(stats[SAMPLES]), loss_tokens=int(stats[TOKENS]),
            loss=float(stats[NUM]) / self._normalizer(state, stats),
            clip_frac=float(stats[CLIPPED]) / rl_tokens, ratio_mean=float(stats[RATIO]) / rl_tokens,
            kl_mean=float(stats[KL]) / rl_tokens, pending_samples=state.pending_samples, steps=steps,
        )

    def frozen_base_pass(self, batch: TrainBatch) -> float:
        """Forward+backward of ``batch`` through the frozen base alone (LoRA off), in the
        micro-batches and along the path ``train`` uses, the gradient going to the input
        embeddings only; changes no slot. The floor under a LoRA step, for benchmarks.
        Returns the summed log-prob of the learned tokens. Collective like ``train``."""
        samples = batch.samples
        planned = [PlannedSample(i, s.slot, 0) for i, s in enumerate(samples)]
        local = dp_shard(planned, self.layout.dp_rank, self.layout.dp_size)
        total = 0.0
        for mb, _ in self._micro_batches(local, [len(s.tokens) for s in samples]):
            mbs = [samples[p.index] for p in mb]
            t = _MicroBatchTensors.build(mbs, [SlotHyperParams(objective="sft")] * len(mbs), self.device)
            lp = self._logprobs(mbs, t.ids, t.labels, lora=False, input_grad=True)
            loss = -torch.where(t.mask, lp, torch.zeros_like(lp)).sum()
            loss.backward()
            total -= float(loss)
        return total

    def _logprobs(
        self, mb: list[TrainSample], ids: torch.Tensor, labels: torch.Tensor, lora: bool, input_grad: bool = False
    ) -> torch.Tensor:
        """log p(labels) [b, s] fp32 on the device for the micro-batch ``mb`` (sorted by slot),
        laid out like the padded ``ids``/``labels``; LoRA on (each sample's slot) or off.

        Packed: the samples go through the model as one stream and the per-token values
        are scattered back to [b, s] (positions past a sample's end stay 0, masked anyway).

        With LoRA on, the routing is left set for the caller's backward (activation
        recomputation re-runs the LoRA layers there); the caller disables it.
        """
        cfg = self.config
        chunk = cfg.logprob_chunk_tokens if cfg.chunked_logprobs else None
        tpg = tp_group() if cfg.tp > 1 else None
        slot_ids = [x.slot for x in mb]
        self.routing.disable()
        try:
            if not cfg.packed:
                if lora:
                    self.routing.set(torch.tensor(slot_ids), ids.shape[1], self.scales)
                return token_logprobs(self.base, ids, labels, chunk_tokens=chunk, tp_group=tpg, input_grad=input_grad)
            lp, packed = self._stream_logprobs([x.tokens for x in mb], slot_ids, None, lora=lora, input_grad=input_grad)
            layout = packed.layout
            return lp.new_zeros(ids.shape).index_put((layout.document_ids.long(), layout.position_ids), lp)
        except BaseException:
            self.routing.disable()
            raise

    def _stream_logprobs(self, sequences: list[list[int]], slot_ids: list[int], targets: torch.Tensor | None,
                         *, lora: bool, input_grad: bool = False):
        """(log-probs [T] fp32, PackedBatch) of ONE packed stream of ``sequences`` (already in slot
        order: the stream keeps the given order). ``targets`` [T]: what each position predicts;
        None = the next token (IGNORE_TARGET, log-prob 0, at each sequence's last token). With
        ``lora`` the routing is set for the stream and left set (the caller's backward recomputes
        the LoRA layers; the caller disables it). The one home of the packed LoRA pass: the
        loop's micro-batches, the mixed micro-batches with riders, and the Tinker forward."""
        cfg = self.config
        chunk = cfg.logprob_chunk_tokens if cfg.chunked_logprobs else None
        tpg = tp_group() if cfg.tp > 1 else None
        packed = pack_sequences(sequences, slot_ids, cfg.num_slots, device=self.device)
        if packed.sample_order != tuple(range(len(sequences))):  # callers' scatters rely on it
            raise RuntimeError(f"packed stream not sorted by slot: slots {slot_ids}")
        if targets is None:
            targets, _ = packed.next_token_targets()
        if lora:
            self.routing.set_packed(packed, self.scales)
        lp = packed_token_logprobs(self.base, packed, targets, chunk_tokens=chunk, tp_group=tpg, input_grad=input_grad)
        return lp, packed

    def _mixed_logprobs(self, mb: list[TrainSample], shape: torch.Size, riders: list[RiderSequence]):
        """The loop samples ``mb`` and the ``riders`` of one micro-batch in ONE packed stream with
        every sequence's own slot LoRA on: (the loop samples' log-probs laid out like ``_logprobs``
        [b, s], one [len(tokens)] log-prob segment per rider). Routing left set (see above)."""
        from trainer.chunked_logprobs import IGNORE_TARGET

        items = [(x.slot, x.tokens, None, j) for j, x in enumerate(mb)]
        items += [(r.slot, r.tokens, r.targets, -1 - k) for k, r in enumerate(riders)]
        items.sort(key=lambda it: it[0])  # stable: the loop's (slot, index) order and the riders' order kept
        flat: list[int] = []
        for _, tokens, targets, _ in items:
            flat += list(tokens[1:]) + [IGNORE_TARGET] if targets is None else list(targets)
        lp, _ = self._stream_logprobs([it[1] for it in items], [it[0] for it in items],
                                      torch.tensor(flat, dtype=torch.long, device=self.device), lora=True)
        rows, cols, where, rider_lp = [], [], [], [None] * len(riders)
        start = 0
        for _, tokens, _, who in items:
            n = len(tokens)
            if who >= 0:
                rows.append(torch.full((n,), who, dtype=torch.long))
                cols.append(torch.arange(n))
                where.append(torch.arange(start, start + n))
            else:
                rider_lp[-1 - who] = lp[start : start + n]
            start += n
        loop_lp = lp.new_zeros(shape)
        if rows:
            idx = torch.cat(where).to(lp.device)
            loop_lp = loop_lp.index_put((torch.cat(rows).to(lp.device), torch.cat(cols).to(lp.device)), lp[idx])
        return loop_lp, rider_lp

    def _forward_backward(self, mb: list[TrainSample], call_stats: torch.Tensor,
                          riders: list[RiderSequence] | None = None) -> None:
        """One micro-batch (loop samples sorted by slot, plus riders): KL reference pass if any,
        ONE policy forward over all of it, the summed per-sample loss numerators and riders'
        losses backward, the loop samples' statistics into their slots' pending sums."""
        dev = self.device
        riders = riders or []
        t = _MicroBatchTensors.build(mb, [self.slots[x.slot].hyper for x in mb], dev) if mb else None
        ref_sub = None
        if t is not None and t.kl_rows:  # reference policy = the base with LoRA off, for the KL term only
            with torch.no_grad():
                ref_sub = self._logprobs([mb[j] for j in t.kl_rows], t.ids[t.kl_rows], t.labels[t.kl_rows], lora=False)
        try:
            rider_lp: list[torch.Tensor] = []
            if riders:
                logp, rider_lp = self._mixed_logprobs(mb, t.ids.shape if t is not None else (0, 0), riders)
            else:
                logp = self._logprobs(mb, t.ids, t.labels, lora=True)
            total = logp.new_zeros(())
            if t is not None:
                ref = None
                if ref_sub is not None:
                    ref = logp.detach().clone()
                    ref[t.kl_rows] = ref_sub
                # Unknown rollout logprobs (or masked positions): on-policy, ratio exactly 1.
                rollout_lp = torch.where(t.has_rollout & t.mask, t.rollout, logp.detach())
                inputs = TokenLossInputs(
                    logprobs=logp, mask=t.mask, is_rl=t.is_rl, advantage=t.advantage, rollout_logprobs=rollout_lp,
                    ratio_low=t.ratio_low, ratio_high=t.ratio_high, kl_coef=t.kl_coef, ref_logprobs=ref,
                    per_token_weight=t.weight,
                )
                numerators, st = sample_loss_numerators(inputs)
                total = total + numerators.sum()
            for r, lp in zip(riders, rider_lp):
                total = total + r.loss(lp)
            total.backward()
            self.buffers.check_grads_in_place()
        finally:
            self.routing.disable()  # kept set through backward: recomputation runs the LoRA layers again
        if t is None:
            return
        b = len(mb)
        rows = torch.stack(
            [st.numerator, torch.ones(b, device=dev), st.tokens, st.clipped, st.ratio_sum, st.kl_sum,
             st.tokens * t.is_rl], dim=1,
        ).to(torch.float64).cpu()
        call_stats.index_add_(0, t.slot_ids, rows)
        for j, x in enumerate(mb):
            self.slots[x.slot].pending += rows[j]

    @torch.no_grad()
    def _step_slots(self, due: list[int]) -> dict[int, StepReport]:
        """Reduce over DP, normalize, check, clip and update the due slots, then reset them.

        On whole rows of the slot buffers: a handful of ops whatever the number of slots
        stepping and of layers (slot_buffers.py)."""
        buf = self.buffers
        states = [self.slots[slot] for slot in due]
        pending = torch.stack([st.pending for st in states])
        grads = buf.rows(buf.grad, due)  # a view when the due slots are one contiguous range
        if self.layout.dp_size > 1:  # only the due slots' gradients (and counters) cross DP
            reduced = grads.contiguous()
            dist.all_reduce(reduced, group=dp_group())
            buf.put_rows(buf.grad, due, reduced)
            grads = buf.rows(buf.grad, due)
            pending_dev = pending.to(self.device)
            dist.all_reduce(pending_dev, group=dp_group())
            pending = pending_dev.cpu()
        # Squared norms per slot of the raw (un-normalized) gradients. TP: columns split over
        # TP are summed over the group, replicated ones counted once.
        sq_split = torch.linalg.vector_norm(grads[:, : buf.split_cols], dim=1, dtype=torch.float32).square()
        sq_repl = torch.linalg.vector_norm(grads[:, buf.split_cols :], dim=1, dtype=torch.float32).square()
        if self.config.tp > 1:
            dist.all_reduce(sq_split, group=tp_group())
        raw_norms = (sq_split + sq_repl).sqrt().double().cpu().tolist()

        reports, stepping, scale, hyper_rows = {}, [], [], []
        for row, (slot, st) in enumerate(zip(due, states)):
            stats = pending[row]
            norm_by = self._normalizer(st, stats)
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
            reports[slot] = StepReport(step=st.step if finite else st.step + 1, lr=lr, grad_norm=grad_norm,
                                       loss=loss, skipped_nonfinite=not finite)
        if stepping:
            hp = torch.tensor(hyper_rows, dtype=torch.float64)
            cols = AdamwColumns.build(
                buf.weight.dtype, self.device, grad_scale=torch.tensor(scale, dtype=torch.float64),
                lr=hp[:, 0], weight_decay=hp[:, 1], beta1=hp[:, 2], beta2=hp[:, 3], eps=hp[:, 4], step=hp[:, 5],
            )
            adamw_apply(buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq, stepping, cols)  # zeroes their grads
        stepped = set(stepping)
        skipped = [slot for slot in due if slot not in stepped]
        if skipped:  # a non-finite slot's accumulated batch is discarded
            buf.grad.index_fill_(0, torch.tensor(skipped, device=self.device), 0.0)
        for st in states:
            st.pending_samples = 0
            st.pending = torch.zeros(N_STATS, dtype=torch.float64)
        return reports


@dataclass
class _MicroBatchTensors:
    """A micro-batch laid out [b, s] (one row per sample, right-padded) for the losses.

    Token t's entries describe the prediction of token t + 1: ``labels[j, t]`` is that
    token, ``mask`` its loss mask, ``rollout`` its rollout log-prob. Per-sample columns
    carry each sample's adapter hyper-parameters. On the device, except ``slot_ids``.
    """

    ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    rollout: torch.Tensor
    has_rollout: torch.Tensor
    slot_ids: torch.Tensor  # CPU, for the statistics
    is_rl: torch.Tensor
    kl_coef: torch.Tensor
    kl_rows: list[int]  # rows with a KL term (need the reference pass)
    weight: torch.Tensor  # per-sample token weight (1/n for sequence_mean)
    advantage: torch.Tensor
    ratio_low: torch.Tensor  # the PPO clip's absolute ratio bounds (SlotHyperParams.ratio_bounds)
    ratio_high: torch.Tensor

    @staticmethod
    def build(mb: list[TrainSample], hypers: list[SlotHyperParams], dev: torch.device) -> "_MicroBatchTensors":
        b, s = len(mb), max(len(x.tokens) for x in mb)
        ids = torch.zeros(b, s, dtype=torch.long)
        labels = torch.zeros(b, s, dtype=torch.long)
        mask = torch.zeros(b, s, dtype=torch.bool)
        rollout = torch.zeros(b, s, dtype=torch.float32)
        has_rollout = torch.zeros(b, s, dtype=torch.bool)
        for j, x in enumerate(mb):
            n = len(x.tokens)
            ids[j, :n] = torch.tensor(x.tokens)
            labels[j, : n - 1] = ids[j, 1:n]
            mask[j, : n - 1] = torch.tensor(x.loss_mask[1:], dtype=torch.bool)
            if x.rollout_logprobs is not None:
                rollout[j, : n - 1] = torch.tensor(x.rollout_logprobs[1:], dtype=torch.float32)
                has_rollout[j, : n - 1] = True
        is_rl = torch.tensor([h.objective == "rl" for h in hypers])
        kl_coef = torch.tensor([h.kl_coef if h.objective == "rl" else 0.0 for h in hypers])
        n_tok = mask.sum(dim=1).clamp(min=1).to(torch.float32)
        seq_mean = torch.tensor([h.loss_normalization == "sequence_mean" for h in hypers])
        weight = torch.where(seq_mean, 1.0 / n_tok, torch.ones(b))
        return _MicroBatchTensors(
            ids=ids.to(dev), labels=labels.to(dev), mask=mask.to(dev), rollout=rollout.to(dev),
            has_rollout=has_rollout.to(dev), slot_ids=torch.tensor([x.slot for x in mb]), is_rl=is_rl.to(dev),
            kl_coef=kl_coef.to(dev), kl_rows=(kl_coef > 0).nonzero().flatten().tolist(), weight=weight.to(dev),
            advantage=torch.tensor([x.advantage for x in mb], dtype=torch.float32, device=dev),
            ratio_low=torch.tensor([h.ratio_bounds[0] for h in hypers], device=dev),
            ratio_high=torch.tensor([h.ratio_bounds[1] for h in hypers], device=dev),
        )
