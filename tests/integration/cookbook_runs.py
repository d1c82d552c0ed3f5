"""A cookbook run that has no command line of its own, run as a user's script would:
``python -m tests.integration.cookbook_runs <run> key=value ...`` (chz arguments, as the
cookbook's recipes take them), in a process of its own with the tiny world's hub caches
(`examples.tiny.build.hf_env`) and TINKER_API_KEY in its environment.

* ``digits_rl``: ``tinker_cookbook.rl.train.main`` over ``DigitsEnv``, a single-turn
  ``ProblemEnv`` through the cookbook's environment interface: the reward is the share of
  digits among the response's letters and digits (the tiny world's ``target_share`` task, which
  the tiny model learns; the cookbook's arithmetic env never rewards it, FINDINGS.md). A
  response that ends with EOS is well formed (``role_colon`` renders it cleanly; the tiny model
  never writes the renderer's "\\n\\nUser:" stop sequence).
Nothing here changes what the cookbook does: its training loops, renderers, checkpoint and
resume logic run as they are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from functools import partial

import chz

PROMPT = "Answer with digits only."


def digit_share(text: str) -> float:
    """Share of digits among the letters and digits of ``text`` (0 for none)."""
    chars = [c for c in text if c.isalnum()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def _digits_env_types():  # noqa: ANN202 - classes defined once the cookbook is imported
    from tinker_cookbook import renderers
    from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
    from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class DigitsEnv(ProblemEnv):
        def __init__(self, renderer: renderers.Renderer, words: str):
            super().__init__(renderer, format_coef=0.0, require_stop_sequence_for_format=False)
            self.words = words

        def get_question(self) -> str:
            return f"{PROMPT} {self.words}"

        def check_answer(self, sample_str: str) -> float:  # the cookbook takes float(...) of it as the reward
            return digit_share(sample_str)

        def check_format(self, sample_str: str) -> bool:
            return bool(sample_str.strip())

        def get_reference_answer(self) -> str:
            return "digits"

    class DigitsDataset(RLDataset):
        def __init__(self, prompts: list[str], renderer: renderers.Renderer, batch_size: int, group_size: int):
            self.prompts, self.renderer, self.batch_size, self.group_size = prompts, renderer, batch_size, group_size

        def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
            start = index * self.batch_size
            return [ProblemGroupBuilder(env_thunk=partial(DigitsEnv, self.renderer, p), num_envs=self.group_size,
                                        dataset_name="digits")
                    for p in self.prompts[start: start + self.batch_size]]

        def __len__(self) -> int:
            return len(self.prompts) // self.batch_size

    @chz.chz
    class DigitsDatasetBuilder(RLDatasetBuilder):
        data_path: str
        model_name: str
        renderer_name: str
        batch_size: int
        group_size: int

        async def __call__(self) -> tuple[RLDataset, None]:
            renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
            with open(self.data_path) as f:
                prompts = [json.loads(line)["prompt"] for line in f]
            return DigitsDataset(prompts, renderer, self.batch_size, self.group_size), None

    return DigitsDatasetBuilder


@chz.chz
class Run:
    """What every run here takes (chz arguments, as the recipes' command lines)."""

    base_url: str
    log_path: str
    model_name: str
    lora_rank: int = 8
    max_steps: int | None = None


@chz.chz
class DigitsRL(Run):
    data_path: str
    learning_rate: float = 3e-3
    batch_size: int = 4
    group_size: int = 8
    max_tokens: int = 12
    save_every: int = 2


def digits_rl(cfg: DigitsRL) -> None:
    from tinker_cookbook import model_info
    from tinker_cookbook.rl import train

    renderer_name = model_info.get_recommended_renderer_name(cfg.model_name)
    builder = _digits_env_types()(data_path=cfg.data_path, model_name=cfg.model_name, renderer_name=renderer_name,
                                  batch_size=cfg.batch_size, group_size=cfg.group_size)
    config = train.Config(learning_rate=cfg.learning_rate, dataset_builder=builder, model_name=cfg.model_name,
                          recipe_name="lorafleet_digits_rl", max_tokens=cfg.max_tokens, log_path=cfg.log_path,
                          eval_every=0, save_every=cfg.save_every, renderer_name=renderer_name, lora_rank=cfg.lora_rank,
                          base_url=cfg.base_url, max_steps=cfg.max_steps)
    asyncio.run(train.main(config))


RUNS = {"digits_rl": (DigitsRL, digits_rl)}

if __name__ == "__main__":
    import sys

    which = sys.argv.pop(1)
    config_cls, run = RUNS[which]
    run(chz.entrypoint(config_cls))
