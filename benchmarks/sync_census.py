"""Where a round waits for the device: every host-device synchronisation, counted by call site.

torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at each operation
that makes the host wait for the GPU (``.item()``, ``.tolist()``, ``nonzero``, a device-to-host
copy, ``bincount`` on CUDA...). Each warning is attributed here to the innermost frames of the
repository that led to it, so a round's syncs read as a table of sites and counts. A sync per
layer shows as a count equal to the number of layers (per micro-batch).

Used by the step benchmarks with ``--profile-out`` (issue 28: at N = 1 the MoE round left the
device idle while the host caught up after each sync). CUDA only; on the CPU it returns {}.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable

import torch

_REPO_DIRS = (f"{os.sep}trainer{os.sep}", f"{os.sep}benchmarks{os.sep}")


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if any(d in f.filename for d in _REPO_DIRS)]
    frames = [f for f in frames if not f.filename.endswith("sync_census.py")]
    if not frames:
        return "(outside the repository)"
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-3:]))


def census(fn: Callable[[], object]) -> dict[str, int]:
    """Run ``fn`` once with sync warnings on; {call site: syncs}, the most frequent first."""
    if not torch.cuda.is_available():
        return {}
    sites: Counter[str] = Counter()

    def hook(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if "synchroniz" in str(message).lower():
            sites[_site()] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites.most_common())


def sync_sites(trainer, batch, folder: str, tag: str) -> dict[str, int]:  # noqa: ANN001 - MultiLoraTrainer, TrainBatch
    """Syncs of one mixed round (``trainer.train``) and one frozen-base round by call site, written
    to ``folder/syncs_<tag>.json``; prints the counts and the top sites; returns the counts."""
    import json

    from benchmarks.trainer_floor import frozen_base_pass

    out = {"mixed": census(lambda: trainer.train(batch)), "base": census(lambda: frozen_base_pass(trainer, batch))}
    with open(os.path.join(folder, f"syncs_{tag}.json"), "w") as f:
        json.dump(out, f, indent=1)
    for name, sites in out.items():
        top = "; ".join(f"{k} x{v}" for k, v in list(sites.items())[:6])
        print(f"# syncs {name} ({tag}): {sum(sites.values())} per round; {top}", flush=True)
    return {name: sum(sites.values()) for name, sites in out.items()}
