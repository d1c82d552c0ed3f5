"""Writes `top_level.txt` for every installed distribution that lacks one, with exactly what
`importlib.metadata` infers for it, so no process has to infer it again.

Why: transformers calls `importlib.metadata.packages_distributions()` when it is imported
(transformers/utils/import_utils.py). For a distribution without `top_level.txt` (91 of the
245 in this venv) Python 3.12 infers its top-level names from its RECORD, and first checks that
every file listed there exists: about 46,000 `stat` calls, 1.3 s on a 2-core machine, in every
process that imports transformers (the service, each trainer rank, each engine, each recipe a
test runs). Declared names are read from one small file instead.

The result is checked: `packages_distributions()` after the write must equal the one before,
mapping for mapping; if it does not, the written files are removed again and the set-up goes on
(only slower). Idempotent: a distribution that has `top_level.txt` is left alone.

Run with the venv's interpreter (deploy/setup.sh does).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path


def _inferred(dist: md.Distribution) -> list[str]:
    # importlib.metadata._top_level_inferred, spelled out: a RECORD path's first part, or a
    # top-level file's module name; names with a dot are not importable.
    import inspect

    names = set()
    for f in dist.files or ():
        name = f.parts[0] if len(f.parts) > 1 else inspect.getmodulename(str(f))
        if name and "." not in name:
            names.add(name)
    return sorted(names)


def _mapping() -> dict[str, list[str]]:
    return {pkg: sorted(dists) for pkg, dists in md.packages_distributions().items()}


def main() -> int:
    todo = [(Path(dist._path) / "top_level.txt", names) for dist in md.distributions()
            if dist.read_text("top_level.txt") is None and getattr(dist, "_path", None) is not None
            and (names := _inferred(dist))]
    before = _mapping() if todo else {}  # the check's reference, only when something is written (a second run: nothing)
    for target, names in todo:
        target.write_text("\n".join(names) + "\n")
    if todo and _mapping() != before:
        for target, _ in todo:
            target.unlink(missing_ok=True)
        print("[setup] warning: recorded top-level names changed packages_distributions(); removed them again",
              file=sys.stderr)
        return 0
    print(f"[setup] recorded the top-level names of {len(todo)} distributions (importlib.metadata's inference, once)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
