"""trainer/export/peft_export.py on the CPU without a model: the batched gather against a per-slot
reference written from its definition (each slot's row, cast, indexed by the layout), the chunking,
and BackgroundExports end to end with both writer kinds (real threads, real writer processes, the
real arena): the folders are byte-equal to the in-process writer's, every arena block comes back
once its write ended, and a superseded export's block comes back at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.trainer_probes import hold_writer
from tests.waiting import wait_until
from trainer.export.export_writer import Superseded
from trainer.export.peft_export import CHUNK_BYTES, BackgroundExports, ExportRequest, chunks, gather_bodies, make_snapshots
from trainer.export.peft_io import write_peft_folder_packed
from trainer.export.safetensors_stream import packed_header

pytestmark = pytest.mark.unit

DEADLINE_S = 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[1, 2, 3], [4, 0, 2]])
def test_the_batched_gather_is_each_rows_cast_then_indexed(dtype, slots):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 40, generator=g)
    index = torch.randperm(40, generator=g)[:29].to(torch.int32)  # a layout: some positions, permuted
    got = gather_bodies(weight, slots, index, dtype)
    want = torch.stack([weight[s].to(dtype)[index.long()] for s in slots])
    assert got.dtype == dtype and torch.equal(got, want)
    assert gather_bodies(weight, slots, index, dtype, gather_only=True) is None


def test_chunks_cover_every_slot_within_the_byte_budget():
    parts = chunks(5, 2**28, 2**27, 2)  # 768 MiB of temporaries per slot: one slot per 1 GiB chunk
    assert [list(p) for p in parts] == [[0], [1], [2], [3], [4]]
    parts = chunks(7, 2**26, 2**26, 2)  # 256 MiB per slot: four per chunk
    assert [list(p) for p in parts] == [[0, 1, 2, 3], [4, 5, 6]] and CHUNK_BYTES == 4 * 2**28
    parts = chunks(10, 1000, 500, 2)
    assert [list(p) for p in parts] == [list(range(10))]  # small adapters: one chunk


def _entries():
    return [("base_model.model.a.lora_A.weight", (4, 8)), ("base_model.model.a.lora_B.weight", (8, 4))]


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_background_exports_write_what_the_in_process_writer_writes(kind, tmp_path: Path):
    entries = _entries()
    header = packed_header(entries, torch.bfloat16, metadata={"format": "pt"})
    bodies = torch.randn(3, 64).to(torch.bfloat16)
    config = {"r": 4, "lora_alpha": 8}
    bg = BackgroundExports(device=torch.device("cpu"), threads=2, kind=kind, max_pending_bytes=1 << 20)
    try:
        hold_writer(bg.writer, True)
        hosts, blocks, done = bg.to_host(bodies)
        assert done == [None] * 3 and all(b is not None for b in blocks) and bg.arena.used == 3 * 4096
        requests = [ExportRequest(i, str(tmp_path / "bg" / f"v{i}"), key="same" if i < 2 else None) for i in range(3)]
        bg.supersede_all(requests)  # nothing queued yet: no effect
        bg.submit(requests, make_snapshots(hosts, blocks, done, [config] * 3, entries, header))
        # v0 and v1 share a key: v0 was superseded by v1 at submission, its block is back at once
        assert bg.writer.superseded == 1 and bg.arena.used == 2 * 4096
        hold_writer(bg.writer, False)
        assert bg.writer.wait(requests[0].folder) == Superseded(requests[0].folder, by=requests[1].folder)
        assert [bg.writer.wait(r.folder) for r in requests[1:]] == [r.folder for r in requests[1:]]
        wait_until(lambda: bg.arena.used == 0, "every block back after its write", DEADLINE_S)
        for i in (1, 2):
            write_peft_folder_packed(tmp_path / "ref" / f"v{i}", config, header, bodies[i].clone())
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                assert (tmp_path / "bg" / f"v{i}" / name).read_bytes() == (tmp_path / "ref" / f"v{i}" / name).read_bytes()
        assert not (tmp_path / "bg" / "v0").exists()
        assert len(bg.processes) == (0 if kind == "thread" else len({p.pid for p in bg.processes}))
    finally:
        bg.close()


def test_a_snapshot_larger_than_the_arena_gets_private_memory_and_is_written_in_the_thread(tmp_path: Path):
    entries = [("base_model.model.a.lora_A.weight", (4, 2048))]
    header = packed_header(entries, torch.bfloat16)
    bodies = torch.randn(1, 8192).to(torch.bfloat16)  # 16 KiB > the 8 KiB arena
    bg = BackgroundExports(device=torch.device("cpu"), threads=1, kind="process", max_pending_bytes=8192)
    try:
        hosts, blocks, done = bg.to_host(bodies)
        assert blocks == [None] and bg.arena.used == 0
        request = ExportRequest(0, str(tmp_path / "big"))
        bg.submit([request], make_snapshots(hosts, blocks, done, [{"r": 4}], entries, header))
        assert bg.writer.wait(request.folder) == request.folder
        assert bg.processes == []  # a writer process can only read the arena
        write_peft_folder_packed(tmp_path / "ref", {"r": 4}, header, bodies[0].clone())
        assert (tmp_path / "big" / "adapter_model.safetensors").read_bytes() == (tmp_path / "ref" / "adapter_model.safetensors").read_bytes()
    finally:
        bg.close()


def test_switching_writers_is_refused_while_exports_are_pending(tmp_path: Path):
    bg = BackgroundExports(device=torch.device("cpu"), threads=1, kind="thread", max_pending_bytes=1 << 16)
    entries = _entries()
    header = packed_header(entries, torch.bfloat16)
    hold_writer(bg.writer, True)
    hosts, blocks, done = bg.to_host(torch.zeros(1, 64, dtype=torch.bfloat16))
    bg.submit([ExportRequest(0, str(tmp_path / "v0"))], make_snapshots(hosts, blocks, done, [{"r": 4}], entries, header))
    with pytest.raises(RuntimeError, match="still queued"):
        bg.with_writer("process", 2)
    hold_writer(bg.writer, False)
    bg.writer.wait(str(tmp_path / "v0"))
    new = bg.with_writer("process", 2)
    assert new.arena is bg.arena and new.kind == "process" and new.threads == 2
    with pytest.raises(ValueError, match="'thread' or 'process'"):
        BackgroundExports(device=torch.device("cpu"), threads=1, kind="fork")
    new.close()


def test_with_latest_wins_a_round_of_every_slot_never_waits_for_room(tmp_path: Path):
    """size_for: the arena holds one snapshot per slot plus one per writer thread (module docstring).
    With the writer held, three rounds of 8 keyed exports queue: each round supersedes the last
    before taking memory, so no allocation waits; keyless exports get the bound back (they wait)."""
    entries = _entries()
    header = packed_header(entries, torch.bfloat16)
    slots, threads = 8, 2
    bg = BackgroundExports(device=torch.device("cpu"), threads=threads, kind="thread", max_pending_bytes=4096)
    bg.size_for(64 * 2, slots)
    assert bg.arena.nbytes == (slots + threads) * 4096 and bg.writer.max_pending_bytes == bg.arena.nbytes

    def round_of(r: int, keyed: bool) -> list[ExportRequest]:
        requests = [ExportRequest(k, str(tmp_path / f"r{r}" / f"s{k}"), key=f"slot{k}" if keyed else None) for k in range(slots)]
        bg.supersede_all(requests)
        hosts, blocks, done = bg.to_host(torch.full((slots, 64), float(r), dtype=torch.bfloat16))
        bg.submit(requests, make_snapshots(hosts, blocks, done, [{"r": 4}] * slots, entries, header))
        return requests

    hold_writer(bg.writer, True)
    try:
        rounds: list = []
        keyed = threading.Thread(target=lambda: rounds.extend(round_of(r, keyed=True) for r in range(3)), daemon=True)
        keyed.start()
        keyed.join(DEADLINE_S)
        assert not keyed.is_alive() and len(rounds) == 3  # it would wait for room forever with the writer held
        assert bg.arena.waiters == 0 and bg.arena.wait_seconds == 0.0
        assert bg.writer.superseded == 2 * slots and bg.arena.used == slots * 4096
        blocked = threading.Thread(target=lambda: (round_of(3, keyed=False), round_of(4, keyed=False)), daemon=True)
        blocked.start()  # keyless: only 2 of round 3's 8 fit beside round 2's queued 8
        wait_until(lambda: bg.arena.waiters == 1, "a keyless round to wait for room", DEADLINE_S)
    finally:
        hold_writer(bg.writer, False)
    blocked.join(DEADLINE_S)
    assert not blocked.is_alive()
    for r in rounds[:2]:
        assert all(isinstance(bg.writer.wait(q.folder), Superseded) for q in r)
    assert [bg.writer.wait(q.folder) for q in rounds[2]] == [q.folder for q in rounds[2]]
    for r in (3, 4):
        for k in range(slots):
            bg.writer.wait(str(tmp_path / f"r{r}" / f"s{k}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2", "r3", "r4"]  # r0 and r1 were never written
    bg.close()


def test_every_planned_snapshot_takes_the_planned_block_so_a_mix_of_layouts_cannot_fragment_the_arena():
    """size_for plans 3 blocks of the largest file (4 pages; 2 slots + 1 writer thread). Slots of a
    smaller layout (3 pages) still take 4: so with one snapshot being written and one of this round
    taken, the third always fits. Were blocks their own size, this sequence (first fit) leaves 3 + 2
    free pages around the written one, and the big snapshot would wait with 5 pages free."""
    bg = BackgroundExports(device=torch.device("cpu"), threads=1, kind="thread", max_pending_bytes=4096)
    bg.size_for(4 * 4096, slots=2)
    small = torch.zeros(1, 3 * 4096 // 2, dtype=torch.bfloat16)  # a smaller rank's file: 3 pages
    big = torch.zeros(1, 4 * 4096 // 2, dtype=torch.bfloat16)  # the largest: 4 pages
    (_, [a], _), (_, [b], _), (_, [c], _) = bg.to_host(small), bg.to_host(small), bg.to_host(big)
    assert bg.arena.nbytes == 3 * bg.planned_block == 3 * 4 * 4096 and {x.size for x in (a, b, c)} == {bg.planned_block}
    a.release(), b.release()  # written or superseded; c is being written
    _, [d], _ = bg.to_host(small)  # this round's first
    assert bg.arena.room_for(big.numel() * 2, reserve=bg.planned_block), bg.room_report(big.numel() * 2)
    _, [e], _ = bg.to_host(big)
    assert bg.room_wait_count == 0 and bg.arena.blocks == 3
    for x in (c, d, e):
        x.release()
    assert bg.arena.used == 0
    bg.close()
