"""Engine scratch folders left by engines that never got their stop (rollout/engines/engine.py
sweep_stale_scratch): a killed coordinator's engines are reaped at the next start, but no stop removes
their folders in the system's temp dir. A start sweeps the folders whose owner process group is gone.

The owners here are real process groups (a Python process leading its own session, as an SGLang
server does); the folders are made in the test's own directory, not the shared temp dir.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.engines.engine import SCRATCH_OWNER, SCRATCH_PREFIX, sweep_stale_scratch

pytestmark = pytest.mark.unit


def owned_folder(root: Path, name: str, pgid: int | None) -> Path:
    folder = root / name
    (folder / "sockets").mkdir(parents=True)  # what SGLang leaves there: files and a folder
    (folder / "tmpabc").write_text("")
    if pgid is not None:
        (folder / SCRATCH_OWNER).write_text(str(pgid))
    return folder


def ended_group() -> int:
    """The pgid of a session leader that has exited (and was reaped): no process of its group is left."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    return proc.pid


def test_only_the_folders_of_ended_groups_are_swept(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True)
    try:
        stale = owned_folder(tmp_path, f"{SCRATCH_PREFIX}0-stale", ended_group())
        running = owned_folder(tmp_path, f"{SCRATCH_PREFIX}1-running", live.pid)
        unowned = owned_folder(tmp_path, f"{SCRATCH_PREFIX}2-starting", None)  # between its mkdtemp and its spawn
        other = owned_folder(tmp_path, "someone-else-0", ended_group())  # not an engine's
        assert sweep_stale_scratch(tmp_path) == [stale]
        assert not stale.exists() and running.is_dir() and unowned.is_dir() and other.is_dir()
        live.kill()
        live.wait()
        assert sweep_stale_scratch(tmp_path) == [running]  # its server ended without a stop: the next start sweeps it
        assert unowned.is_dir() and other.is_dir()
    finally:
        live.kill()
        live.wait()


def test_an_owner_file_that_is_not_a_pgid_keeps_its_folder(tmp_path):
    folder = owned_folder(tmp_path, f"{SCRATCH_PREFIX}0-odd", None)
    (folder / SCRATCH_OWNER).write_text("not a number")
    assert sweep_stale_scratch(tmp_path) == [] and folder.is_dir()
