"""The shared host arena (trainer/export/host_arena.py) and the export writer process
(trainer/export/export_process.py), on their own: real memfd mappings and a real child process, no
model. Independent references: safetensors' own save_file for the file bytes, and the arena's
free list against an explicit accounting of the blocks handed out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.waiting import wait_until
from trainer.export.export_process import WriterProcess, WriterProcessError
from trainer.export.host_arena import ALIGN, ArenaFull, HostArena
from trainer.export.peft_io import peft_config_text, write_peft_folder_packed
from trainer.export.safetensors_stream import file_order, packed_header
from tests.paths import REPO

pytestmark = pytest.mark.unit

DEADLINE_S = 30.0


def free_bytes(arena: HostArena) -> int:
    """The bytes of the arena's free list (read apart from its `used` count, which it must complement)."""
    with arena._cond:  # noqa: SLF001 - the arena's one lock over its free list
        return sum(n for _, n in arena._free)  # noqa: SLF001


def test_blocks_are_disjoint_aligned_and_their_room_comes_back_coalesced():
    arena = HostArena(10 * ALIGN)
    a, b, c = arena.alloc(1), arena.alloc(ALIGN + 1), arena.alloc(3 * ALIGN)
    assert [x.offset for x in (a, b, c)] == [0, ALIGN, 3 * ALIGN]  # first fit, page aligned
    assert arena.used == 6 * ALIGN and free_bytes(arena) == 4 * ALIGN
    b.release()
    assert arena.alloc(2 * ALIGN).offset == ALIGN  # b's room, reused
    a.release()
    c.release()
    with pytest.raises(RuntimeError, match="released twice"):
        c.release()
    assert free_bytes(arena) == 8 * ALIGN  # only the 2-page block is out
    assert not arena.fits(10 * ALIGN + 1)
    with pytest.raises(ArenaFull, match="does not fit"):
        arena.alloc(11 * ALIGN)


def test_a_block_views_the_shared_mapping_and_alloc_waits_for_room():
    arena = HostArena(4 * ALIGN)
    first = arena.alloc(3 * ALIGN)
    first.tensor.view(torch.int32)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert arena.tensor[: 16].view(torch.int32).tolist() == [1, 2, 3, 4]  # the block is the arena's memory
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("b", arena.alloc(2 * ALIGN)))
    waiter.start()
    wait_until(lambda: arena.waiters == 1, "the second alloc to wait for room", DEADLINE_S)
    assert "b" not in got
    first.release()
    waiter.join(DEADLINE_S)
    assert got["b"].offset == 0 and arena.wait_seconds > 0


def _packed(seed: int):
    """A small PEFT-like file: entries in file order, their data back to back, in bf16."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"base_model.model.x.lora_A.weight": (4, 16), "base_model.model.x.lora_B.weight": (16, 4),
              "base_model.model.y.lora_A.weight": (4, 8)}
    tensors = {k: torch.randn(*s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    names = file_order({k: (t.dtype, t.shape) for k, t in tensors.items()})
    body = torch.cat([tensors[k].reshape(-1) for k in names])
    header = packed_header([(k, tuple(tensors[k].shape)) for k in names], torch.bfloat16, metadata={"format": "pt"})
    return tensors, header, body


def test_the_process_writes_the_folder_the_thread_writes_from_the_arena(tmp_path):
    from safetensors.torch import save_file

    tensors, header, body = _packed(0)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["x", "y"]}
    arena = HostArena(16 * ALIGN)
    block = arena.alloc(body.numel() * body.element_size())
    block.tensor.view(torch.bfloat16).copy_(body)
    proc = WriterProcess(arena.fd, arena.nbytes)
    try:
        proc.write(str(tmp_path / "proc" / "v1"), header.raw, peft_config_text(config), block.offset, block.nbytes)
        write_peft_folder_packed(tmp_path / "thread", config, header, body)
        save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
        got = tmp_path / "proc" / "v1"
        assert (got / "adapter_model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
        assert (got / "adapter_config.json").read_text() == (tmp_path / "thread" / "adapter_config.json").read_text()
        assert json.loads((got / "adapter_config.json").read_text()) == config
        assert sorted(p.name for p in (tmp_path / "proc").iterdir()) == ["v1"]  # renamed into place, no temporary

        # a write that fails is reported with its reason; the process goes on
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        with pytest.raises(WriterProcessError, match="a-file"):
            proc.write(str(blocker / "v2"), header.raw, "{}", block.offset, block.nbytes)
        with pytest.raises(WriterProcessError, match="outside the"):
            proc.write(str(tmp_path / "v3"), header.raw, "{}", arena.nbytes - 8, 16)
        assert not (tmp_path / "v3").exists()
        pid = proc.pid
        proc.write(str(tmp_path / "proc" / "v4"), header.raw, peft_config_text(config), block.offset, block.nbytes)
        assert proc.pid == pid and proc.starts == 1

        # a process that died is started again for the next write (named fault: SIGKILL)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: proc.pid is None, "the killed writer process to be reaped", DEADLINE_S)
        proc.write(str(tmp_path / "proc" / "v5"), header.raw, peft_config_text(config), block.offset, block.nbytes)
        assert proc.starts == 2 and proc.pid not in (None, pid)
        assert (tmp_path / "proc" / "v5" / "adapter_model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    finally:
        proc.close()
    assert proc.pid is None


def test_the_writer_process_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, trainer.export.export_process; print('torch' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
