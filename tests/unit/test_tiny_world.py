"""The embedded tiny world is built deterministically and has what the other parts expect."""

import hashlib
import json

import pytest

from examples.tiny.build import MODEL_CONFIG, build_datasets, ensure_tiny_world, long_context_view, word_kind

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


def test_long_context_view_links_the_world_and_raises_only_the_context(tiny_world, tmp_path):
    """The view's model is the world's files (symlinks) but config.json, which differs in
    max_position_embeddings alone; made again in place, it is the same. Its logits are checked against
    the world's with HF transformers in tests/integration/test_cookbook_recipes.py (long_world)."""
    view = long_context_view(tiny_world, tmp_path / "long", 4096)
    assert long_context_view(tiny_world, tmp_path / "long", 4096) == view
    model = tiny_world / "model"
    assert sorted(p.name for p in (view / "model").iterdir()) == sorted(p.name for p in model.iterdir())
    for f in (view / "model").iterdir():
        if f.name != "config.json":
            assert f.is_symlink() and f.resolve() == (model / f.name).resolve(), f
    config = json.loads((view / "model" / "config.json").read_text())
    assert not (view / "model" / "config.json").is_symlink()
    assert config == {**json.loads((model / "config.json").read_text()), "max_position_embeddings": 4096}
    for part in ("data", "hf", "STAMP"):
        assert (view / part).is_symlink() and (view / part).resolve() == (tiny_world / part).resolve()


def test_long_context_view_refuses_what_the_weights_cannot_serve(tiny_world, tmp_path):
    with pytest.raises(ValueError, match="shorter than"):
        long_context_view(tiny_world, tmp_path / "short", 256)
    world = tmp_path / "yarn"
    (world / "model").mkdir(parents=True)
    config = json.loads((tiny_world / "model" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (world / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="yarn"):
        long_context_view(world, tmp_path / "long", 4096)
