"""The house rules issue 24 set, read from the source (AST; nothing is imported):

  * one owner of slot assignment: only the scheduler (service/scheduling/scheduler.py and its placement,
    service/scheduling/slot_moves.py) calls the registry's slot-changing
    methods (binding a queued run, giving a slot back, leasing and releasing a Tinker model's slot);
    registration's own pick of a free slot (`register`, the same FIFO rule) is the registry's;
  * nothing under api/ starts a thread or an executor (the Tinker face puts work on a tenant's
    queue; the scheduler's thread runs it), except api/server.py's one thread that serves HTTP;
  * nothing under api/ imports the trainer's running code (its core, round runner, actor, the trainer
    group); the in-process Tinker host of the tests (tests/tinker_in_process.py) is not product code;
  * no module of api/ service/ trainer/ rollout/ is over 500 lines, and no folder holds more than 15 modules
    (issue 43: folders by role a newcomer can read).
(Import circles and the other import rules: tests/unit/test_import_graph.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_import_graph import REPO, import_graph, module_files

pytestmark = pytest.mark.unit

SLOT_CHANGES = {"bind", "release_slot", "lease_slot", "release_lease"}
SLOT_OWNERS = ("service/scheduling/scheduler.py", "service/scheduling/slot_moves.py")
THREADS = {"Thread", "ThreadPoolExecutor", "ProcessPoolExecutor", "run_in_executor", "to_thread", "start_new_thread"}
HTTP_THREAD = "api/server.py"
TRAINER_RUNNING = {"trainer.core", "trainer.step.round_runner", "trainer.actor", "service.fleet.trainer_group"}
MAX_LINES = 500
MAX_MODULES_PER_FOLDER = 15


def _calls(path: Path, names: set[str]) -> list[str]:
    """`x.name(...)` / `name(...)` calls in the file whose callee's last name is one of `names`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in names:
                out.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return out


def test_only_the_scheduler_changes_slots():
    found = [c for mod, path in module_files(packages=("api", "service")).items() if not mod.startswith("service.registry.registry")
             for c in _calls(path, SLOT_CHANGES) if not c.startswith(SLOT_OWNERS)]
    assert found == [], f"slot assignment outside {SLOT_OWNERS}: {found}"
    assert all(_calls(REPO / owner, SLOT_CHANGES) for owner in SLOT_OWNERS), "the scheduler no longer changes slots: update this test"


def test_api_starts_no_thread_that_could_call_the_trainer():
    found = [c for mod, path in module_files(packages=("api",)).items() for c in _calls(path, THREADS)
             if not c.startswith(HTTP_THREAD)]
    assert found == [], found
    graph = import_graph(packages=("api", "service", "trainer", "rollout"))
    running = {m: sorted(deps & TRAINER_RUNNING) for m, deps in graph.items() if m.startswith("api")}
    assert {m: d for m, d in running.items() if d} == {}


def test_no_module_over_500_lines():
    big = {str(p.relative_to(REPO)): n for p in module_files().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, big


def test_no_folder_over_15_modules():
    from collections import Counter

    counts = Counter(str(p.parent.relative_to(REPO)) for p in module_files().values() if p.name != "__init__.py")
    assert {f: n for f, n in counts.items() if n > MAX_MODULES_PER_FOLDER} == {}


def test_the_actor_and_the_group_implement_the_one_trainer_interface():
    """trainer/interface.py's TrainerInterface: every method on the rank's actor body and on the trainer
    group, with the same parameters (names, order, defaults), so either can stand wherever the service
    holds a trainer."""
    import inspect

    from service.fleet.trainer_group import TrainerGroup
    from trainer.actor import TrainWorker
    from trainer.interface import TrainerInterface

    methods = [n for n, f in vars(TrainerInterface).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert "run_round" in methods and "swap_out" in methods
    for impl in (TrainWorker, TrainerGroup):
        for name in methods:
            want = inspect.signature(getattr(TrainerInterface, name))
            have = inspect.signature(getattr(impl, name))
            params = [(p.name, p.default) for p in have.parameters.values()]
            assert params[: len(want.parameters)] == [(p.name, p.default) for p in want.parameters.values()], (impl, name)
            assert all(p.default is not inspect.Parameter.empty for p in list(have.parameters.values())[len(want.parameters):])


def test_the_service_holds_the_trainer_typed():
    """No `trainer: Any` in service/: every holder of a trainer is typed against the interface (or the group)."""
    found = [f"{path.relative_to(REPO)}:{i}" for mod, path in module_files(packages=("service",)).items()
             for i, line in enumerate(path.read_text().splitlines(), 1) if "trainer: Any" in line]
    assert found == []
