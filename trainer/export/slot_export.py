"""A slot as a PEFT adapter: its snapshot, the export layout, and the folder's write (in order, or
in the background on rank 0's writers: trainer/export/peft_export.py, trainer/export/export_writer.py).

Every method is collective over TP (all ranks call it with the same arguments); rank 0 writes.
Invariants: a snapshot is a fresh tensor taken in call order, never a view of the live weights,
so a later step cannot change what an export writes; background exports are latest-wins per
key (a queued, unwritten export is superseded by a newer one of its key: export_writer.py).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from trainer.storage.locations import open_store
from trainer.base.base_model import FrozenBase
from trainer.config import TARGET_GROUPS, SlotHyperParams, TrainerConfig
from trainer.platform.distributed import ParallelLayout, tp_group
from trainer.export.export_writer import ExportLayout, ExportWriter, PeftSnapshot, Superseded, export_dtype, pinned_host_copy
from trainer.export.moe_peft import expert_peft_tensors, expert_target_parameters
from trainer.export.peft_export import BackgroundExports, ExportRequest, chunks, gather_bodies, make_snapshots, write_peft_snapshot
from trainer.export.peft_io import hf_short_names, peft_config_dict, slot_to_hf
from trainer.export.safetensors_stream import file_order
from trainer.lora.slots import SlotTable, layer_trained, trains_experts


def layout_key(rank: int, hyper: SlotHyperParams) -> tuple:
    """What decides a slot's export layout: its LoRA rank and what it trains (its target groups,
    and whether it trains the routed experts). Slots with equal keys share one layout."""
    return (rank, hyper.targets, trains_experts(hyper))


class SlotExporter:
    def __init__(self, base: FrozenBase, slots: SlotTable, dense_layers: list, expert_layers: list,
                 layout: ParallelLayout, config: TrainerConfig) -> None:
        self.base = base
        self.slots = slots
        self.buffers = slots.buffers
        self.dense_layers = dense_layers
        self.expert_layers = expert_layers
        self.layout = layout
        self.config = config
        self.device = base.device
        self._background: BackgroundExports | None = None  # rank 0's background writing (export_peft_in_background)
        self._background_lock = threading.Lock()  # made by whichever thread asks first
        self._layouts: dict[tuple, ExportLayout] = {}  # export_layout's cache, by layout_key
        self._largest_file_elems: int | None = None  # largest_file_elems' cache

    @torch.no_grad()
    def snapshot_peft(self, slot: int, *, to_host: bool = True, dtype: str = "float32") -> PeftSnapshot:
        """The slot's weights as they are now, as the data of its PEFT safetensors file, in
        ``dtype`` (an EXPORT_DTYPES name): the in-order half of a synchronous export.

        The whole slot is one row of the slot buffers (slot_buffers.py). The snapshot casts that
        row, under TP all-gathers its TP-split columns into place, and gathers it by the export
        layout's index (export_layout) into the file's data: every PEFT tensor back to back in
        file order, q/k/v split and permuted, experts in PEFT's layout (peft_export.gather_bodies,
        the same gather as a background export). A fresh tensor, never a view of the live
        weights, so a later step cannot change it. On CUDA it then goes to fresh pinned host
        memory by one non-blocking copy on the rank's copy stream, behind one event
        (`PeftSnapshot.ready` waits for it). ``to_host=False``: a rank that writes nothing takes
        part in the gather only."""
        state = self.slots.state(slot)
        to = export_dtype(dtype)
        layout = self.export_layout(state.rank, state.hyper)
        with self.buffers.behind_step():  # the copy's wait on the gather too (step_overlap.py)
            bodies = self._gather([slot], layout, to, gather_only=not to_host)
            if bodies is None:  # this rank's part was the gather
                return PeftSnapshot(config={}, entries=[], body=None)
            body, copied = bodies[0], None
            if self.device.type == "cuda":
                body, copied = pinned_host_copy(body, self.background.copy_stream)
        return PeftSnapshot(config=self._peft_config(state, layout), entries=layout.entries, body=body,
                            header=layout.header(to), copied=copied)

    def _gather(self, slots: list[int], layout: ExportLayout, to: torch.dtype, *, gather_only: bool) -> torch.Tensor | None:
        """The file data of ``slots``; call under ``buffers.behind_step()`` (the last optimizer step
        may still be writing the rows: the gather runs behind it on its stream, step_overlap.py)."""
        tp = self.layout.tp_size
        return gather_bodies(self.buffers.weight, slots, layout.index, to, tp=tp, split=self.buffers.split_cols,
                             group=tp_group() if tp > 1 else None, gather_only=gather_only)

    def _peft_config(self, state, layout: ExportLayout) -> dict:  # noqa: ANN001 - a trainer.lora.slots SlotState
        return peft_config_dict(rank=state.rank, scale=state.scale, target_modules=layout.target_modules,
                                base_model=self.config.base_model_path, target_parameters=layout.target_parameters)

    def export_layout(self, rank: int, hyper: SlotHyperParams) -> ExportLayout:
        """Where each element of a PEFT file's data comes from in a snapshot's row (the row cast,
        TP-split columns of every TP rank first, then the replicated ones), for slots of LoRA rank
        ``rank``. Built by taking apart a row of positions (0, 1, 2, ...) instead of weights with
        the same functions the weights would go through (row_views, assemble_a/b, slot_to_hf,
        expert_peft_tensors): the layout is by construction the one they define, and a gather by
        it does all their copies and permutations in one kernel. With it, the PEFT config's module
        lists (Bridge's name mappings: about 0.2 ms per layer, so worth computing once). Cached
        per (rank, what the slot trains): only the layers of its targets are in the file (the others
        are zero by the slot invariant, trainer/lora/slots.py)."""
        key = layout_key(rank, hyper)
        layout = self._layouts.get(key)
        if layout is None:
            tp, split = self.layout.tp_size, self.buffers.split_cols
            positions = torch.arange(tp * split + self.buffers.weight.shape[1] - split, dtype=torch.int64)
            dense, experts = self._trained(hyper)
            tensors = self._peft_from_row(positions, tp, rank, dense, experts)
            names = file_order({k: (torch.float32, t.shape) for k, t in tensors.items()})  # one dtype: by name
            index = torch.cat([tensors[k].reshape(-1) for k in names])
            small = index.numel() < 2**31 and positions.numel() < 2**31  # int32 indices: half the memory
            layout = ExportLayout(entries=[(k, tuple(tensors[k].shape)) for k in names],
                                  index=index.to(torch.int32 if small else torch.int64).to(self.device),
                                  target_modules=hf_short_names(self.base, dense),
                                  target_parameters=expert_target_parameters(experts))
            if len(self._layouts) >= 8:  # a few distinct ranks in practice; bound the device memory anyway
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def largest_file_elems(self) -> int:
        """Elements of the largest PEFT file any slot of this trainer can have: the trainer's max rank,
        every target (routed experts too): a file's tensors only grow with the rank and the targets.
        What the host arena is planned by (BackgroundExports.size_for): a file is larger than the
        buffer row it is gathered from (q/k/v and gate/up each carry a copy of their fused linear's
        one A), so a row's width would plan too little. Taken apart on the meta device: the shapes
        of export_layout's tensors, with no memory and no index."""
        if self._largest_file_elems is None:
            tp, split = self.layout.tp_size, self.buffers.split_cols
            row = torch.empty(tp * split + self.buffers.weight.shape[1] - split, dtype=torch.int64, device="meta")
            rank = self.config.max_rank
            dense, experts = self._trained(SlotHyperParams(rank=rank, targets=TARGET_GROUPS, lora_experts=True))
            self._largest_file_elems = sum(t.numel() for t in self._peft_from_row(row, tp, rank, dense, experts).values())
        return self._largest_file_elems

    def _trained(self, hyper: SlotHyperParams) -> tuple[list, list]:
        """(dense layers, expert layers) a slot with ``hyper`` trains: what its PEFT folder holds."""
        return ([layer for layer in self.dense_layers if layer_trained(layer, hyper)],
                [layer for layer in self.expert_layers if layer_trained(layer, hyper)])

    def _peft_from_row(self, row: torch.Tensor, tp: int, rank: int, dense: list, experts: list) -> dict[str, torch.Tensor]:
        """PEFT-named TP=1 tensors of the ``dense`` and ``experts`` layers of a slot's row (TP-split
        columns of each TP rank in rank order, then the replicated): views where the layout allows,
        else copies. No collective."""
        split = self.buffers.split_cols
        blocks = self.buffers.row_views(list(row[: tp * split].view(tp, split)), row[tp * split :])
        a_full, b_full = {}, {}
        for layer, a_shards, b_shards in zip(self.slots.layers, blocks[0::2], blocks[1::2]):
            a_full[layer.name] = layer.assemble_a([layer.a_block(x.unsqueeze(0), 0, rank) for x in a_shards])
            b_full[layer.name] = layer.assemble_b([layer.b_block(x.unsqueeze(0), 0, rank) for x in b_shards])
        return slot_to_hf(self.base, dense, a_full, b_full) | expert_peft_tensors(self.base, experts, a_full, b_full)

    @staticmethod
    def peft_from_snapshot(snap: PeftSnapshot) -> tuple[dict, dict[str, torch.Tensor]]:
        """(adapter_config dict, PEFT-named tensors in the snapshot's dtype): views of its data."""
        snap.ready()
        tensors, offset = {}, 0
        for name, shape in snap.entries:
            n = math.prod(shape)
            tensors[name] = snap.body[offset : offset + n].view(shape)
            offset += n
        return snap.config, tensors

    def peft_tensors(self, slot: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """(adapter_config dict, PEFT-named tensors) of the slot, as SGLang/peft load them."""
        return self.peft_from_snapshot(self.snapshot_peft(slot))

    def export_peft(self, slot: int, out_dir: str | Path, *, dtype: str = "float32", durable: bool = True) -> str:
        """Write the slot as a PEFT adapter folder in ``dtype`` (rank 0 writes; all ranks must call).
        Synchronous: when it returns the folder is written. float32 (the weights as trained) unless
        told: checkpoints and retire exports keep every bit; only publish folders take the engines' dtype.
        ``durable=False``: committed without waiting for the disk (trainer/storage/store.py S5)."""
        writes = self.layout.rank == 0
        snap = self.snapshot_peft(slot, to_host=writes, dtype=dtype)
        if writes:  # committed whole in the trainer's store (trainer/storage/store.py)
            with open_store(self.config.storage).write_folder(out_dir, durable=durable) as tmp:
                write_peft_snapshot(tmp, snap)
        return str(out_dir)

    # Background export (issues 18, 28): the snapshot in call order, the write off the critical path.
    def export_peft_in_background(self, slot: int, out_dir: str | Path, *, dtype: str = "float32", key: str | None = None) -> str:
        """Snapshot the slot now in ``dtype`` (collective, before any later call changes its weights) and queue
        the folder's write on this rank's writer (rank 0; trainer/export/export_writer.py); returns at once
        unless the host arena is full. `wait_export(out_dir)` waits for the write. The folder
        appears whole (written under a temporary name, then renamed). ``key``: latest-wins (a
        queued, unwritten export of the same key is superseded by this one, never written)."""
        self.export_peft_in_background_many([ExportRequest(slot, str(out_dir), key)], dtype=dtype)
        return str(out_dir)

    @torch.no_grad()
    def export_peft_in_background_many(self, requests: list[ExportRequest], *, dtype: str = "float32") -> list[str]:
        """Background exports of several slots in one call (a round's stepped slots): the snapshots
        batched by export layout (trainer/export/peft_export.py: one cast per slot, one index_select per
        chunk of slots, one copy per slot into the shared host arena, one event per chunk, no
        synchronization with the device), then the writes queued in request order. Every rank
        gets the same requests. A request whose slot is not in use fails the whole call before
        any collective; a failure part-way fails every export not yet queued (their
        `wait_export` raises it)."""
        to = export_dtype(dtype)
        requests = [ExportRequest(r.slot, str(r.folder), r.key) for r in requests]
        background = self.background if self.layout.rank == 0 else None
        queued: set[str] = set()
        try:
            states = [self.slots.state(r.slot) for r in requests]
            tp, split = self.layout.tp_size, self.buffers.split_cols
            width = tp * split + self.buffers.weight.shape[1] - split  # a gathered row (a file may be larger: largest_file_elems)
            if background is not None:  # a round never waits for room: planned by the largest file, not the row
                background.size_for(self.largest_file_elems() * to.itemsize, self.config.num_slots)
                background.supersede_all(requests)  # before taking host memory: a superseded export frees its block
            by_layout: dict[tuple, list[int]] = {}  # slots of one export layout (rank and targets) batch together
            for i, state in enumerate(states):
                by_layout.setdefault(layout_key(state.rank, state.hyper), []).append(i)
            for members in by_layout.values():
                first = states[members[0]]
                layout = self.export_layout(first.rank, first.hyper)
                for part in chunks(len(members), width, layout.index.numel(), to.itemsize):
                    batch = [members[i] for i in part]
                    with self.buffers.behind_step():  # the gather and the copies' event after it
                        bodies = self._gather([requests[i].slot for i in batch], layout, to, gather_only=background is None)
                        if background is None:
                            continue
                        hosts, blocks, done = background.to_host(bodies)
                    configs = [self._peft_config(states[i], layout) for i in batch]
                    sub = [requests[i] for i in batch]
                    background.submit(sub, make_snapshots(hosts, blocks, done, configs, layout.entries, layout.header(to)))
                    queued.update(r.folder for r in sub)
        except BaseException as e:
            if background is not None:  # their waiters raise this instead of waiting forever
                background.fail_all([r for r in requests if r.folder not in queued], e)
            raise
        return [r.folder for r in requests]

    def wait_export(self, out_dir: str | Path) -> str | Superseded:
        """Block until the background export to ``out_dir`` is written (returns the folder) or
        superseded (returns a Superseded: never written); raises its error (a failed snapshot or
        write). Safe to call from another thread than the one that queued it, and before it is
        queued. Ranks other than 0 write nothing and return at once."""
        if self.layout.rank != 0:
            return str(out_dir)
        return self.writer().wait(str(out_dir))

    @property
    def background(self) -> BackgroundExports:
        """This rank's background writing (the writer, the host arena, the copy stream), made on first use."""
        with self._background_lock:
            if self._background is None:
                self._background = BackgroundExports(device=self.device, threads=self.config.export_writer_threads,
                                                     kind=self.config.export_writer)
            return self._background

    def writer(self) -> ExportWriter:
        """This rank's writer (its threads start on first use)."""
        return self.background.writer
