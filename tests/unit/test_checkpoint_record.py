"""Issue 14 F9: a run's record names its checkpoint by path AND step, written together from one
source (the committed checkpoint's RunState). The real Controller and FleetRuntime over the fake
trainer (tests/fleet_fakes.py), as tests/unit/test_runtime.py.

Before the fix, a graceful retire wrote the final checkpoint's path (step-000002) but left
checkpoint_step at the last periodic checkpoint's step (1): the record said step 1 next to a
step-2 folder. The registry also let a late, older report replace a newer checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.registry.registry import AdapterState as S
from tests.unit.test_runtime import fleet, job, one_step, sft  # noqa: F401 (fixtures)

pytestmark = pytest.mark.unit


def _folder_step(path: str) -> int:
    return json.loads((Path(path) / "run_state.json").read_text())["step"]


def test_retire_records_the_final_checkpoint_with_its_own_step(fleet):
    controller, runtime, _, _, data = fleet
    ref = controller.register("a", sft(data))
    controller.reconcile()
    one_step(controller, runtime, ref.registration_id)
    controller.record_checkpoint(ref.registration_id, runtime.checkpoint(ref.registration_id), 1)  # periodic, step 1
    one_step(controller, runtime, ref.registration_id)  # step 2, no checkpoint due
    controller.retire("a")
    controller.reconcile()
    done = controller.get("a")
    assert done.state == S.COMPLETED and done.step == 2
    assert done.checkpoint_path.endswith("step-000002")
    assert done.checkpoint_step == _folder_step(done.checkpoint_path) == 2, (done.checkpoint_step, done.checkpoint_path)


def test_checkpoint_path_and_step_are_one_update(fleet):
    controller, runtime, _, _, data = fleet
    ref = controller.register("b", sft(data))
    controller.reconcile()
    one_step(controller, runtime, ref.registration_id)
    one_step(controller, runtime, ref.registration_id)
    newer = runtime.checkpoint(ref.registration_id)
    controller.record_checkpoint(ref.registration_id, newer, 2)
    controller.record_checkpoint(ref.registration_id, newer.replace("step-000002", "step-000001"), 1)  # late, older
    got = controller.get("b")
    assert (got.checkpoint_path, got.checkpoint_step) == (newer, 2)
    with pytest.raises(ValueError, match="path and its step together"):
        controller.registry.transition(ref.registration_id, S.RETIRING, checkpoint_path=newer)
    assert controller.get("b").state == S.ACTIVE  # refused: nothing changed
