"""The hub datasets that tinker-cookbook 0.6.1's recipes load by name, filled with tiny-world rows
in a Hugging Face ``datasets`` cache (``HF_DATASETS_CACHE``), so that each recipe runs unmodified
and offline on the tiny world. The rows keep each dataset's columns (the ones the recipe reads)
and carry a task the tiny model can learn where the recipe's reward allows one:

* ``HuggingFaceH4/no_robots`` (sl_basic, sl_loop; train and test): the kinds task as chats
  ("42 ae" -> "digits vowels"), which the tiny model learns;
* ``openai/gsm8k`` "main" (rl_basic, rl_loop; train and test): tiny-world questions with a
  gsm8k answer ("... #### <n>"). Both recipes grade a ``\\boxed{}`` answer, which the tiny model
  never writes (its byte-level vocabulary has the bytes, its pre-training never saw them): no
  row can earn that reward;
* ``Anthropic/hh-rlhf`` (preference/dpo, dataset=hhh; train and test): "Human: <words>
  Assistant: <their kinds>" chosen over the words reversed;
* ``zwhe99/DeepMath-103K`` (distillation, dataset=deepmath; train): the kinds prompts as
  questions;
* ``hicai-zju/SciKnowEval`` (sdft, dataset=sciknoweval; its "test" split, which the recipe splits
  itself): level-3 Chemistry multiple-choice rows whose question is a kinds prompt and whose
  choices are the candidate kinds.

Deterministic: the same rows (and bytes) each build.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.tiny.build import cache_dataset

KINDS = ("digits", "vowels", "consonants", "mixed")
# sl_basic's batch (128 rows) is fixed in its code, not on its command line: 10 steps need 1280 rows,
# and its evaluator (the test split in batches of 128, the remainder dropped) needs 128 held-out rows.
TRAIN_ROWS = 1280
TEST_ROWS = 128


def kinds_rows(n: int, seed: int = 7) -> list[dict]:
    """``n`` rows of the tiny world's kinds task, {"prompt": "42 ae", "completion": "digits vowels"}:
    its corpus words (2 to 5 a row) and their kinds, as examples/tiny/build.py makes kinds_sft.jsonl
    (256 rows; recipes whose batch size the command line cannot change need more)."""
    from examples.tiny.build import _sentence, word_kind

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = _sentence(rng, 2, 5).split()
        rows.append({"prompt": " ".join(words), "completion": " ".join(word_kind(w) for w in words)})
    return rows


def _chats(rows: list[dict]) -> list[dict]:
    return [{"prompt": r["prompt"], "prompt_id": str(i), "category": "kinds",
             "messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for i, r in enumerate(rows)]


def _gsm8k(rows: list[dict]) -> list[dict]:
    return [{"question": r["prompt"], "answer": f"count the words\n#### {len(r['prompt'].split())}"} for r in rows]


def _hh(rows: list[dict]) -> list[dict]:
    def convo(answer: str, prompt: str) -> str:
        return f"\n\nHuman: {prompt}\n\nAssistant: {answer}"

    return [{"chosen": convo(r["completion"], r["prompt"]),
             "rejected": convo(" ".join(reversed(r["prompt"].split())), r["prompt"])} for r in rows]


def _sciknoweval(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        answer = r["completion"].split()[0]  # the first word's kind
        out.append({"question": f"What kind is the first word of: {r['prompt']}", "domain": "Chemistry",
                    "type": "mcq-4-choices", "details": {"level": "L3"}, "answerKey": "ABCD"[KINDS.index(answer)],
                    "choices": {"label": list("ABCD"), "text": list(KINDS)}})
    return out


def hub_datasets() -> dict[tuple[str, str], dict[str, list[dict]]]:
    """(repo id, config) -> split -> rows, for every hub dataset the recipes here load."""
    kinds = kinds_rows(TRAIN_ROWS + TEST_ROWS)
    train, test = kinds[:TRAIN_ROWS], kinds[TRAIN_ROWS:]
    return {
        ("HuggingFaceH4/no_robots", "default"): {"train": _chats(train), "test": _chats(test)},
        ("openai/gsm8k", "main"): {"train": _gsm8k(train), "test": _gsm8k(test[:2])},
        ("Anthropic/hh-rlhf", "default"): {"train": _hh(train), "test": _hh(test[:8])},
        ("zwhe99/DeepMath-103K", "default"): {"train": [{"question": r["prompt"]} for r in train]},
        ("hicai-zju/SciKnowEval", "default"): {"test": _sciknoweval(train)},
    }


def build_datasets_cache(cache: Path) -> Path:
    """Fill ``cache`` (an empty folder: a test's own) with every dataset of ``hub_datasets``."""
    for (repo_id, config), splits in hub_datasets().items():
        cache_dataset(repo_id, config, splits, cache)
    return cache


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chats(rows: list[dict]) -> list[dict]:
    """Rows as the cookbook's conversation files hold them ({"messages": [user, assistant]}: chat_sl's
    ``dataset=<.jsonl>``, prompt_distillation's ``file_path``)."""
    return [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
            for r in rows]


def labels(rows: list[dict]) -> list[dict]:
    """prompt_distillation's data as its create_data.py writes it (the text, then the teacher's one-word
    label): here the kind of the text's first word, a label the tiny model learns to give."""
    return chats([{"prompt": r["prompt"], "completion": r["completion"].split()[0]} for r in rows])


def rubric_rows(rows: list[dict]) -> list[dict]:
    """rubric's RubricBasedDatapoint lines ({"convo", "rubric_items"}). The grader is the tiny model, which
    never writes the default "<score>...</score>": each item's extraction_regex (part of the row) reads the
    first digit the grader writes instead, so scores vary from sample to sample (the advantages are not all
    zero) though they judge nothing."""
    item = {"rubric_str": "The answer names the kind of each word.", "extraction_regex": r"(\d)",
            "grader_output_format_instruction": "Write a digit from 0 to 9."}
    return [{"convo": [{"role": "user", "content": r["prompt"]}], "rubric_items": [item]} for r in rows]


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.integration.cookbook_datasets <empty folder for HF_DATASETS_CACHE>")
    print(build_datasets_cache(Path(sys.argv[1])))
