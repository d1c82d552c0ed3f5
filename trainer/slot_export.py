"""A slot as a PEFT adapter: its snapshot, the export layout, and the folder's write (in order, or
in the background on rank 0's writer threads, trainer/export_writer.py).

Every method is collective over TP (all ranks call it with the same arguments); rank 0 writes.
Invariant: a snapshot is a fresh tensor taken in call order, never a view of the live weights,
so a later step cannot change what an export writes.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.base_model import FrozenBase
from trainer.config import SlotHyperParams, TrainerConfig
from trainer.distributed import ParallelLayout, tp_group
from trainer.export_writer import ExportLayout, ExportWriter, PeftSnapshot, export_dtype, pinned_host_copy, replace_folder_atomically
from trainer.moe_peft import expert_peft_tensors, expert_target_parameters
from trainer.peft_io import hf_short_names, peft_config_dict, slot_to_hf, write_peft_folder_packed
from trainer.safetensors_stream import file_order
from trainer.slots import SlotTable, layer_trained, trains_experts


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
        self._writer: ExportWriter | None = None  # rank 0's background writer (export_peft_in_background)
        self._writer_lock = threading.Lock()  # the writer is made by whichever thread asks first
        self._copy_stream = None  # CUDA stream of the snapshots' device->host copies (snapshot_peft)
        self._layouts: dict[tuple, ExportLayout] = {}  # export_layout's cache

    @torch.no_grad()
    def snapshot_peft(self, slot: int, *, to_host: bool = True, dtype: str = "float32") -> PeftSnapshot:
        """The slot's weights as they are now, as the data of its PEFT safetensors file, in
        ``dtype`` (an EXPORT_DTYPES name: a publish folder in the engines' dtype): the in-order
        half of an export.

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
        state = self.slots.state(slot)
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
        layout = self.export_layout(state.rank, state.hyper)
        cfg = peft_config_dict(rank=state.rank, scale=state.scale, target_modules=layout.target_modules,
                               base_model=self.config.base_model_path, target_parameters=layout.target_parameters)
        body = row.index_select(0, layout.index)
        copied = None
        if self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            body, copied = pinned_host_copy(body, self._copy_stream)
        return PeftSnapshot(config=cfg, entries=layout.entries, body=body, header=layout.header(to), copied=copied)

    def export_layout(self, rank: int, hyper: SlotHyperParams) -> ExportLayout:
        """Where each element of a PEFT file's data comes from in a snapshot's row (the row cast,
        TP-split columns of every TP rank first, then the replicated ones), for slots of LoRA rank
        ``rank``. Built by taking apart a row of positions (0, 1, 2, ...) instead of weights with
        the same functions the weights would go through (row_views, assemble_a/b, slot_to_hf,
        expert_peft_tensors): the layout is by construction the one they define, and a gather by
        it does all their copies and permutations in one kernel. With it, the PEFT config's module
        lists (Bridge's name mappings: about 0.2 ms per layer, so worth computing once). Cached
        per (rank, what the slot trains): only the layers of its targets are in the file (the others
        are zero by the slot invariant, trainer/slots.py)."""
        key = (rank, hyper.targets, trains_experts(hyper))
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

    def export_peft(self, slot: int, out_dir: str | Path, *, dtype: str = "float32") -> str:
        """Write the slot as a PEFT adapter folder in ``dtype`` (rank 0 writes; all ranks must call).
        Synchronous: when it returns the folder is written. float32 (the weights as trained) unless
        told: checkpoints and retire exports keep every bit; only publish folders take the engines' dtype."""
        writes = self.layout.rank == 0
        snap = self.snapshot_peft(slot, to_host=writes, dtype=dtype)
        if writes:
            _write_peft(out_dir, snap)
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
                self.writer().fail(out_dir, e)  # its waiter raises this instead of waiting forever
            raise
        if writes:
            self.writer().submit(out_dir, snap, snap.nbytes)
        return out_dir

    def wait_export(self, out_dir: str | Path) -> str:
        """Block until the background export to ``out_dir`` is written; raises its error (a failed
        snapshot or write). Safe to call from another thread than the one that queued it, and
        before it is queued. Ranks other than 0 write nothing and return at once."""
        if self.layout.rank != 0:
            return str(out_dir)
        return self.writer().wait(str(out_dir))

    def writer(self) -> ExportWriter:
        """This rank's writer thread (started on first use)."""
        with self._writer_lock:
            if self._writer is None:
                self._writer = ExportWriter(_write_snapshot, threads=self.config.export_writer_threads)
            return self._writer


def _write_snapshot(out_dir: str, snap: PeftSnapshot) -> None:
    replace_folder_atomically(lambda tmp: _write_peft(tmp, snap), out_dir)


def _write_peft(out_dir: str | Path, snap: PeftSnapshot) -> None:
    """The snapshot's folder: its header and packed data in one write, and the config."""
    snap.ready()
    write_peft_folder_packed(out_dir, snap.config, snap.header, snap.body)
