"""A writer process for publish folders (issue 28: the writer off the GIL's path).

With `TrainerConfig.export_writer: process`, each of rank 0's writer threads
(trainer/export/export_writer.py) owns one of these processes and hands it one folder at a time: the
folder's path, the safetensors header, the adapter_config.json text, and where the file's data
lies in the shared host arena (trainer/export/host_arena.py). The process maps the arena itself (its
descriptor is passed at start), writes the file from it and renames the folder into place
(trainer/storage/folder_io.py, the same code the in-thread writer runs), then answers. The thread
meanwhile only waits on the pipe, without the GIL, so nothing of a write competes with the
trainer's main thread for it.

The process imports no torch (a few MB and a few ms to start), only this module and
trainer/storage/folder_io.py. Protocol: length-prefixed pickles of plain values over its stdin (requests)
and stdout (answers: None, or the error's type name and text).

Invariants:
* One request at a time per process: a thread sends a request and reads its answer before the
  next, so an answer always belongs to the request before it.
* A process that dies mid-write fails that write (its temporary folder is left for the
  publish-failure path: folder_io.remove_partial_writes) and is started again for the next one.
* The process exits when its stdin closes: when the trainer closes it, or when the trainer dies
  (no orphan outlives its rank).
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

from trainer.storage.folder_io import replace_folder_atomically, write_all

ADAPTER_CONFIG = "adapter_config.json"  # trainer/export/peft_io.py's names (that module imports torch)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LEN = struct.Struct("<Q")


class WriterProcessError(OSError):
    """A write the writer process reported as failed: the message names the error's type and text."""


def _send(f, obj) -> None:  # noqa: ANN001 - a binary pipe
    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    write_all(f, _LEN.pack(len(raw)) + raw)
    f.flush()


def _recv(f):  # noqa: ANN001, ANN202
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the pipe closed")
    n = _LEN.unpack(head)[0]
    raw = f.read(n)
    if len(raw) < n:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(raw)


def write_folder(folder: str, header: bytes, body, config_text: str) -> None:  # noqa: ANN001 - any buffer
    """The PEFT folder, whole or not at all: the weights file (header then body, one write each)
    and adapter_config.json (trainer/export/peft_io.py write_peft_folder_packed's layout)."""

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp / ADAPTER_WEIGHTS, "wb", buffering=0) as f:
            write_all(f, header)
            if len(body):
                write_all(f, body)
        (tmp / ADAPTER_CONFIG).write_text(config_text)

    replace_folder_atomically(write, folder)


class WriterProcess:
    """The trainer's end of one writer process over the arena whose memfd is `arena_fd` (size
    `arena_bytes`). Started on first use; `write` blocks until the process answered."""

    def __init__(self, arena_fd: int, arena_bytes: int) -> None:
        self.arena_fd = arena_fd
        self.arena_bytes = arena_bytes
        self._proc: subprocess.Popen | None = None
        self.starts = 0

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[1])  # the checkout holding trainer/: importable as it is here
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.export.export_process", str(self.arena_fd), str(self.arena_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(self.arena_fd,), env=env, cwd=root)
        self.starts += 1
        return self._proc

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._proc.poll() is not None else self._proc.pid

    def write(self, folder: str, header: bytes, config_text: str, offset: int, nbytes: int) -> None:
        """Write the folder from arena bytes [offset, offset + nbytes); raises WriterProcessError
        with the process's error, or RuntimeError if the process died (it restarts next time)."""
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
        try:
            _send(proc.stdin, (str(folder), bytes(header), config_text, int(offset), int(nbytes)))
            answer = _recv(proc.stdout)
        except (EOFError, BrokenPipeError, OSError) as e:
            code = proc.wait()
            self._proc = None
            raise RuntimeError(f"the export writer process exited (code {code}) while writing {folder}: {e}") from None
        if answer is not None:
            kind, text = answer
            raise WriterProcessError(f"{kind}: {text}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.stdin.close()  # it exits at the end of its input
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str]) -> int:
    """The process: map the arena, then write each requested folder from it until stdin closes."""
    fd, size = int(argv[0]), int(argv[1])
    arena = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    view = memoryview(arena)
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            folder, header, config_text, offset, nbytes = _recv(requests)
        except EOFError:
            return 0
        try:
            if offset < 0 or offset + nbytes > size:
                raise ValueError(f"arena range {offset}+{nbytes} is outside the {size}-byte arena")
            write_folder(folder, header, view[offset : offset + nbytes], config_text)
            _send(answers, None)
        except Exception as e:  # noqa: BLE001 - handed to the trainer, which raises it for this folder
            _send(answers, (type(e).__name__, str(e)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
