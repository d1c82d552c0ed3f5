"""A tool-using environment for the tiny world: the model must call a calculator to be rewarded.

The protocol fits what the tiny model can learn in a couple of minutes (its "words" are runs of
digits, vowels or consonants; examples/tiny/build.py):

* **The call.** A turn whose non-space characters are at least `call_share` digits is a call of
  the calculator on the numbers in it, parsed from the generated text (``"12 7 40"`` -> 12 + 7 + 40).
  The calculator's result comes back as a tool message, ``"\\n<|system|>= 59\\n<|assistant|>"``:
  environment tokens, in the context of the next turn and never learned. The call's reward is
  half its digit share: a cleaner call earns more.
* **Not a call.** The environment answers ``"\\n<|system|>use the calculator\\n<|assistant|>"``
  and the model tries again (reward 0), until `max_turns` (the adapter's rollout.max_turns).
* **The answer.** The turn after the call ends the episode; its reward is half the share of its
  non-space characters that are digits of the result. Without a call there is no result and no
  answer reward: the calculator must be called.

A trajectory's reward (the sum over its turns) is at most 1.0. On the tiny world it starts near
0.1 (few turns are mostly digits) and rises as the adapter learns to call: the job in this
folder shows the curve (docs/environments.md).
"""

from __future__ import annotations

import re

from rollout.environment import Action, StepResult

NUMBER = re.compile(r"\d+")
MAX_OPERANDS = 16  # the calculator adds at most this many numbers of a call (bounded work)


def digit_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


class Calculator:
    def __init__(self, call_share: float = 0.5):
        if not 0.0 < call_share <= 1.0:
            raise ValueError(f"call_share must be in (0, 1], got {call_share}")
        self.call_share = call_share
        self.result: str | None = None  # the calculator's answer, once called

    def reset(self, task) -> None:  # noqa: ANN001 - rollout.data.PromptRow
        self.result = None
        return None  # start from the data row's prompt

    def step(self, action: Action) -> StepResult:
        if self.result is not None:  # the answer: its digits should be the result's
            allowed = set(self.result)
            chars = [c for c in action.text if not c.isspace()]
            share = sum(c in allowed for c in chars) / len(chars) if chars else 0.0
            return StepResult(reward=0.5 * share, done=True)
        share = digit_share(action.text)
        numbers = NUMBER.findall(action.text)
        if share >= self.call_share and numbers:
            self.result = str(sum(int(n) for n in numbers[:MAX_OPERANDS]))
            return StepResult(observation=f"\n<|system|>= {self.result}\n<|assistant|>", reward=0.5 * share)
        return StepResult(observation="\n<|system|>use the calculator\n<|assistant|>")
