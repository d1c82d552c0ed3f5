"""Fleet-wide training statistics: what each round of the training loop cost and produced.

The loop (service/loop/training_loop.py) calls `FleetStats.record_round(...)` once per round that
trained; the dashboard's `GET /v1/fleet/stats` (api/ui.py) reads `snapshot()`. Both
may run on different threads (the loop's and the API server's), so every access
holds one lock; a record is immutable once stored.

Rates (steps per minute, tokens per second) are taken over the rounds of the last
`window_s` seconds: their sum divided by the time from the start of the oldest
such round to now. A round's start is its end minus its measured parts, so rounds
that waited long for rollouts lower the rate, as they should.

Tokens, from the trained samples (`batch_token_counts`):
  * rollout tokens: the response tokens of RL samples (what the SGLang engines
    generated and the trainer then used);
  * trained tokens: every loss token (RL responses and SFT completions).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

ROUND_PARTS = ("collect", "train", "publish", "checkpoint")


@dataclass(frozen=True)
class RoundRecord:
    ended_at: float  # wall clock (time.time) when the round was recorded
    collect_s: float
    train_s: float
    publish_s: float
    checkpoint_s: float
    steps: int  # adapter steps committed in the round
    samples: int
    rollout_tokens: int
    trained_tokens: int

    @property
    def seconds(self) -> float:
        return self.collect_s + self.train_s + self.publish_s + self.checkpoint_s


def batch_token_counts(samples: Iterable[Any]) -> tuple[int, int]:
    """(rollout tokens, trained tokens) of a round's train samples (trainer.batch.TrainSample):
    RL samples carry their rollout log-probabilities, SFT samples do not."""
    rollout = trained = 0
    for s in samples:
        n = sum(s.loss_mask)
        trained += n
        if s.rollout_logprobs is not None:
            rollout += n
    return rollout, trained


class FleetStats:
    def __init__(self, *, window_s: float = 60.0, max_rounds: int = 500, clock: Callable[[], float] = time.time) -> None:
        if not window_s > 0 or max_rounds < 1:
            raise ValueError(f"window_s must be > 0 and max_rounds >= 1 (got {window_s}, {max_rounds})")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: deque[RoundRecord] = deque(maxlen=max_rounds)  # newest last
        # Totals since start (the deque forgets old rounds; these do not).
        self._rounds = 0
        self._steps = 0
        self._samples = 0
        self._rollout_tokens = 0
        self._trained_tokens = 0
        self._seconds = dict.fromkeys(ROUND_PARTS, 0.0)

    def record_round(self, *, collect_s: float, train_s: float, publish_s: float = 0.0, checkpoint_s: float = 0.0,
                     steps: int, samples: int, rollout_tokens: int = 0, trained_tokens: int = 0) -> RoundRecord:
        """Store one round. Refuses (ValueError, nothing stored) negative or non-finite values."""
        parts = {"collect_s": collect_s, "train_s": train_s, "publish_s": publish_s, "checkpoint_s": checkpoint_s}
        counts = {"steps": steps, "samples": samples, "rollout_tokens": rollout_tokens, "trained_tokens": trained_tokens}
        bad = [f"{k}={v!r}" for k, v in parts.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
        bad += [f"{k}={v!r}" for k, v in counts.items() if not (isinstance(v, int) and v >= 0)]
        if bad:
            raise ValueError(f"record_round: {', '.join(bad)}: times must be finite seconds >= 0 and counts integers >= 0")
        record = RoundRecord(ended_at=self._clock(), **{k: float(v) for k, v in parts.items()}, **counts)
        with self._lock:
            self._recent.append(record)
            self._rounds += 1
            self._steps += steps
            self._samples += samples
            self._rollout_tokens += rollout_tokens
            self._trained_tokens += trained_tokens
            for part in ROUND_PARTS:
                self._seconds[part] += parts[f"{part}_s"]
        return record

    def snapshot(self, recent: int = 120) -> dict[str, Any]:
        """Totals, windowed rates, the time split and the newest `recent` rounds (oldest first)."""
        now = self._clock()
        with self._lock:
            rounds = list(self._recent)
            totals = {"rounds": self._rounds, "steps": self._steps, "samples": self._samples,
                      "rollout_tokens": self._rollout_tokens, "trained_tokens": self._trained_tokens}
            seconds = dict(self._seconds)
        in_window = [r for r in rounds if r.ended_at >= now - self.window_s]
        span = (now - min(r.ended_at - r.seconds for r in in_window)) if in_window else 0.0

        def rate(count: Callable[[RoundRecord], int], per: float) -> float:
            return per * sum(count(r) for r in in_window) / span if span > 0 else 0.0

        total_s = sum(seconds.values())
        return {
            **totals,
            "window_s": self.window_s,
            "steps_per_min": rate(lambda r: r.steps, 60.0),
            "rollout_tokens_per_s": rate(lambda r: r.rollout_tokens, 1.0),
            "trained_tokens_per_s": rate(lambda r: r.trained_tokens, 1.0),
            "seconds": seconds,
            "fractions": {k: (v / total_s if total_s > 0 else 0.0) for k, v in seconds.items()},
            "recent": [asdict(r) for r in rounds[-recent:]] if recent > 0 else [],
        }
