"""service/modes.py freeze_startup_objects: what a service process holds once up is left out of later
cyclic collections (gc.freeze), and what comes after is still collected. Run in a child process: a
freeze is for the life of the process, and pytest's own must not be frozen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.service_world import REPO

pytestmark = pytest.mark.unit

CHILD = """
import gc, json
from service.modes import freeze_startup_objects
before = gc.get_freeze_count()
held = [object() for _ in range(10)]  # tracked containers alive at the freeze: a list is tracked
freeze_startup_objects()
frozen = gc.get_freeze_count()
class Node:
    pass
gc.disable()  # no automatic pass finds them first: the explicit one below must
for _ in range(1000):  # cycles made after the freeze, then dropped: garbage a full pass must still find
    a, b = Node(), Node()
    a.other, b.other = b, a
del a, b
found = gc.collect()
gc.enable()
print(json.dumps({"before": before, "frozen": frozen, "found": found, "tracked_after": len(gc.get_objects())}))
"""


def test_what_is_held_at_the_freeze_is_left_out_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["frozen"] - got["before"] > 50_000, got  # the imports (service, pydantic, ...) and `held`
    assert got["found"] >= 2000, got  # 1,000 cycles of two Nodes made after the freeze
    assert got["tracked_after"] < got["frozen"] / 10, got  # a full pass now walks only what came after
