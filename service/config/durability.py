"""The Tinker durability policy (the setting `tinker_durability`): `Durability`. What each policy
means, and what survives what, is service/tenants/tinker_durability.py's module doc and
docs/operations.md ("What survives what")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_POLICY = "interval:300"


@dataclass(frozen=True)
class Durability:
    mode: Literal["step", "interval"]
    interval_s: float = 300.0

    @staticmethod
    def parse(text: str) -> "Durability":
        """``step`` or ``interval:<seconds>``; ValueError saying what is allowed."""
        value = text.strip()
        if value == "step":
            return Durability("step")
        if value.startswith("interval:"):
            try:
                seconds = float(value.split(":", 1)[1])
            except ValueError:
                seconds = -1.0
            if seconds > 0:
                return Durability("interval", seconds)
        raise ValueError(f"tinker_durability {text!r} invalid: 'step' (each optim_step durable before it is acknowledged) "
                         f"or 'interval:<seconds>' (a snapshot of each changed model at most that often; default {DEFAULT_POLICY})")

    @property
    def logs_requests(self) -> bool:
        """Whether every request is recorded before its id is answered (the write-ahead log)."""
        return self.mode == "step"

    def due(self, last_snapshot_at: float, now: float) -> bool:
        return self.mode == "interval" and now - last_snapshot_at >= self.interval_s
