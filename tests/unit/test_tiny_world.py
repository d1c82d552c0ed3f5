"""The embedded tiny world is built deterministically and has what the other parts expect."""

import hashlib
import json

import pytest

from examples.tiny.build import MODEL_CONFIG, build_datasets, ensure_tiny_world, word_kind

pytestmark = pytest.mark.unit


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_model_and_tokenizer_load(tiny_world):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_world / "model")
    assert cfg.model_type == "qwen3"
    assert cfg.hidden_size == MODEL_CONFIG["hidden_size"] and cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    assert len(tok) <= MODEL_CONFIG["vocab_size"]
    text = "ab 123 xyz"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|assistant|>")


def test_datasets_have_the_keys(tiny_world):
    for name, keys in {"digits.jsonl": {"prompt", "label", "metadata"}, "vowels.jsonl": {"prompt", "label", "metadata"},
                       "echo_sft.jsonl": {"prompt", "completion"}, "kinds_sft.jsonl": {"prompt", "completion"}}.items():
        rows = [json.loads(line) for line in (tiny_world / "data" / name).read_text().splitlines()]
        assert len(rows) == 256
        assert all(keys <= set(r) for r in rows), name
    digits = json.loads((tiny_world / "data" / "digits.jsonl").read_text().splitlines()[0])
    assert digits["label"] == "0123456789"


def test_kinds_sft_completions_name_each_word_kind(tiny_world):
    rows = [json.loads(line) for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["completion"] == " " + " ".join(word_kind(w) for w in r["prompt"].split())
    assert [word_kind(w) for w in ("042", "aeu", "xkt", "a1k")] == ["digits", "vowels", "consonants", "mixed"]
    assert {k for r in rows for k in r["completion"].split()} == {"digits", "vowels", "consonants", "mixed"}


def test_datasets_are_deterministic(tmp_path, tiny_world):
    build_datasets(tmp_path / "a")
    assert _digest(tmp_path / "a") == _digest(tiny_world / "data")


def test_ensure_is_idempotent(tiny_world):
    before = _digest(tiny_world / "model")
    assert ensure_tiny_world() == tiny_world
    assert _digest(tiny_world / "model") == before
