"""A run's planned total (service/config_checks.planned_steps, stored as total_steps at registration) is the
number of steps its data path really makes: the SFT data path (service/sft.SftSource over rollout.data.DataSource,
built as FleetRuntime builds it) drained to exhaustion over the real tiny tokenizer.

The bug this pins: the plan was ceil(rows x epochs / prompts_per_step), but the data path drops a final part
shorter than a step, so the main job's kinds_sft (256 rows, 6 a step) planned 43 steps, made 42 and its
cosine/warm-up schedule never reached its end. The RL half of the rule (FleetRuntime.exhausted_runs drops the
tail) is pinned on a real RL run in tests/integration/test_service_fleet.py; the whole SFT run (trainer, loop,
final learning rate) in tests/integration/test_service_resume.py.
"""

from __future__ import annotations

import json

import pytest

from service.config.adapter import AdapterConfig
from service.config.job import load_job
from service.config.settings import load_settings
from service.control.config_checks import check_adapter_config, planned_steps
from service.tenants.sft_source import SftSource

pytestmark = pytest.mark.unit

LONG_PROMPT = "ab 12 " * 300  # about 1,800 characters: over max_prompt_tokens 200 for the tiny tokenizer


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory):
    from transformers import AutoTokenizer

    from service.cli import TINY_JOB

    tmp = tmp_path_factory.mktemp("planned_steps")
    settings = load_settings(state_dir=tmp / "state", data_roots=[tmp, tiny_world / "data"])
    return tmp, settings, load_job(TINY_JOB), AutoTokenizer.from_pretrained(tiny_world / "model")


def drained_steps(config: AdapterConfig, tokenizer, limit: int = 10_000) -> int:
    """Whole steps the SFT data path makes from `config` (as FleetRuntime.prepare builds it), each committed."""
    source = SftSource(config.data_config(), tokenizer, slot=0, registration_id="reg", samples_per_step=config.samples_per_step)
    steps = 0
    while steps < limit and (taken := source.take_step()) is not None:
        source.commit(taken[0])
        steps += 1
    assert steps == limit or source.exhausted, "the source stopped serving steps without being used up"
    return steps


def sft_file(folder, name: str, rows: int, long_rows: tuple[int, ...] = ()) -> str:
    path = folder / name
    path.write_text("".join(json.dumps({"prompt": LONG_PROMPT if i in long_rows else f"p{i}", "completion": f" c{i}"}) + "\n"
                            for i in range(rows)))
    return str(path)


def register(world, path: str, **over):
    _, settings, job, _ = world
    config = AdapterConfig.model_validate({"objective": "sft", "data": {"path": path}, "seed": 3, **over})
    return check_adapter_config(config, settings, job.capacity)


def test_the_main_jobs_sft_adapter_plans_the_steps_it_makes(world):
    """kinds_sft of examples/tiny/job.yaml as the job registers it: 256 rows, 6 a step, one epoch -> 42 (not 43)."""
    _, settings, job, tokenizer = world
    (spec,) = [a for a in job.adapters if a.name == "kinds_sft"]
    checked = check_adapter_config(spec.config, settings, job.capacity)
    assert (checked.data_rows, checked.config.prompts_per_step) == (256, 6)
    assert checked.total_steps == drained_steps(checked.config, tokenizer) == 42  # the last 4 rows are dropped


@pytest.mark.parametrize(
    "rows, num_epoch, prompts_per_step, expected",
    [
        (8, None, 4, 2),  # whole steps only: nothing dropped
        (10, 1, 3, 3),  # 1 row dropped
        (10, 2, 4, 5),  # the epochs run on into each other: 20 rows make 5 steps, not 2 epochs x 2 steps
        (7, 3, 4, 5),  # 21 rows -> 5 steps; ceil would say 6
        (3, 2, 4, 1),  # fewer rows than a step, but two epochs fill one
        (5, 1, 5, 1),
    ],
)
def test_planned_steps_equal_the_steps_the_sft_data_path_makes(world, rows, num_epoch, prompts_per_step, expected):
    tmp, _, _, tokenizer = world
    path = sft_file(tmp, f"r{rows}_e{num_epoch}_p{prompts_per_step}.jsonl", rows)
    checked = register(world, path, num_epoch=num_epoch, prompts_per_step=prompts_per_step)
    assert checked.total_steps == drained_steps(checked.config, tokenizer) == expected


def test_with_num_step_the_data_repeats_until_that_step(world):
    """num_step: exactly that many steps, even from fewer rows than one step (the epochs never end)."""
    tmp, _, _, tokenizer = world
    checked = register(world, sft_file(tmp, "three.jsonl", 3), num_step=5, prompts_per_step=4)
    assert checked.total_steps == 5
    assert drained_steps(checked.config, tokenizer, limit=5) == 5  # the loop stops it there (FleetRuntime._exhausted)


def test_rows_over_a_token_limit_are_not_served_and_not_planned_for(world):
    """The rule counts the rows the source serves: rows over a token limit are skipped when first taken. The
    registration count cannot see them (it reads bytes, not tokens), so such a run plans more than it makes."""
    tmp, _, _, tokenizer = world
    checked = register(world, sft_file(tmp, "some_long.jsonl", 10, long_rows=(1, 4)), num_epoch=2, prompts_per_step=3,
                       data={"path": str(tmp / "some_long.jsonl"), "max_prompt_tokens": 200})
    made = drained_steps(checked.config, tokenizer)
    assert made == planned_steps(checked.config, 10 - 2) == 5  # 8 usable rows x 2 epochs // 3
    assert checked.total_steps == planned_steps(checked.config, 10) == 6  # the known limit (docstring of planned_steps)


def test_less_than_one_step_of_data_is_refused_at_registration(world):
    tmp, _, _, _ = world
    from service.errors import BadValue

    path = sft_file(tmp, "small.jsonl", 3)
    with pytest.raises(BadValue, match="a step takes 4 rows .* small.jsonl has 3 row\\(s\\) x 1 epoch\\(s\\) .* prompts_per_step at most 3"):
        register(world, path, prompts_per_step=4)
    assert register(world, path, prompts_per_step=3).total_steps == 1
