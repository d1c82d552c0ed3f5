"""Shared pieces of the tests that run `lorafleet run` as a subprocess (the main job, the MoE job):
how the CLI is started, a working folder whose engines are reaped even on failure, and read-only
queries of the registry the job leaves behind."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The same entry point as the console script, independent of how the venv's launcher was generated.
LORAFLEET = [sys.executable, "-m", "api.cli.main"]


def rows(db: Path, sql: str, *args) -> list[sqlite3.Row]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        con.row_factory = sqlite3.Row
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


@contextmanager
def reaped_job_dir(folder: Path, state_subdir: str) -> Iterator[Path]:
    """`folder` as the job's working folder; the SGLang engines of its state dir
    (`runs/<state_subdir>`) are reaped when the test ends, even on failure."""
    from service.fleet.engine_pids import reap_engines

    try:
        yield folder
    finally:
        reap_engines(folder / "runs" / state_subdir)


def check_exports_load_with_peft(model_dir: Path, exports: dict[str, str]) -> None:
    """Every export loads in peft over the base, gives finite logits and changes the base's output."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 27, 377, 28, 23, 260, 276, 2]])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = base(ids).logits
    for name, path in exports.items():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), path)
        with torch.no_grad():
            logits = model(ids).logits
        assert torch.isfinite(logits).all(), name
        assert (logits - ref).abs().max() > 1e-3, f"{name}: the export does not change the base model's output"
