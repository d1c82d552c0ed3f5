"""Whole-or-nothing folders and complete writes: the file half of a publish export, with no torch
import, so the export writer process (trainer/export/export_process.py) can use it as it is.

Invariants:
* `replace_folder_atomically` shows a reader no folder or the whole one, never a part: the folder
  is written under a temporary sibling (`.<name>.writing-<pid>-<thread>`) and renamed into place.
* A writer killed mid-write leaves its temporary sibling behind; `remove_partial_writes` deletes
  those of one folder (the publish-failure path: rollout/engines/weights.py PendingFolder.ready).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replace_folder_atomically(write: Callable[[Path], Any], folder: str | Path) -> Path:
    """Run `write(tmp)` on a fresh temporary sibling of `folder`, then rename it to `folder` (an
    existing `folder` is replaced). A reader sees no folder or the whole one, never a part; the
    temporary is removed if the write fails."""
    dest = Path(folder)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{_partial_prefix(dest)}{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _partial_prefix(dest: Path) -> str:
    return f".{dest.name}.writing-"


def remove_partial_writes(folder: str | Path) -> None:
    """Delete what a write of `folder` left half done (a writer killed mid-write leaves its
    temporary sibling; a live writer removes its own): for a publish that failed."""
    dest = Path(folder)
    if dest.parent.is_dir():
        for tmp in dest.parent.glob(f"{_partial_prefix(dest)}*"):
            shutil.rmtree(tmp, ignore_errors=True)


def write_all(f, data) -> None:  # noqa: ANN001 - a raw (unbuffered) binary file, any buffer
    """All of `data` to `f`: FileIO.write may write less than asked (a signal, a full pipe; regular
    files rarely do). A memoryview of `data`, so nothing is copied in Python, and the GIL is
    released during each system call."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]
