"""Reward functions: built-ins, custom ones by dotted path, and failure-safe scoring.

A reward is ``fn(response: str, label, metadata: dict | None, **kwargs) -> float``.
Custom rewards are named ``package.module:function`` (or
``package.module.function``) and may only be imported from the configured
import roots (RolloutConfig.reward_import_roots; rollout/tenant_code.py): a
tenant's config must not be able to import and call arbitrary code of the
service host.

Scoring never raises: a reward that raises, times out, or returns something
that is not a finite number gives that sample reward 0 and a recorded error.
"""

from __future__ import annotations

import asyncio
import math as _math
import re
from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict

from rollout.config import RewardConfig
from rollout.tenant_code import TenantCodeError, import_confined, is_import_path, split_import_path

RewardFn = Callable[..., float]

# --- built-ins ---------------------------------------------------------------------------------

_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i, depth = start + len(_BOXED), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a solution: the last \\boxed{} content, else what follows the last '####'."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else ""
    return None


def _normalize_answer(ans: str) -> str:
    ans = ans.replace("$", "").strip()
    ans = re.sub(r"\\text\{([^}]*)\}", r"\1", ans)
    ans = ans.replace("\\!", "").replace("\\,", "").replace(" ", "")
    ans = ans.rstrip(".")
    if re.fullmatch(r"[-+]?[\d,]*\.?\d+", ans):
        ans = ans.replace(",", "")
    return ans


def _as_number(ans: str) -> float | None:
    try:
        if re.fullmatch(r"[-+]?\d+/\d+", ans):
            num, den = ans.split("/")
            return int(num) / int(den)
        return float(ans)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: Any, metadata: dict | None = None, *, rel_tol: float = 1e-6) -> float:
    """1.0 when the response's final answer (\\boxed{} or '####' form) equals the label's, else 0.0.

    The label may be a bare answer or a full solution in either form. Numbers
    compare by value (1,000 == 1000.0 == 2000/2), other answers as normalized strings."""
    got = extract_final_answer(response)
    if got is None:
        return 0.0
    label_text = str(label)
    want = extract_final_answer(label_text)
    want = label_text if want is None else want
    got_n, want_n = _normalize_answer(got), _normalize_answer(want)
    a, b = _as_number(got_n), _as_number(want_n)
    if a is not None and b is not None:
        return 1.0 if _math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-12) else 0.0
    return 1.0 if got_n == want_n and got_n != "" else 0.0


def exact_match(response: str, label: Any, metadata: dict | None = None, *, strip: bool = True, ignore_case: bool = False) -> float:
    """1.0 when the response equals the label (after optional stripping / case folding), else 0.0."""
    a, b = response, str(label)
    if strip:
        a, b = a.strip(), b.strip()
    if ignore_case:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


def target_share(response: str, label: Any, metadata: dict | None = None) -> float:
    """The tiny world's task: share of the response's non-whitespace characters that are in the label's character set."""
    allowed = set(str(label))
    chars = [c for c in response if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in allowed for c in chars) / len(chars)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match,
    "target_share": target_share,
}

# --- loading -----------------------------------------------------------------------------------


class RewardLoadError(TenantCodeError):
    """The reward config names something that cannot be used; the message says what is allowed."""


def builtin_reward_names() -> list[str]:
    return sorted(BUILTIN_REWARDS)


def load_reward(cfg: RewardConfig, import_roots: list[str] | tuple[str, ...] = ()) -> RewardFn:
    """The reward callable of `cfg`, with its kwargs bound. The one resolution of a reward name:
    the registration check (service/control/config_checks.py) and the rollout worker both call it."""
    if cfg.name in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[cfg.name]
    elif not is_import_path(cfg.name):
        raise RewardLoadError(
            f"unknown built-in reward {cfg.name!r}; built-ins: {builtin_reward_names()}, "
            "or a custom 'package.module:function' under an allowed import root"
        )
    else:
        try:
            fn = import_confined(cfg.name, import_roots, "reward", "callable")
        except TenantCodeError as e:
            raise RewardLoadError(str(e)) from None
        if not callable(fn):
            module_name, func_name = split_import_path(cfg.name, "reward")
            raise RewardLoadError(f"reward module {module_name!r} has no callable {func_name!r}")
    return partial(fn, **cfg.kwargs) if cfg.kwargs else fn


# --- scoring -----------------------------------------------------------------------------------


class RewardOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    value: float
    error: str | None = None  # set when the reward failed; value is then 0.0


def score(fn: RewardFn, response: str, label: Any, metadata: dict | None) -> RewardOutcome:
    """Call the reward; any failure becomes reward 0 with the error recorded."""
    try:
        value = fn(response, label, metadata)
    except Exception as e:
        return RewardOutcome(value=0.0, error=f"{type(e).__name__}: {e}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        return RewardOutcome(value=0.0, error=f"reward returned {type(value).__name__}, not a number")
    if not _math.isfinite(value):
        return RewardOutcome(value=0.0, error=f"reward returned {value}")
    return RewardOutcome(value=value)


async def score_async(fn: RewardFn, response: str, label: Any, metadata: dict | None, timeout_s: float) -> RewardOutcome:
    """`score` in a worker thread with a time limit (a slow reward must not stall the rollout loop)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(score, fn, response, label, metadata), timeout_s)
    except TimeoutError:
        return RewardOutcome(value=0.0, error=f"reward timed out after {timeout_s} s")
