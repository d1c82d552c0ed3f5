"""Plant ownership bugs in the Tinker routes (and numeric bugs in server-side custom losses) and watch
tests/integration/test_tinker_calls.py catch each one.

    PYTHONPATH=. .venv/bin/python -m tests.integration.isolation_plants                  # every plant
    PYTHONPATH=. .venv/bin/python -m tests.integration.isolation_plants finish_any_owner  # one

Two kinds of plant:
* runtime: the product function is replaced, in the test process only, by a copy with the bug (this
  module is loaded as a pytest plugin, ``-p tests.integration.isolation_plants``, and patches at
  configure time when ``LORAFLEET_PLANT`` names the plant): for files other engineers edit too, whose
  text is never rewritten here;
* text: one exact piece of a product file of this work rewritten, the tests run, the file put back as it
  was (also when interrupted).
A plant that no test catches is printed as SURVIVED and the exit status is 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastapi import HTTPException

from tests.paths import REPO

ROOT = REPO
TESTS = "tests/integration/test_tinker_calls.py"
ISOLATION = f"{TESTS}::test_isolation_table"
PUBLISHING = f"{TESTS}::test_publish_share_copy_and_unpublish"
CUSTOM = f"{TESTS}::test_custom_loss_server_side_equals_client_side"
SESSIONS, LOSSES = "api/tinker/sessions.py", "api/tinker/custom_losses.py"


# -- runtime plants (shared files: api/tinker/service.py, api/tinker/checkpoints/runs.py) ---------------


def _finish_any_owner() -> None:
    """finish_session checks that the session exists, not that the caller owns it (the bug issue 42 names)."""
    from api.tinker.service import TinkerService

    async def finish_session(self, tenant, session_id, reason=None, detail=None):  # noqa: ANN001, ANN202
        if session_id not in self.sessions:
            raise HTTPException(404, f"unknown session {session_id}")
        for m in [m for m in self.models.values() if m.session_id == session_id]:
            self._unload(m, self.futures.create(m.tenant, m.model_id))
        del self.sessions[session_id]
        self.records.end_session(session_id, reason, detail)

    TinkerService.finish_session = finish_session


def _readable_unpublished() -> None:
    """A checkpoint of another tenant is readable whether published or not."""
    from api.tinker.checkpoints.runs import TrainingRuns

    def readable(self, tenant, run_id, kind, name):  # noqa: ANN001, ANN202
        rows = self.records._read("SELECT * FROM tinker_checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                                  (run_id, kind, name))
        return (rows[0]["tenant"], rows[0]) if rows else None

    TrainingRuns.readable = readable


def _publish_by_anyone() -> None:
    """publish/unpublish act on the checkpoint of that path whoever owns it."""
    from api.tinker.checkpoints.runs import TrainingRuns

    original = TrainingRuns.set_public

    def set_public(self, tenant, run_id, kind, name, public):  # noqa: ANN001, ANN202
        rows = self.records._read("SELECT tenant FROM tinker_checkpoints WHERE run_id = ?", (run_id,))
        return original(self, rows[0]["tenant"] if rows else tenant, run_id, kind, name, public)

    TrainingRuns.set_public = set_public


RUNTIME = {
    "finish_any_owner": (_finish_any_owner, [ISOLATION]),
    "readable_unpublished": (_readable_unpublished, [ISOLATION, PUBLISHING]),
    "publish_by_anyone": (_publish_by_anyone, [ISOLATION, PUBLISHING]),
}

# -- text plants (files of this work) --------------------------------------------------------------------

TEXT = {
    "session_get_any_tenant": ([(SESSIONS, "row = records.session_of(t, session_id)",
                                 "row = next(iter(records._read('SELECT * FROM tinker_sessions WHERE session_id = ?', "
                                 "(session_id,))), None)")], [ISOLATION], "get_session reads any tenant's session"),
    "join_any_tenant": ([(SESSIONS, "service.sampler.session(t, body.sampling_session_id) is None",
                          "body.sampling_session_id not in service.sampler.sessions")], [ISOLATION],
                        "join_sampling_session joins any tenant's sampling session"),
    "custom_loss_any_owner": ([(LOSSES, "return (cached[1], cached[2]) if cached[0] == tenant else None",
                                "return (cached[1], cached[2])"),
                               (LOSSES, "if found is None or found[0] != session_id:", "if found is None:")], [ISOLATION],
                              "a forward_backward runs any tenant's custom loss"),
    "custom_mean_as_sum": ([("trainer/losses/custom_graph.py", 'out[key] = total / n if key.endswith(":mean") else total',
                             "out[key] = total")], [CUSTOM], "a :mean metric summed, not averaged"),
    "custom_sub_gradient": ([("trainer/losses/custom_ops.py", '"operator.sub": operator.sub,',
                              '"operator.sub": lambda a, b: a - (b.detach() if isinstance(b, torch.Tensor) else b),')],
                            [CUSTOM], "a - b differentiated in a only (the values unchanged, the gradient not)"),
    "custom_inputs_unchecked": ([("trainer/step/custom_calls.py", "    loss.check_datum(n, inputs)\n", "")], [CUSTOM],
                                "a datum the loss cannot read reaches the pass"),
}


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook: the runtime plant of this process
    name = os.environ.get("LORAFLEET_PLANT")
    if name in RUNTIME:
        RUNTIME[name][0]()


def run(name: str) -> bool:
    """Plant ``name``, run its tests in a subprocess, restore; True when caught."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    saved: dict[Path, str] = {}
    try:
        if name in RUNTIME:
            tests = RUNTIME[name][1]
            env["LORAFLEET_PLANT"] = name
            args += ["-p", "tests.integration.isolation_plants"]
        else:
            edits, tests, _ = TEXT[name]
            for rel, old, new in edits:
                path = ROOT / rel
                saved.setdefault(path, path.read_text())
                current = path.read_text()
                if current.count(old) != 1:
                    raise SystemExit(f"{name}: the text to plant is not in {rel} exactly once (the code moved?)")
                path.write_text(current.replace(old, new))
        proc = subprocess.run([*args, *tests], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        for path, text in saved.items():
            path.write_text(text)
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:1]
    print(f"{name:26s} {'caught' if proc.returncode else 'SURVIVED'}  {failed[0][:150] if failed else ''}", flush=True)
    return proc.returncode != 0


def main(argv: list[str]) -> int:
    names = argv or [*RUNTIME, *TEXT]
    unknown = [n for n in names if n not in RUNTIME and n not in TEXT]
    if unknown:
        raise SystemExit(f"unknown plants {unknown}: choose from {', '.join([*RUNTIME, *TEXT])}")
    return 0 if all([run(n) for n in names]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
