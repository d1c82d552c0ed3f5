"""benchmarks/stack_profile.py: py-spy's raw stacks of a live process, read back as self and
inclusive shares (the benchmarks' --profile-dir)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.stack_profile import StackProfiles, top_inclusive, top_self

SPINNER = "def spin():\n    print('spinning', flush=True)\n    while True:\n        sum(range(1000))\n\nspin()\n"


def test_raw_stacks_read_back_as_self_and_inclusive_shares(tmp_path):
    raw = tmp_path / "x.txt"
    raw.write_text("main (a.py:1);loop (a.py:5);work (b.py:9) 30\nmain (a.py:1);loop (a.py:5) 10\nmain (a.py:1);idle (c.py:2) 60\n")
    assert top_self(raw) == [("idle (c.py:2)", 0.6), ("work (b.py:9)", 0.3), ("loop (a.py:5)", 0.1)]
    assert top_inclusive(raw, "a.py") == [("main (a.py:1)", 1.0), ("loop (a.py:5)", 0.4)]


def test_a_live_process_is_sampled_where_it_spins(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"  # its interpreter is up: py-spy can attach
        profiles = StackProfiles(tmp_path, "w", {"spinner": child.pid}, seconds=2, rate=50)
        profiles.wait()
    finally:
        child.kill()
        child.wait()
    top = top_self(profiles.paths["spinner"])
    assert top and top[0][0].startswith("spin (<string>:") and top[0][1] > 0.9
