"""The tiny world's hub-style name resolves offline, as a name-based client looks it up.

A fresh interpreter with only `hf_env()` set (huggingface_hub reads its cache location once,
at import) loads the tokenizer by `SERVED_NAME` and the two hub datasets the cookbook's
sl_loop / rl_loop hard-code; each must equal the tiny world's own files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from examples.tiny.build import HF_DATASETS, SERVED_NAME, chat_rows, hf_env, question_rows

pytestmark = pytest.mark.unit

PROBE = f"""
import json
from transformers import AutoTokenizer
import datasets
tok = AutoTokenizer.from_pretrained({SERVED_NAME!r})
out = {{"ids": tok.encode("User: 42 ae xk\\n\\nAssistant:"), "eos": tok.eos_token_id}}
for repo_id, config, _ in {HF_DATASETS!r}:
    out[repo_id] = datasets.load_dataset(repo_id, config)["train"].to_list()
print("RESULT" + json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])


def test_served_name_and_recipe_datasets_resolve_offline(tiny_world):
    from transformers import AutoTokenizer

    got = _probe(hf_env(tiny_world))
    local = AutoTokenizer.from_pretrained(tiny_world / "model")
    assert got["ids"] == local.encode("User: 42 ae xk\n\nAssistant:") and got["eos"] == local.eos_token_id
    assert got["HuggingFaceH4/no_robots"] == chat_rows(tiny_world / "data")
    assert got["openai/gsm8k"] == question_rows(tiny_world / "data")
    # Built from the world's own rows: kinds_sft as conversations, digits prompts as questions.
    first = json.loads((tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()[0])
    assert got["HuggingFaceH4/no_robots"][0]["messages"][1]["content"] == first["completion"].strip()

