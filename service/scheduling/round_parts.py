"""A round's parts, per tenant (service/scheduling/scheduler.py builds and settles them): where each tenant's
offer sits in the round's work and so in its result (`Span`, `RoundPart`), what settling may fetch
once per round (`RoundContextOnce`), and how many tokens an offer trains (`offer_tokens`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from service.scheduling.tenant import Offer
from trainer.rounds import RoundResult

log = logging.getLogger(__name__)


class RoundContextOnce:
    """service.scheduling.tenant.RoundContext: one rollout stats call per round, on first use."""

    def __init__(self, seconds: float, stats: Callable[[], dict[str, Any]] | None) -> None:
        self.seconds = seconds
        self._fetch = stats
        self._stats: dict[str, Any] | None = None

    def rollout_stats(self, name: str) -> Any:
        if self._stats is None:
            try:
                self._stats = self._fetch() if self._fetch is not None else {}
            except Exception as e:  # the round has run: a slow answer must not lose its accounting (R2)
                log.info("rollout stats after a round: %s: %s", type(e).__name__, e)
                self._stats = {}
        return self._stats.get(name)


def offer_tokens(offer: Offer) -> int:
    """Tokens an offer put in the round's pass (its samples' learned tokens, its calls' datums)."""
    return sum(sum(x.loss_mask) for x in offer.samples) + sum(len(d.tokens) for c in offer.calls for d in c.data)


@dataclass(frozen=True)
class Span:
    """Where one tenant's offer sits in the round's work (and so in its result)."""

    calls_at: int
    calls_n: int
    forwards_at: int
    forwards_n: int
    optim_at: int | None

    def part(self, result: RoundResult) -> RoundPart:
        return RoundPart(
            train=result.train, refused=result.refused,
            calls=result.calls[self.calls_at: self.calls_at + self.calls_n],
            forwards=result.forwards[self.forwards_at: self.forwards_at + self.forwards_n],
            optim=result.optim[self.optim_at] if self.optim_at is not None and self.optim_at < len(result.optim) else None,
        )


@dataclass(frozen=True)
class RoundPart:
    """One tenant's part of a round's result."""

    train: Any  # trainer.core.TrainResult of the round's batch (dataset runs read their slot's metrics)
    refused: str | None
    calls: list
    forwards: list
    optim: Any  # metrics dict, or the error message; None when it sent no step
