"""Error measures shared by the numerical tests."""

import torch


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude:
    max|a - b| / max|b| (``b`` is the reference; it must not be all zero)."""
    return ((a - b).abs().max() / b.abs().max()).item()
