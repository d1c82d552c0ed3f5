"""The optimizer step on a CUDA stream of its own, layer by layer, under the next forward.

Why: AdamW over the stepping slots' rows is memory-bound at the HBM's rate (32 bytes per LoRA
parameter: about 7 ms a round at 8 MoE slots of the Qwen3-30B-A3B shape, 28 ms at 32, 7 ms at 64
dense slots of the 1.7B shape), and on the main stream nothing else runs while it does. The
next call's forward needs the new weights of layer 0 first and of the output layer last, and
its GEMMs are compute-bound: so the step runs here on its own stream, one launch per decoder
layer in forward order (the output layer's LoRA last), each followed by an event, and each LoRA
layer's forward waits only for its own layer's event (``wait``). Layer 0's forward starts once
layer 0's rows are updated, while later layers' rows still are.

Invariants:
* Every element is updated by the same kernel (triton_adamw.adamw_rows, or adamw_rows_compact for
  the slots with bfloat16 moments: one launch per state dtype per layer, the layer's event after
  both) with the same factors as the whole-row launch, once: results are bit-identical with and
  without the overlap (the compact state's rounding is elementwise: compact_state.py).
* Every LoRA layer's forward waits for its layer's launch before it reads its weights
  (MultiLoraLinear.forward, UnembedLora.forward and .logit_lora, MoeLoraLayer.forward). The
  backward follows the whole forward, so it never accumulates into a gradient row the step is
  still reading or zeroing.
* Every other reader or writer of the slot buffers makes its stream wait for the whole step
  first (``settle``: SlotBuffers' accessors, reset_optimizer). These are device-side waits: the
  host never blocks on them.
* The export's gathers read the rows on the step stream itself, behind the step (``behind_step``):
  the service publishes every stepped adapter every round, and a gather on the main stream would
  make the next forward wait for the whole step. ``settle`` then also waits for those reads, so a
  later writer of the rows (a slot cleared, loaded, swapped) cannot overwrite what they still read.
* What the step stream reads and allocates per step (the factor table, the slot ids) is
  allocated on the step stream, so the caching allocator cannot hand its memory to the main
  stream while the step still reads it; both are copied from the host before the first launch
  (a pageable copy makes the host wait for the stream: never between launches).
Without CUDA, without Triton or with ``TrainerConfig.overlap_step`` off, ``apply`` is the
whole-row update on the current stream and ``wait`` / ``settle`` do nothing. A step smaller than
``min_params`` LoRA parameters also runs in order, after the last overlapped one: with little to
hide, the launches per layer and the contention with the forward cost more than they save
(measured, TrainerConfig.overlap_step_min_params).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator

import torch

from trainer.kernels import triton_adamw
from trainer.optim.compact_state import as_int32
from trainer.optim.per_slot_optim import AdamwColumns, adamw_apply

_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def decoder_index(name: str) -> float:
    """The decoder layer a LoRA module belongs to, by its Megatron name (``decoder.layers.3.
    self_attention.linear_qkv`` -> 3); anything else (the output layer) comes after them all."""
    found = _DECODER_LAYER.search(name)
    return int(found.group(1)) if found else float("inf")


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open column ranges sorted, with touching ones joined (fewer, longer blocks)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def plan_chunks(names: list[str], columns: list[list[tuple[int, int]]]) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Group the LoRA layers (``names``, each with its column ranges in a slot row) by decoder
    layer, in forward order. Returns each chunk's merged column ranges and each layer's chunk."""
    keys = sorted({decoder_index(n) for n in names})
    index = {k: i for i, k in enumerate(keys)}
    chunk_of = [index[decoder_index(n)] for n in names]
    ranges: list[list[tuple[int, int]]] = [[] for _ in keys]
    for chunk, cols in zip(chunk_of, columns):
        ranges[chunk] += cols
    return [merged(r) for r in ranges], chunk_of


