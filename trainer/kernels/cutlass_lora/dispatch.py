"""Which kernel runs a fused LoRA linear's base GEMM with its LoRA term: the CUTLASS kernel or today's path.

``base_plus_delta(choice, layout, a, w, rank_side, factor, plan_for, today)`` returns the forward's
x W^T + h_g B_g^T (layout "nk") or the input gradient's g W + gh_g A_g ("kn"):

* ``library``: ``today()``, always (the default until the H200 run proves the kernel: docs/BENCHMARKS.md);
* ``cutlass``: the CUTLASS kernel wherever it can take the operands (kernels.unsupported), refused with
  the reason where it cannot; its tile configuration is measured once per shape (below);
* ``auto``: the CUTLASS kernel where it can run AND measured faster than today's path for the shape,
  else ``today()``. A build failure under ``auto`` is reported once and leaves today's path.

The measurement, once per key (layout, M rounded up to a power of two, N, K, R, LoRA blocks per tile)
and process: every kernel configuration and today's path run on the call's own operands (one
warm-up, then ``TIMED_RUNS`` between CUDA events); the kernel must beat today's path by ``MARGIN``.
``decisions()`` lists what was measured and chosen (the benchmarks print it).

Nothing here runs on the CPU: a CPU tensor is "unsupported" before any CUDA call, so the CPU path is
``today()`` exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.kernels.cutlass_lora import kernels
from trainer.kernels.cutlass_lora.plan import TilePlan

log = logging.getLogger(__name__)

CHOICES = ("library", "cutlass", "auto")
TIMED_RUNS = 3
MARGIN = 0.01  # the kernel must be at least 1% faster than today's path to be taken under auto


@dataclass
class Decision:
    """A measured choice: the kernel config taken (None: today's path) and the times, ms."""

    config: int | None
    times_ms: dict[str, float] = field(default_factory=dict)
    note: str = ""


_decisions: dict[tuple, Decision] = {}
_build_failure: str | None = None


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise ValueError(f"lora_gemm must be one of {CHOICES}, got {choice!r}")
    return choice


def decisions() -> dict[tuple, Decision]:
    """Every measured decision of this process, by key (see the module docstring)."""
    return dict(_decisions)


def forget() -> None:
    """Drop the measured decisions (benchmarks that switch shapes or choices)."""
    _decisions.clear()


def base_plus_delta(choice: str, layout: str, a: torch.Tensor, w: torch.Tensor, rank_side: torch.Tensor,
                    factor: torch.Tensor, plan_for: Callable[[int], TilePlan],
                    today: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The base GEMM with the LoRA term (module docstring). ``plan_for(tile_m)`` gives the micro-batch's
    row-tile table for a tile height; ``today()`` computes the same on today's path."""
    if check_choice(choice) == "library":
        return today()
    reason = kernels.unsupported(layout, a, w, rank_side, factor)
    if reason is None and _build_failure is not None:
        reason = _build_failure
    if reason is not None:
        if choice == "cutlass":
            raise ValueError(f"lora_gemm 'cutlass' cannot run here: {reason}; use 'auto' or 'library'")
        return today()
    if choice == "auto" and not _extension_ready():
        return today()
    m, n = a.shape[0], (w.shape[0] if layout == "nk" else w.shape[1])
    key = (choice, layout, 1 << max(m - 1, 0).bit_length(), n, a.shape[1], rank_side.shape[1],
           plan_for(kernels.CONFIGS[0].tile_m).pairs_per_tile)
    decision = _decisions.get(key)
    if decision is None:
        decision = _decisions[key] = _measure(choice, layout, a, w, rank_side, factor, plan_for, today)
        log.info("lora_gemm %s: %s", key, decision)
    if decision.config is None:
        return today()
    config = decision.config
    return kernels.run(layout, a, w, rank_side, factor, plan_for(kernels.CONFIGS[config].tile_m), config)


def _extension_ready() -> bool:
    """Load (build on first use) the extension; under auto a failure is kept and today's path runs."""
    global _build_failure
    try:
        kernels.extension()
        return True
    except Exception as e:  # noqa: BLE001 - any build or load failure means: not this path
        _build_failure = f"the CUTLASS extension did not build or load: {type(e).__name__}: {e}"
        log.warning("lora_gemm auto: %s; using today's path", _build_failure)
        return False


def _measure(choice, layout, a, w, rank_side, factor, plan_for, today) -> Decision:  # noqa: ANN001
    times: dict[str, float] = {}
    for i, cfg in enumerate(kernels.CONFIGS):
        plan = plan_for(cfg.tile_m)
        times[cfg.name] = _time_ms(lambda p=plan, c=i: kernels.run(layout, a, w, rank_side, factor, p, c))
    best = min(range(len(kernels.CONFIGS)), key=lambda i: times[kernels.CONFIGS[i].name])
    if choice == "cutlass":
        return Decision(best, times, "fastest kernel config")
    times["today"] = _time_ms(today)
    if times[kernels.CONFIGS[best].name] <= (1 - MARGIN) * times["today"]:
        return Decision(best, times, "kernel faster than today's path")
    return Decision(None, times, "today's path as fast or faster")


def _time_ms(fn: Callable[[], torch.Tensor]) -> float:
    fn()  # warm-up: the first launch loads the kernel's module
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_RUNS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_RUNS
