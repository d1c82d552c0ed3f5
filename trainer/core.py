"""MultiLoraTrainer: N resident LoRA slots on one frozen Megatron base (no Ray here).

One process per device (tp * dp processes in all; see distributed.py). The
public methods are collective: every rank of the trainer calls them with the
same arguments (the Ray actor group does that), and rank 0 writes files.

The trainer builds the model and its slots and runs the train call; the rest lives in
rooms of one role each, which it composes or which take it:
  trainer/lora/slots.py          who holds each slot, its scales, its rows in full layout (``slots``)
  trainer/step/lora_passes.py    the forward passes with each slot's LoRA (``passes``)
  trainer/step/micro_batch.py    micro-batches and their forward/backward
  trainer/optim/slot_steps.py     the per-slot optimizer steps and what a call reports
  trainer/export/slot_export.py    PEFT snapshots and exports (``export``)
  trainer/swap/slot_checkpoint.py  a slot to a checkpoint folder and back (functions over the trainer)
  trainer/swap/slot_swap.py      keep-warm eviction (``swap``; its tiers: trainer/swap/swap_store.py)

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
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.base.base_model import build_frozen_base, trainer_layer_spec
from trainer.batch import RiderSequence, TrainBatch, assign_phases, dp_shard, rider_share
from trainer.config import TARGET_GROUPS, SlotHyperParams, TrainerConfig, target_group
from trainer.platform.distributed import dp_group, init_parallel, tp_group
from trainer.step.lora_passes import LoraPasses
from trainer.step.micro_batch import forward_backward, micro_batches
from trainer.lora.moe_lora import install_moe_lora, is_expert_layer, kaiming_a, moe_layers
from trainer.export.moe_peft import read_expert_peft
from trainer.lora.multi_lora import UNEMBED_MODULE, SlotRouting, install_multi_lora
from trainer.export.peft_io import ADAPTER_CONFIG, json_target_parameters, read_peft_folder
from trainer.lora.slot_buffers import SlotBuffers
from trainer.optim.step_overlap import StepOverlap
from trainer.export.slot_export import SlotExporter
from trainer.optim.slot_steps import StepReport, TrainResult, adam_step, slot_metrics, step_due_slots
from trainer.swap.slot_swap import SlotSwap
from trainer.lora.slots import N_STATS, SlotState, SlotTable, layer_trained, zero_stats
from trainer.swap.swap_store import SwapStore
from trainer.storage.locations import open_store, readable_folder
from trainer.lora.unembed_lora import UnembedLora, install_unembed_lora


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
                                   rank_kernels=config.lora_rank_kernels, lora_gemm=config.lora_gemm)
        self.layers = install_multi_lora(
            self.base, target_modules=config.target_modules, num_slots=config.num_slots,
            max_rank=config.max_rank, routing=self.routing, tp_group=tp_group() if config.tp > 1 else None,
        )
        # The unembedding (output_layer, HF lm_head): slots like any other target (unembed_lora.py).
        self.unembed: UnembedLora | None = None
        if UNEMBED_MODULE in config.target_modules:
            self.unembed = install_unembed_lora(self.base, num_slots=config.num_slots, max_rank=config.max_rank,
                                                routing=self.routing, tp_group=tp_group() if config.tp > 1 else None)
            self.layers.append(self.unembed)
        # MoE bases: every routed expert's fc1/fc2 gets slots too, grouped by (expert, slot)
        # (moe_lora.py); a slot's expert scale is 0 when its adapter trains attention only.
        self.layers += install_moe_lora(
            self.base, target_modules=config.target_modules, num_slots=config.num_slots,
            max_rank=config.max_rank, routing=self.routing,
        )
        self.dense_layers = [layer for layer in self.layers if not is_expert_layer(layer)]
        self.expert_layers = [layer for layer in self.layers if is_expert_layer(layer)]
        # Weights, gradients and Adam moments of all slots: rows of four slot-major buffers,
        # every layer's tensors views into them (slot_buffers.py). Lists in layer order.
        self.buffers = SlotBuffers(self.layers, config.num_slots, self.device)
        self.slots = SlotTable(self.layers, self.buffers, self.device)
        # The optimizer step may outlive train() on a CUDA stream of its own; readers wait for it.
        self.step_overlap = StepOverlap(self.layers, self.buffers, self.device, enabled=config.overlap_step,
                                        min_params=config.overlap_step_min_params)
        self.buffers.settle = self.step_overlap.settle
        self.buffers.behind_step = self.step_overlap.behind_step
        for moe in moe_layers(self.base.model):
            moe.slot_expert_scales = self.slots.expert_scales
        self.vocab_size: int = self.base.model.vocab_size
        self.passes = LoraPasses(self.base, self.routing, self.slots.scales, config)
        self.export = SlotExporter(self.base, self.slots, self.dense_layers, self.expert_layers, self.layout, config)
        store = SwapStore(int(config.swap_host_budget_mb * 2**20), config.swap_spill_dir, int(config.swap_disk_budget_mb * 2**20),
                          rank=self.layout.rank, world_size=self.layout.world_size, pin=self.device.type == "cuda")
        self.swap = SlotSwap(self.slots, store)

    def slot_state(self, slot: int) -> SlotState:
        """The initialized slot's state (ValueError otherwise)."""
        return self.slots.state(slot)

    # -- lifecycle ----------------------------------------------------------------------------

    @torch.no_grad()
    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | Path | None = None, registration: str | None = None) -> dict:
        """A random (seeded, PEFT's kaiming-uniform), B zero, in the layers of the slot's targets
        (every other layer stays exactly zero); or the weights of a PEFT folder."""
        self.slots.require_free(slot, "clear it before initializing it again")
        if hyper.rank > self.config.max_rank:
            raise ValueError(f"rank {hyper.rank} exceeds the trainer's max_rank {self.config.max_rank}")
        self.check_targets(hyper)
        g = torch.Generator().manual_seed(seed)
        # None: the block stays as the zeroing below leaves it (B, and every layer of a target the
        # slot does not train), so no host tensor is built or copied for it (at the 8B shape the
        # B blocks alone are 22 M zeros per slot).
        a_full: dict[str, torch.Tensor | None] = {}
        b_full: dict[str, torch.Tensor | None] = {}
        for layer in self.layers:  # the full (TP=1) A, so every TP layout gets the same init
            if layer_trained(layer, hyper):
                a_full[layer.name] = kaiming_a(layer.a_full_shape(hyper.rank), layer.in_full, g)
            else:
                a_full[layer.name] = None  # a target off (or experts off): exactly zero
            b_full[layer.name] = None
        rank, scale = hyper.rank, hyper.scale
        if init_from is not None:  # a local folder, or a folder of the storage (a verified copy of it)
            init_from = readable_folder(open_store(self.config.storage), init_from, legacy_marker=ADAPTER_CONFIG)
            if json_target_parameters(init_from) and not self.expert_layers:
                raise ValueError(f"init_from {init_from}: the adapter has expert LoRA (target_parameters) but "
                                 "this base has no expert layers with LoRA")
            expert_a, expert_b, expert_modules = read_expert_peft(init_from, self.base, self.expert_layers, hyper)
            trained = [layer for layer in self.dense_layers if layer_trained(layer, hyper)]
            peft_cfg, imported = read_peft_folder(init_from, self.base, trained, expert_modules,
                                                  untrained=[layer for layer in self.dense_layers if layer not in trained])
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
            if imported.base_output_weight is not None:  # HF peft saved the (tied) base lm_head with it
                if self.unembed is None:
                    raise ValueError(f"init_from {init_from}: the adapter targets lm_head but this trainer has no "
                                     f"LoRA on the output layer (trainer target_modules)")
                self.unembed.check_base_copy(imported.base_output_weight, str(init_from))
            rank = imported.rank
            a_full.update(imported.a_full | expert_a)
            b_full.update(imported.b_full | expert_b)
        self.buffers.zero_slot(slot)
        self.slots.write_full(slot, "weight", rank, a_full, b_full)
        self.slots.occupy(slot, SlotState(hyper=hyper, rank=rank, scale=scale, seed=seed, registration=registration))
        return self.slots.status(slot)

    def check_targets(self, hyper: SlotHyperParams) -> None:
        """ValueError unless every target group the slot asks for has LoRA layers in this trainer
        (TrainerConfig.target_modules: what slots MAY train)."""
        have = {target_group(layer.name) for layer in self.dense_layers}
        if self.expert_layers:
            have.add("mlp")
        missing = [t for t in hyper.targets if t not in have]
        if missing:
            raise ValueError(f"targets {missing} have no LoRA layers in this trainer (its target_modules are "
                             f"{list(self.config.target_modules)}); allowed targets here: "
                             f"{[t for t in TARGET_GROUPS if t in have]}")

    def clear_slot(self, slot: int) -> None:
        """Weights, gradients, optimizer state and pending samples of the slot, all gone."""
        self.slots.vacate(slot)

    @torch.no_grad()
    def reset_optimizer(self, slot: int) -> None:
        """Adam moments, update count and pending gradient of the slot to zero (weights kept)."""
        state = self.slot_state(slot)
        self.buffers.settle()
        idx = torch.tensor([slot], device=self.device)
        for t in (self.buffers.exp_avg, self.buffers.exp_avg_sq, self.buffers.grad):
            t.index_fill_(0, idx, 0.0)
        state.step, state.pending_samples = 0, 0
        state.pending = zero_stats()

    # -- training --------------------------------------------------------------------------------

    def train(self, batch: TrainBatch | None, riders: list[RiderSequence] | None = None) -> TrainResult:
        """Forward/backward the batch (one mixed pass per micro-batch); step every slot whose
        samples_per_step is reached. Collective: all ranks pass the same batch.

        ``riders`` (tenant-driven sequences, see RiderSequence) join the FIRST phase's packed
        micro-batches under the same token budget: one forward/backward over the union, their
        gradients accumulating in their own slots, which never step here. ``batch`` None: riders
        only (the Tinker forward_backward alone). Everything is validated before anything changes.
        Under DP the riders are shared out like the samples (batch.py ``rider_share``): each rank
        runs only its share's losses and its slots' gradient rows hold its part (summed over the
        ranks by the slot's adam_step)."""
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
        my_riders = [riders[k] for k in rider_share([r.slot for r in riders], self.layout.dp_rank, self.layout.dp_size)]
        lengths = [len(s.tokens) for s in samples]
        for phase in range(n_phases):
            in_phase = [p for p in planned if p.phase == phase]
            local = dp_shard(in_phase, self.layout.dp_rank, self.layout.dp_size)
            for mb, mb_riders in micro_batches(local, lengths, my_riders if phase == 0 else [], self.config):
                forward_backward(self.passes, self.slots, [samples[p.index] for p in mb], call_stats, mb_riders)
            due = []
            for slot in sorted({p.slot for p in in_phase}):
                state = self.slots[slot]
                state.pending_samples += sum(1 for p in in_phase if p.slot == slot)
                if state.pending_samples == state.hyper.samples_per_step:
                    due.append(slot)
            if due:
                states = [self.slots[slot] for slot in due]
                for slot, report in step_due_slots(self.buffers, due, states, self.layout, self.device,
                                                      self.step_overlap).items():
                    reports.setdefault(slot, []).append(report)
        if self.layout.dp_size > 1:
            stats_dev = call_stats.to(self.device)
            dist.all_reduce(stats_dev, group=dp_group())
            call_stats = stats_dev.cpu()
        metrics = {slot: slot_metrics(self.slots[slot], call_stats[slot], reports.get(slot, [])) for slot in slots_in_call}
        stepped = sorted(s for s, rs in reports.items() if any(not r.skipped_nonfinite for r in rs))
        skipped = sorted(s for s, rs in reports.items() if any(r.skipped_nonfinite for r in rs))
        return TrainResult(slots=metrics, stepped=stepped, skipped_nonfinite=skipped, dropped_foreign=dropped)

    def check_batch(self, batch: TrainBatch | None) -> None:
        """ValueError naming the first sample ``train`` would refuse (its slot is not initialized,
        or a token id is outside the vocabulary); nothing changes either way."""
        for i, s in enumerate(batch.samples if batch is not None else []):
            try:
                self.slot_state(s.slot)
            except ValueError as err:
                raise ValueError(f"sample {i}: {err}") from None
            if max(s.tokens) >= self.vocab_size:
                raise ValueError(f"sample {i}: token id {max(s.tokens)} >= vocab size {self.vocab_size}")

    def _check_riders(self, riders: list[RiderSequence], batch_slots: set[int]) -> None:
        """Riders need the packed path, initialized slots that the batch does not train (a loop
        slot never accumulates a rider's gradient), and one target per token."""
        if not riders:
            return
        if not self.config.packed:
            raise ValueError("riders need TrainerConfig.packed (fused or TransformerEngine layer spec)")
        for k, r in enumerate(riders):
            self.slot_state(r.slot)
            if r.slot in batch_slots:
                raise ValueError(f"rider {k}: slot {r.slot} is trained by the batch; a rider's slot must not be")
            if not r.tokens or len(r.targets) != len(r.tokens):
                raise ValueError(f"rider {k}: needs tokens and one target per token, got {len(r.tokens)} and {len(r.targets)}")

    # -- the Tinker primitives' two trainer calls (trainer/step/round_runner.py) -------------------------

    @torch.no_grad()
    def packed_lora_pass(self, sequences: list[list[int]], slot_ids: list[int], targets: list[list[int]]) -> torch.Tensor:
        """One packed stream with each sequence's slot LoRA on, no gradient: log p(targets[i][t] |
        sequences[i][:t+1]) for every position, as one fp32 [T] tensor in the given order.

        For tenant-driven forward calls (the Tinker API's ``forward``), whose targets are given
        per position; their forward_backward rides in ``train`` as RiderSequences. ``slot_ids``
        must be non-decreasing (each slot one contiguous segment). Collective over TP (same
        arguments on every rank of a TP group; under DP each group passes its own share);
        needs ``TrainerConfig.packed``."""
        if not self.config.packed:
            raise ValueError("packed_lora_pass needs TrainerConfig.packed (fused or TransformerEngine layer spec)")
        if any(a > b for a, b in zip(slot_ids, slot_ids[1:])):
            raise ValueError(f"slot_ids must be non-decreasing, got {slot_ids}")
        for s in set(slot_ids):
            self.slot_state(s)
        flat_targets = torch.tensor([t for seq in targets for t in seq], dtype=torch.long, device=self.device)
        self.routing.disable()
        try:
            return self.passes.stream_logprobs(sequences, slot_ids, flat_targets, lora=True)[0].float()
        finally:
            self.routing.disable()

    def adam_step_slot(self, slot: int, *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, max_grad_norm: float | None) -> dict:
        """The slot's accumulated gradient as is (under DP the sum of the ranks' parts), with
        per-call AdamW parameters (slot_steps.py adam_step). Collective over TP and DP."""
        return adam_step(self.buffers, slot, self.slot_state(slot), self.layout, self.device, lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
