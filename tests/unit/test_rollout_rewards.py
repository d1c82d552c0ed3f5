"""Rewards: built-ins, custom rewards only from import roots, failures recorded as reward 0."""

import asyncio
import sys
import time
import types

import pytest

from rollout.config import RewardConfig
from rollout.rewards import (
    BUILTIN_REWARDS,
    RewardLoadError,
    exact_match,
    extract_final_answer,
    load_reward,
    math_reward,
    score,
    score_async,
    target_share,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "response, label, want",
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("\\boxed{41} then \\boxed{42}", "42", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("blah #### 1,000", "1000", 1.0),
        ("#### 1000.0", "#### 1000", 1.0),  # label in GSM8K form
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{$7$.}", "7", 1.0),
        ("\\boxed{43}", "42", 0.0),
        ("the answer is 42", "42", 0.0),  # no final-answer form
        ("\\boxed{}", "42", 0.0),
        ("####", "42", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
        ("\\boxed{\\text{yes}}", "yes", 1.0),
    ],
)
def test_math_reward(response, label, want):
    assert math_reward(response, label) == want


def test_extract_final_answer():
    assert extract_final_answer("a \\boxed{1} b") == "1"
    assert extract_final_answer("step\n#### 12\nextra") == "12"
    assert extract_final_answer("no answer") is None
    assert extract_final_answer("\\boxed{unclosed") is None


def test_exact_match():
    assert exact_match(" Paris\n", "Paris") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("paris", "Paris", ignore_case=True) == 1.0
    assert exact_match(" Paris", "Paris", strip=False) == 0.0


def test_target_share():
    assert target_share("12 ab", "0123456789") == pytest.approx(0.5)
    assert target_share("  1 2 3 ", "0123456789") == 1.0
    assert target_share("aeiou xyz", "aeiou") == pytest.approx(5 / 8)
    assert target_share("   ", "aeiou") == 0.0
    assert target_share("", "aeiou") == 0.0


def test_builtin_set_and_kwargs():
    assert sorted(BUILTIN_REWARDS) == ["exact_match", "math", "target_share"]
    fn = load_reward(RewardConfig(name="exact_match", kwargs={"ignore_case": True}))
    assert fn("PARIS", "paris", None) == 1.0


@pytest.fixture
def custom_module(monkeypatch):
    mod = types.ModuleType("tenant_rewards.scoring")
    mod.length_reward = lambda response, label, metadata, scale=1.0: scale * len(response)
    mod.boom = lambda response, label, metadata: 1 / 0
    mod.not_a_number = lambda response, label, metadata: "high"
    mod.nan = lambda response, label, metadata: float("nan")
    mod.slow = lambda response, label, metadata: time.sleep(2) or 1.0
    mod.CONSTANT = 3
    pkg = types.ModuleType("tenant_rewards")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "tenant_rewards", pkg)
    monkeypatch.setitem(sys.modules, "tenant_rewards.scoring", mod)
    return mod


@pytest.mark.parametrize("name", ["tenant_rewards.scoring:length_reward", "tenant_rewards.scoring.length_reward"])
def test_custom_reward_from_allowed_root(custom_module, name):
    fn = load_reward(RewardConfig(name=name, kwargs={"scale": 2.0}), ["tenant_rewards"])
    assert fn("abc", None, None) == 6.0


@pytest.mark.parametrize(
    "name, roots, message",
    [
        ("tenant_rewards.scoring:length_reward", [], "not under an allowed reward import root; allowed: none configured"),
        ("tenant_rewards.scoring:length_reward", ["tenant"], "not under an allowed reward import root; allowed: ['tenant']"),
        ("os:system", ["tenant_rewards"], "'os' is not under an allowed reward import root"),
        ("tenant_rewards.scoring:missing", ["tenant_rewards"], "has no callable 'missing'"),
        ("tenant_rewards.scoring:CONSTANT", ["tenant_rewards"], "has no callable 'CONSTANT'"),
        ("tenant_rewards.nomodule:f", ["tenant_rewards"], "cannot import reward module 'tenant_rewards.nomodule'"),
        ("no_such_builtin", ["tenant_rewards"], "unknown built-in reward 'no_such_builtin'; built-ins: ['exact_match', 'math', 'target_share']"),
    ],
)
def test_custom_reward_refusals(custom_module, name, roots, message):
    with pytest.raises(RewardLoadError) as e:
        load_reward(RewardConfig(name=name), roots)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "func, error",
    [("boom", "ZeroDivisionError: division by zero"), ("not_a_number", "reward returned str, not a number"), ("nan", "reward returned nan")],
)
def test_failing_reward_gives_zero_and_a_recorded_error(custom_module, func, error):
    fn = load_reward(RewardConfig(name=f"tenant_rewards.scoring:{func}"), ["tenant_rewards"])
    out = score(fn, "resp", "label", None)
    assert out.value == 0.0 and out.error == error


def test_slow_reward_times_out(custom_module):
    fn = load_reward(RewardConfig(name="tenant_rewards.scoring:slow"), ["tenant_rewards"])

    async def timed():
        t0 = time.monotonic()
        out = await score_async(fn, "r", None, None, timeout_s=0.2)
        return out, time.monotonic() - t0

    out, waited = asyncio.run(timed())  # (asyncio.run itself then waits for the abandoned thread)
    assert out.value == 0.0 and out.error == "reward timed out after 0.2 s"
    assert waited < 1.0
    ok = asyncio.run(score_async(BUILTIN_REWARDS["target_share"], "11a", "1", None, timeout_s=5))
    assert ok.value == pytest.approx(2 / 3) and ok.error is None
