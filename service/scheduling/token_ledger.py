"""Trained tokens per tenant over a sliding window: `TokenLedger`, what the token shares of the
quotas (service/config/quotas.py `token_share`) are measured against. The scheduler feeds it once
per round and reads it at placement (service/scheduling/scheduler.py)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from service.config.quotas import TOKEN_WINDOW_S


class TokenLedger:
    """Trained tokens per tenant over the last `window_s` seconds (the token shares). Fed by the
    scheduler's thread once per round; read by its placement."""

    def __init__(self, window_s: float = TOKEN_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._entries: deque[tuple[float, str | None, int]] = deque()
        self._by_owner: dict[str | None, int] = {}
        self._total = 0

    def add(self, owner: str | None, tokens: int) -> None:
        if tokens <= 0:
            return
        self._entries.append((self.clock(), owner, tokens))
        self._by_owner[owner] = self._by_owner.get(owner, 0) + tokens
        self._total += tokens

    def _expire(self) -> None:
        horizon = self.clock() - self.window_s
        while self._entries and self._entries[0][0] < horizon:
            _, owner, n = self._entries.popleft()
            self._by_owner[owner] -= n
            self._total -= n
            if not self._by_owner[owner]:
                del self._by_owner[owner]

    def share(self, owner: str | None) -> float:
        """`owner`'s share of the window's trained tokens (0 when nothing trained)."""
        self._expire()
        return self._by_owner.get(owner, 0) / self._total if self._total else 0.0
