"""A round of keyed background exports never waits for room in the host arena (issue 28), on the
real trainer of the tiny world with the unembedding LoRA on, over the real BackgroundExports
(real writer threads and processes, the real arena, the real folders).

Why this is a test of the sizing: the arena is sized by `BackgroundExports.size_for` to hold one
snapshot of every slot plus one per writer thread. In steady state that is exactly what a round
needs when every writer thread is in the middle of a folder of the round before (being written:
never superseded, its block held) and the round's new snapshots each take a block. The writer is
made slow here by a gate before the real write (each writer thread takes a job, counts it as
being written, and waits at the gate), so the round finds the arena in that worst state on
purpose. Measured on one H200 before the fix (8B, 64 slots, docs/benchmarks-history.md): 57 ms of the
68.8 ms export call waited for room, because a snapshot (the PEFT file: q/k/v and gate/up each
carry a copy of their fused linear's one A) is larger than the buffer row it is gathered from,
and the arena was planned per row."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer_probes import use_export_writer
from tests.waiting import wait_until
from trainer.export.export_writer import Superseded
from trainer.export.host_arena import block_bytes
from trainer.export.peft_export import ExportRequest

pytestmark = pytest.mark.unit

DEADLINE_S = 60.0
SLOTS, MAX_RANK = 4, 8
# per slot: the largest file (max rank, every target) twice, then smaller layouts beside it
TARGETS = [("attention", "mlp", "unembed"), ("attention", "mlp", "unembed"), ("attention", "mlp"), ("unembed",)]
RANKS = [MAX_RANK, MAX_RANK, MAX_RANK, 2]


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer

    t = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=SLOTS, max_rank=MAX_RANK,
                                       micro_batch_tokens=48, export_writer_threads=1))
    for slot in range(SLOTS):
        t.init_slot(slot, SlotHyperParams(rank=RANKS[slot], alpha=16.0, targets=TARGETS[slot]), seed=slot)
    return t


def _gated(bg):
    """Make `bg`'s writer slow: each writer thread takes a job (being written from then on) and waits
    at the gate before the real write. Before the writer exists, so its threads call this."""
    gate, started = threading.Event(), []
    real = bg._write

    def write(folder, snap):  # noqa: ANN001
        started.append(folder)
        gate.wait(DEADLINE_S)
        real(folder, snap)

    bg._write = write
    return gate, started


def _round(trainer, root, r: int) -> list[ExportRequest]:
    return [ExportRequest(k, str(root / f"r{r}" / f"s{k}"), key=f"slot{k}") for k in range(SLOTS)]


def _export_round(trainer, requests) -> dict:
    """The round's export call on a thread of its own (it would wait for room forever behind the
    gate); returns once it returned or once it waits for room, and says which."""
    bg = trainer.export.background
    done = threading.Event()
    call = threading.Thread(target=lambda: (trainer.export.export_peft_in_background_many(requests, dtype="bfloat16"),
                                            done.set()), daemon=True)
    call.start()
    wait_until(lambda: done.is_set() or bg.room_waiters, "the export call to return or wait", DEADLINE_S)
    return {"returned": done.is_set(), "waiting": bg.room_waiters, "thread": call}


@pytest.mark.parametrize("kind", ["thread", "process"])  # the second reuses the first's arena (use_export_writer)
def test_a_keyed_round_never_waits_while_every_writer_is_mid_folder(trainer, kind, tmp_path):
    ex = trainer.export
    use_export_writer(ex, kind, threads=1, max_pending_bytes=4096)  # the arena is then what size_for plans
    bg = ex.background
    gate, started = _gated(bg)
    calls = []
    try:
        first = _round(trainer, tmp_path, 0)
        for r in (0, 1, 2):  # from round 1 on r0/s0 is being written (its block held); each round supersedes the last's queued ones
            calls.append(_export_round(trainer, first if r == 0 else _round(trainer, tmp_path, r)))
            assert calls[-1]["returned"], f"round {r} waited for room: {calls[-1]} {bg.room_report()}"
            if r == 0:
                wait_until(lambda: started, "the writer thread to take r0/s0 and stop at the gate", DEADLINE_S)
                assert started == [first[0].folder]
        assert bg.arena.wait_seconds == 0.0 and bg.writer.room_wait_seconds == 0.0 and bg.room_wait_count == 0
        assert bg.writer.superseded == 3 + SLOTS  # r0's queued three, then all of r1
        # the plan: slots + threads blocks of the largest file's size; the writer's bound no lower
        assert bg.planned_block == block_bytes(ex.largest_file_elems() * 2)
        assert bg.arena.nbytes == (SLOTS + bg.threads) * bg.planned_block and bg.writer.max_pending_bytes >= bg.arena.nbytes
    finally:  # a failure leaves nothing in flight for the next case
        gate.set()
        for c in calls:
            c["thread"].join(DEADLINE_S)
        wait_until(lambda: bg.writer.pending() == 0, "the writer to drain", DEADLINE_S)
    last = _round(trainer, tmp_path, 2)
    assert [ex.wait_export(q.folder) for q in last] == [q.folder for q in last]
    assert ex.wait_export(first[0].folder) == first[0].folder
    assert all(isinstance(ex.wait_export(q.folder), Superseded) for q in first[1:] + _round(trainer, tmp_path, 1))
    wait_until(lambda: bg.arena.used == 0, "every block back after its write", DEADLINE_S)
    for q in last:  # what was written is the slot's file as the synchronous export writes it
        ex.export_peft(q.slot, tmp_path / "sync" / f"s{q.slot}", dtype="bfloat16")
        got, want = (load_file(f"{d}/adapter_model.safetensors") for d in (q.folder, tmp_path / "sync" / f"s{q.slot}"))
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert any("lm_head" in k for k in got) == ("unembed" in TARGETS[q.slot])


def test_the_arena_is_planned_by_the_largest_file_not_by_the_buffer_row(trainer):
    """The plan's block is the largest file's (max rank, every target: export_layout's own index
    says how large), which is larger than the row it is gathered from; every slot's file fits it."""
    from trainer.config import TARGET_GROUPS, SlotHyperParams

    ex = trainer.export
    largest = ex.export_layout(MAX_RANK, SlotHyperParams(rank=MAX_RANK, targets=TARGET_GROUPS)).index.numel()
    assert ex.largest_file_elems() == largest
    assert largest > ex.buffers.weight.shape[1]  # tiny world: 48,768 against a 42,624-wide row (8B: 87.3 against 78.1 MB)
    for slot in range(SLOTS):
        state = trainer.slots.state(slot)
        assert ex.export_layout(state.rank, state.hyper).index.numel() <= largest