class StepOverlap:
    """The trainer's optimizer step, overlapped with the next forward on CUDA (module doc)."""

    def __init__(self, layers: list, buffers, device: torch.device, *, enabled: bool,  # noqa: ANN001 - SlotBuffers
                 min_params: int = 0) -> None:
        self.device = device
        self.min_params = min_params
        self.active = bool(enabled and device.type == "cuda" and triton_adamw.available(buffers.weight))
        ranges, chunk_of = plan_chunks([layer.name for layer in layers], buffers.layer_columns())
        self._chunk_of = {id(layer): c for layer, c in zip(layers, chunk_of)}
        self.chunks = [triton_adamw.BlockTable(r, device) for r in ranges] if self.active else []
        self.stream = torch.cuda.Stream(device) if self.active else None
        self._events: list[torch.cuda.Event | None] = [None] * len(ranges)
        self._last: torch.cuda.Event | None = None
        self.delay_cycles = 0  # tests only: a spin of this many GPU cycles before the step's launches
        for layer in layers:
            layer.step_overlap = self if self.active else None

    def apply(self, buf, slots: list[int], make_cols: Callable[[], AdamwColumns]) -> None:  # noqa: ANN001 - SlotBuffers
        """AdamW on rows ``slots`` with the factors ``make_cols()`` builds (on the device it is
        called for); their gradient rows are left zero."""
        if not self.active or not self.chunks or len(slots) * buf.weight.shape[1] < self.min_params:
            self.settle()
            adamw_apply(buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq, slots, make_cols(), buf.compact_moments)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients, the norms
        with torch.cuda.stream(self.stream):
            launches = self._launches(buf, slots, make_cols())
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            for k, blocks in enumerate(self.chunks):
                for launch in launches:
                    launch(blocks)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._events[k] = event
        self._last = event

    def _launches(self, buf, slots: list[int], cols: AdamwColumns) -> list[Callable[[triton_adamw.BlockTable], None]]:  # noqa: ANN001 - SlotBuffers
        """One kernel launch per state dtype among the stepping ``slots`` (float32 rows, bfloat16
        rows: compact_state.py), each a function of the block table; their slot ids, factors and
        rounding keys are copied to the device here, once, on the current stream."""
        out = []
        for dtype, ids, group in cols.state_groups(slots):
            dev_ids = torch.tensor(ids, dtype=torch.int32, device=self.device)
            coef = group.kernel_table()
            if dtype == "float32":
                out.append(functools.partial(triton_adamw.adamw_rows, buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq,
                                             dev_ids, coef))
            else:
                keys = torch.tensor([as_int32(k) for k in group.noise_keys], dtype=torch.int32, device=self.device)
                out.append(functools.partial(triton_adamw.adamw_rows_compact, buf.weight, buf.grad, buf.compact_moments,
                                             dev_ids, coef, keys))
        return out

    def wait(self, layer) -> None:  # noqa: ANN001 - a LoRA layer of the trainer
        """Make the current stream wait until ``layer``'s rows of the last step are written."""
        event = self._events[self._chunk_of[id(layer)]]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def settle(self) -> None:
        """Make the current stream wait until the last step is written in full."""
        if self._last is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last)

    @contextlib.contextmanager
    def behind_step(self) -> Iterator[None]:
        """Run the block's device work on the step stream after the last step (reads of the slot
        rows the main stream need not wait for: the export's gathers and the event after them),
        once the main stream's work so far is done too. Without a step on the step stream: the
        current stream, as it is. Called in the order of the trainer's calls, as ``apply`` is (the
        rank's one default-group thread): the last event recorded on the step stream is ``_last``."""
        if self._last is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # rows the main stream wrote since
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            event = torch.cuda.Event()
            event.record(self.stream)
            self._last = event  # settle waits for these reads too

    def pending(self) -> bool:
        """Whether the last step is still running on the device (tests, benchmarks)."""
        return self._last is not None and not self._last.query()
