"""SFT rows over the length limits (issue 14 F1): 16 rows of 100,000 characters were accepted and made
one train call take 1,051 s while every other tenant waited. Now they are skipped and counted when
read, a step never holds a sample over max_sample_tokens, and a source with no row that fits says so."""

import json

import pytest

from rollout.config import DataConfig
from service.tenants.sft_source import SftSource

pytestmark = pytest.mark.unit

LONG = "ab 12 " * 16_666  # 100,000 characters: tens of thousands of tokens for the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_world / "model")


def sft_source(tmp_path, tokenizer, rows, **limits):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), label_key="completion", shuffle_seed=None, num_epochs=1, **limits)
    return SftSource(cfg, tokenizer, slot=0, registration_id="reg", samples_per_step=2)


def test_long_rows_are_skipped_and_counted_and_steps_stay_within_the_sample_limit(tmp_path, tokenizer):
    rows = [{"prompt": f"p{i} ab", "completion": f" {i} ba"} for i in range(6)]
    rows[1]["prompt"] = LONG
    rows[4]["completion"] = LONG
    src = sft_source(tmp_path, tokenizer, rows, max_prompt_tokens=480, max_completion_tokens=480, max_sample_tokens=512)
    steps = []
    while (taken := src.take_step()) is not None:
        taken_rows, samples = taken
        src.commit(taken_rows)
        steps.append(samples)
    assert [[s.tokens for s in step] for step in steps]  # two whole steps of the four rows that fit
    assert len(steps) == 2 and all(len(s.tokens) <= 512 for step in steps for s in step)
    for step in steps:
        for s in step:  # the completion (with EOS) is what the loss is on
            assert s.tokens[-1] == tokenizer.eos_token_id and sum(s.loss_mask) == len(s.tokens) - s.loss_mask.index(1)
    assert src.skip_metrics() == {"rows_skipped_too_long": 2.0, "rows_skipped_oversized": 0.0}
    assert src.failure_reason is None and src.exhausted


def test_a_source_with_no_row_within_the_limits_reports_why(tmp_path, tokenizer):
    src = sft_source(tmp_path, tokenizer, [{"prompt": LONG, "completion": "x"}] * 16, max_sample_tokens=512)
    assert src.take_step() is None
    assert src.failure_reason.startswith("no usable rows: all 16 rows of sft.jsonl are over a length limit (e.g. sample of ")
    assert src.skip_metrics()["rows_skipped_too_long"] == 16.0
    assert not src.exhausted  # the run fails with the reason; it does not complete with an untrained export
