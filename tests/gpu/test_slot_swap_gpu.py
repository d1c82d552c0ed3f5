"""GPU tier of the slot swap's row copies (trainer/swap/slot_swap.py): they wait for the current
stream only, and still hand back exactly the rows as the device's queued work left them.

* copy_rows_out after work queued on the current stream that changes the row (a long chain of
  in-place ops): the host rows equal the device rows after that work, bit for bit, while a large
  device->host copy on another stream (a publish snapshot's, trainer/export/peft_export.py) is in flight.
* copy_rows_in from pinned host rows that are overwritten as soon as it returns: the device rows
  hold the values given (the copy ended before it returned).

Skipped without CUDA (``LORAFLEET_GPU_TESTS_ON_CPU=1`` runs the same on the CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from trainer.lora.slot_buffers import BUFFER_KINDS
from trainer.swap.slot_swap import copy_rows_in, copy_rows_out

ON_CPU = os.environ.get("LORAFLEET_GPU_TESTS_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not ON_CPU, reason="needs a CUDA device"),
]
DEV = torch.device("cuda" if torch.cuda.is_available() and not ON_CPU else "cpu")
S, W = (4, 1 << 24) if DEV.type == "cuda" else (4, 1 << 12)


def _buffers() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    return {kind: torch.randn(S, W, generator=g).to(DEV) for kind in BUFFER_KINDS}


def _side_copy():
    """A large device->host copy on another stream, as a round's publish snapshots are."""
    if DEV.type != "cuda":
        return None
    big = torch.randn(1 << 28, device=DEV)  # 1 GiB
    host = torch.empty(big.shape, pin_memory=True)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        host.copy_(big, non_blocking=True)
    return big, host, side


def _queue_work(buffers: dict[str, torch.Tensor], slot: int, times: int = 200) -> None:
    """In-place elementwise ops queued on the current stream, each changing every element of the
    slot's rows (fp32 multiply and add: the same bits on the host and the device)."""
    for _ in range(times):
        for kind in BUFFER_KINDS:
            buffers[kind][slot].mul_(1.0001).add_(0.5)


def test_rows_out_are_the_rows_after_the_queued_work():
    buffers = _buffers()
    expected = {kind: buffers[kind][2].cpu() for kind in BUFFER_KINDS}
    for kind in BUFFER_KINDS:
        for _ in range(200):
            expected[kind].mul_(1.0001).add_(0.5)
    side = _side_copy()
    _queue_work(buffers, 2)
    out = copy_rows_out(buffers, 2)
    for kind in BUFFER_KINDS:  # compared at once, with no device sync in between
        assert torch.equal(out[kind], expected[kind]), kind
    if side is not None:
        side[2].synchronize()


def test_rows_in_are_copied_before_it_returns():
    buffers = _buffers()
    side = _side_copy()
    rows = {kind: torch.full((W,), 3.25, pin_memory=DEV.type == "cuda") for kind in BUFFER_KINDS}
    _queue_work(buffers, 0)  # the copies start only after this work: a missing wait would see the fill below
    copy_rows_in(buffers, 1, rows)
    for kind in BUFFER_KINDS:
        rows[kind].fill_(-1.0)  # the caller reuses its host memory at once
    for kind in BUFFER_KINDS:
        assert bool((buffers[kind][1] == 3.25).all()), kind
    if side is not None:
        side[2].synchronize()
