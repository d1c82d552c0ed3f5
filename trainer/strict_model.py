"""`StrictModel`: the one strict base of every config model (trainer, rollout, service).

Unknown keys are refused (a typo fails loudly) and a validated config is a frozen value that cannot
drift afterwards. allow_inf_nan=False: Python's json reads `Infinity`/`NaN`, and no setting means
anything with them (a tenant's `"lr": Infinity` is a 422, not a 500).

It lives in trainer/ because trainer/ is the one package the other two may import (trainer/ imports
neither rollout/ nor service/); in a module of its own, apart from the trainer's settings
(trainer/config.py), so that a config needing only the base imports nothing else.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Refuses unknown keys, is frozen once validated, and refuses inf/NaN numbers (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
