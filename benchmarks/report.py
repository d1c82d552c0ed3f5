"""A benchmark's result: printed as JSON, and written to `--out` when given (one format for every script)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: object, out: str | Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
