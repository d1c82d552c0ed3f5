#!/usr/bin/env bash
# One-command set-up: creates .venv (Python 3.12) and installs lorafleet with the
# whole stack (torch, SGLang, Megatron-core, Megatron-Bridge, Ray, FastAPI, ...),
# then builds the embedded tiny world into .cache/.
#
# Why not a plain `pip install -e .`:
#   * megatron-bridge's wheel requires CUDA-only source packages (mamba-ssm,
#     transformer-engine, ...) that cannot build here; it must go in with --no-deps.
#   * the resolved set is pinned in deploy/requirements.lock (verified together),
#     so a fresh machine gets exactly what the tests passed with.
#   * the test dependency tinker-cookbook 0.6.1 (the field's recipes, run unmodified against a
#     live service by tests/integration/test_cookbook_recipes.py) requires tml-renderers>=0.4.1,
#     which the package registry does not have (0.2.1 at most), so pip cannot resolve it. The
#     cookbook imports tml_renderers only for the Inkling and Kimi K3 tokenizers, which no test
#     uses; the lock keeps sglang's own pin (tml-renderers==0.1.0) and the cookbook with its
#     other requirements, and --no-deps installs them as they are. `pip check` then reports that
#     one requirement ("tinker-cookbook 0.6.1 has requirement tml-renderers>=0.4.1") beside
#     megatron-bridge's.
# Idempotent: a stamp records the hash of the inputs; a second run with the same
# inputs only checks the venv imports and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
LOCK="$ROOT/deploy/requirements.lock"
STAMP="$VENV/.lorafleet-setup-stamp"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

log() { printf '[setup] %s\n' "$*"; }

find_python312() {
  # An explicit choice first, then PATH, then pyenv's install (its shim answers
  # "command not found" when 3.12 is installed but not selected).
  local c
  for c in "${LORAFLEET_PYTHON:-}" python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$c" || echo "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      [ -x "$c" ] && { echo "$c"; return 0; }
    done
  fi
  return 1
}

PY=$(find_python312) || {
  echo "[setup] error: no Python 3.12 found. Set LORAFLEET_PYTHON=/path/to/python3.12, put python3.12 on PATH, or 'pyenv install 3.12'." >&2
  exit 1
}
log "python: $PY ($("$PY" --version 2>&1))"

# Debian's chromium drives the dashboard's browser test (tests/integration/test_dashboard_browser.py,
# headless). Installed here when missing and this runs as root with apt-get; otherwise a note says
# how. A failed install does not stop the set-up (only that test needs it).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing chromium (headless browser for the dashboard test)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
      log "warning: 'apt-get install chromium' failed; the dashboard browser test will fail until it is installed"
  else
    log "note: chromium is missing; as root, 'apt-get install -y chromium' (needed by the dashboard browser test)"
  fi
fi

inputs_hash=$(cat "$0" "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ]; then
  log "venv up to date ($VENV); nothing to install"
else
  [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
  log "installing pinned stack from deploy/requirements.lock (first run: several minutes, ~11 GB)"
  # --no-deps: the lock is the complete, verified set; pip's resolver would
  # otherwise try to build megatron-bridge's CUDA-only requirements.
  "$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"
  # setuptools comes from the lock, so the editable install needs no build environment.
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  echo "$inputs_hash" > "$STAMP"
fi

# transformers infers every distribution's top-level names at import, 1.3 s in each process: record them once
"$VENV/bin/python" deploy/record_top_levels.py
log "checking imports"
"$VENV/bin/python" -W ignore - <<'PY'
import importlib
for m in ("torch", "sglang", "megatron.core", "ray", "fastapi", "transformers", "peft", "trainer", "rollout", "service", "api",
          "tinker", "tinker_cookbook", "pyrage"):
    importlib.import_module(m)
print("[setup] imports ok")
PY
log "building the embedded tiny world"
"$VENV/bin/python" -m examples.tiny.build --quiet
"$VENV/bin/python" -m examples.tiny_moe.build --quiet
log "done: activate with 'source .venv/bin/activate' or use .venv/bin/lorafleet"
