"""Build the embedded tiny world, offline and deterministically.

What it makes (under ``.cache/tiny/`` of the repo unless ``LORAFLEET_TINY_DIR``
says otherwise):

* ``model/``: a tiny Qwen3-style decoder in Hugging Face format (hidden 64,
  4 layers, 4 heads / 2 kv heads, head_dim 16, vocab 400, tied embeddings,
  about 270k parameters) with a byte-level BPE tokenizer trained here with
  ``tokenizers``. The model is briefly pre-trained on a synthetic corpus of
  "words" made of digits, vowels and consonants, so that it writes corpus-like
  text and a LoRA can shift *which kind* of word it prefers.
* ``data/``: prompt datasets (JSONL) for three adapters:
    - ``digits.jsonl`` (RL): reward = share of the response's characters that are digits;
    - ``vowels.jsonl`` (RL): reward = share of the response's characters that are vowels;
    - ``kinds_sft.jsonl`` (SFT, the main job's SFT adapter): prompt/completion
      pairs, completion = the kind of each of the prompt's words (``digits``,
      ``vowels``, ``consonants`` or ``mixed``), e.g. "42 ae xk" -> " digits vowels
      consonants". The tiny model learns this within the main job (loss about
      4.3 -> 2.4 over 42 steps of 6 examples); it cannot learn to copy or
      reverse words in that time (its loss stays near 4, measured);
    - ``echo_sft.jsonl`` (SFT, used by tests): completion = the prompt's words in
      reverse order, a task the tiny model barely moves on.
  The RL label is the target character set; the built-in reward
  ``target_share`` (rollout/rewards.py) scores it.

* ``hf/``: the same model under a hub-style name, for clients that look models up
  by name (the Tinker SDK's and tinker-cookbook's tokenizer and renderer lookups),
  offline: ``hf/hub/`` is a Hugging Face hub cache (``HF_HUB_CACHE`` layout:
  ``models--Qwen--Qwen3-8B-Base/snapshots/<rev>/`` + ``refs/main``) holding the tiny
  model's files, and ``hf/datasets/`` a ``datasets`` cache (``HF_DATASETS_CACHE``)
  holding tiny-world rows under the two hub datasets the cookbook's ``sl_loop`` and
  ``rl_loop`` hard-code. ``hf_env()`` gives the environment that points a client there
  (``HF_HUB_OFFLINE=1``). See ``SERVED_NAME`` for why that name.

* ``long_context_view(world, out, tokens)``: a view of a built world whose model takes a
  longer context (``max_position_embeddings`` raised in a config.json of its own, every
  other file a symlink into the world), for the tests whose requests outgrow 512 tokens.

Everything is seeded and runs single-threaded, so two builds give the same
bytes. A stamp file records the build version; ``ensure_tiny_world()`` builds
only when it is missing or stale (the ``hf/`` folder has a stamp of its own, so
adding it rebuilt nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

BUILD_VERSION = "tiny-v2"  # v2: kinds_sft.jsonl added
REPO_ROOT = Path(__file__).resolve().parents[2]

DIGITS = "0123456789"
VOWELS = "aeiou"
CONSONANTS = "bcdfghjklmnpqrstvwxyz"

MODEL_CONFIG = dict(
    vocab_size=400,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# The tiny world's served name (base_model.served_name in a job file). tinker-cookbook picks
# its renderer from a table of real hub ids, so the name must be one of them: a Qwen3 base
# (non-chat) model, which the cookbook renders with `role_colon` (plain "User: ...\n\nAssistant: ..."
# text that the tiny byte-level tokenizer encodes). Only a label: the weights are the tiny model.
SERVED_NAME = "Qwen/Qwen3-8B-Base"
HF_VERSION = "hf-v1"
HF_REVISION = "0" * 40  # the snapshot's revision id (any 40 hex digits; refs/main names it)
# Hub datasets that cookbook recipes load by name (sl_loop: no_robots; rl_loop: gsm8k "main"),
# filled with tiny-world rows: (repo id, config, rows builder name).
HF_DATASETS = (("HuggingFaceH4/no_robots", "default", "chat_rows"), ("openai/gsm8k", "main", "question_rows"))


def tiny_dir() -> Path:
    return Path(os.environ.get("LORAFLEET_TINY_DIR", REPO_ROOT / ".cache" / "tiny"))


def _word(rng: random.Random) -> str:
    kind = rng.random()
    n = rng.randint(1, 5)
    if kind < 0.3:
        return "".join(rng.choice(DIGITS) for _ in range(n))
    if kind < 0.6:
        return "".join(rng.choice(VOWELS) for _ in range(n))
    if kind < 0.85:
        return "".join(rng.choice(CONSONANTS) for _ in range(n))
    return "".join(rng.choice(DIGITS + VOWELS + CONSONANTS) for _ in range(n))


def word_kind(word: str) -> str:
    """The kind of a corpus word (see _word): digits, vowels, consonants, or mixed."""
    for kind, chars in (("digits", DIGITS), ("vowels", VOWELS), ("consonants", CONSONANTS)):
        if all(c in chars for c in word):
            return kind
    return "mixed"


def _sentence(rng: random.Random, lo: int = 4, hi: int = 12) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(lo, hi)))


def build_tokenizer(corpus: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL_CONFIG["vocab_size"],
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.get_vocab_size() <= MODEL_CONFIG["vocab_size"], tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(tokenizer, corpus: list[str], out: Path, steps: int, quiet: bool) -> int:
    """Pre-train and save the tiny model; returns its parameter count."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        **MODEL_CONFIG,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return pretrain_and_save(Qwen3ForCausalLM(cfg), tokenizer, corpus, out, steps, quiet, tag="tiny")


def pretrain_and_save(model, tokenizer, corpus: list[str], out: Path, steps: int, quiet: bool, tag: str) -> int:
    """Pre-train ``model`` briefly on the corpus (next-token prediction), save it; return its
    parameter count. Shared by every embedded world (examples/tiny_moe/build.py too).
    Sequences are sentences joined by EOS, cut to fixed windows."""
    import torch

    ids: list[int] = []
    for s in corpus:
        ids.extend(tokenizer.encode(s))
        ids.append(tokenizer.eos_token_id)
    data = torch.tensor(ids, dtype=torch.long)
    seq, bsz = 64, 16
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (bsz,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not quiet and (step % 50 == 0 or step == steps - 1):
            print(f"[{tag}] pretrain step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def make_corpus() -> list[str]:
    """The synthetic pre-training corpus (also the tokenizer's training text)."""
    rng = random.Random(0)
    return [_sentence(rng) for _ in range(4000)]


def build_datasets(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)

    def write(name: str, rows: list[dict]) -> None:
        with open(out / name, "w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")

    write(
        "digits.jsonl",
        [{"prompt": _sentence(rng, 3, 8), "label": DIGITS, "metadata": {"task": "digits", "i": i}} for i in range(256)],
    )
    write(
        "vowels.jsonl",
        [{"prompt": _sentence(rng, 3, 8), "label": VOWELS, "metadata": {"task": "vowels", "i": i}} for i in range(256)],
    )
    sft = []
    for i in range(256):
        words = _sentence(rng, 2, 5).split()
        sft.append({"prompt": " ".join(words), "completion": " " + " ".join(reversed(words)), "metadata": {"i": i}})
    write("echo_sft.jsonl", sft)
    # A generator of its own, so adding this file left the three above byte-identical.
    krng = random.Random(4321)
    kinds = []
    for i in range(256):
        words = _sentence(krng, 2, 5).split()
        kinds.append({"prompt": " ".join(words), "completion": " " + " ".join(word_kind(w) for w in words), "metadata": {"i": i}})
    write("kinds_sft.jsonl", kinds)


def chat_rows(data: Path) -> list[dict]:
    """kinds_sft.jsonl as chat conversations (the no_robots schema: a ``messages`` list)."""
    rows = [json.loads(line) for line in (data / "kinds_sft.jsonl").read_text().splitlines()]
    return [{"prompt": r["prompt"], "prompt_id": str(r["metadata"]["i"]), "category": "kinds",
             "messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"].strip()}]}
            for r in rows]


def question_rows(data: Path) -> list[dict]:
    """digits.jsonl prompts as gsm8k-style rows (question, answer ending in '#### <number>')."""
    rows = [json.loads(line) for line in (data / "digits.jsonl").read_text().splitlines()]
    return [{"question": r["prompt"], "answer": f"count the words\n#### {len(r['prompt'].split())}"} for r in rows]


def hf_dirs(world: Path) -> tuple[Path, Path]:
    """The hub cache and the datasets cache of the tiny world's ``hf/`` folder."""
    return world / "hf" / "hub", world / "hf" / "datasets"


def hf_env(world: Path) -> dict[str, str]:
    """Environment variables that make a client resolve ``SERVED_NAME`` (and the recipes' hub
    datasets) from the tiny world, offline. Set them before huggingface_hub is imported
    (it reads them once)."""
    hub, datasets_dir = hf_dirs(world)
    return {"HF_HUB_CACHE": str(hub), "HF_DATASETS_CACHE": str(datasets_dir), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def build_hf_cache(world: Path) -> None:
    """Fill ``<world>/hf/`` from the built model and data (see the module docstring); deterministic."""
    import shutil

    hub, datasets_dir = hf_dirs(world)
    shutil.rmtree(world / "hf", ignore_errors=True)
    repo = hub / ("models--" + SERVED_NAME.replace("/", "--"))
    snapshot = repo / "snapshots" / HF_REVISION
    snapshot.mkdir(parents=True)
    for f in sorted((world / "model").iterdir()):
        shutil.copyfile(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HF_REVISION)
    for repo_id, config, rows_fn in HF_DATASETS:
        cache_dataset(repo_id, config, {"train": globals()[rows_fn](world / "data")}, datasets_dir)
    (world / "hf" / "STAMP").write_text(HF_VERSION + "\n")


def cache_dataset(repo_id: str, config: str, splits: dict[str, list[dict]], cache: Path) -> None:
    """``splits`` (split name -> rows) as the splits of ``repo_id``/``config`` in a ``datasets`` cache, in
    the layout ``load_dataset(repo_id, config)`` falls back to offline (``<org>___<name>/<config>/0.0.0/<hash>``):
    written by datasets' own parquet builder under the dataset's short name, then moved under its org
    (also the cookbook tests' datasets: tests/integration/cookbook_datasets.py)."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    org, name = repo_id.split("/")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, rows in splits.items():
            files[split] = str(Path(tmp) / f"{split}.parquet")
            pq.write_table(pa.Table.from_pylist(rows), files[split])
        builder = Parquet(cache_dir=str(Path(tmp) / "cache"), dataset_name=name, config_name=config, config_id=config,
                          data_files=files, hash="tiny")
        builder.download_and_prepare()
        folder = camelcase_to_snakecase(name)  # datasets' name for it ("DeepMath-103K" -> "deep_math-103_k")
        target = cache / f"{org}___{folder}"
        target.parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / "cache" / folder).rename(target)
    for lock in target.rglob("*.lock"):
        lock.unlink()


def ensure_hf_cache(world: Path) -> None:
    if not is_current(world / "hf", HF_VERSION):
        build_hf_cache(world)


def long_context_view(world: Path, out: Path, tokens: int = 4096) -> Path:
    """``out``: the tiny ``world`` with a model of ``tokens`` positions, nothing copied or downloaded.
    ``out/model/`` holds symlinks to the world model's files (weights, tokenizer) but config.json,
    written with ``max_position_embeddings = tokens``; the world's other parts (``data/``, ``hf/``,
    ``STAMP``) are symlinks. The same weights serve the longer context because the model's only
    position signal is RoPE of type default, computed from each position index and sized by nothing
    in the config: positions below the world's own context give the same logits (checked with HF
    transformers by tests/integration/test_cookbook_recipes.py's ``long_world``). The hub cache
    (``hf/``) keeps the world's config.json: clients read only its tokenizer. Rebuilt in place
    when called again; ``out`` is returned."""
    world = world.resolve()
    config = json.loads((world / "model" / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{world}: RoPE of type {rope['rope_type']!r} depends on the context it was sized for")
    if tokens < config["max_position_embeddings"]:
        raise ValueError(f"{tokens} tokens is shorter than the world's {config['max_position_embeddings']}")
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)

    def link(target: Path, at: Path) -> None:
        if at.is_symlink() or at.is_file():
            at.unlink()
        at.symlink_to(target, target_is_directory=target.is_dir())

    for f in sorted((world / "model").iterdir()):
        if f.name != "config.json":
            link(f, model / f.name)
    (model / "config.json").unlink(missing_ok=True)
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": tokens}, indent=2, sort_keys=True) + "\n")
    for part in ("data", "hf", "STAMP"):
        link(world / part, out / part)
    return out


def build_world(out: Path, build_model_fn, version: str, tag: str, *, steps: int, quiet: bool) -> Path:  # noqa: ANN001
    """Build a tiny world into `out`: the shared corpus and tokenizer, the model made by
    `build_model_fn(tokenizer, corpus, model_dir, steps, quiet) -> parameter count`, the
    datasets, and a STAMP naming `version`. Deterministic (one thread, fixed seeds)."""
    import torch

    torch.set_num_threads(1)  # determinism: one thread, fixed reduction order
    corpus = make_corpus()
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus, model_dir)
    n_params = build_model_fn(tok, corpus, model_dir, steps, quiet)
    build_datasets(out / "data")
    (out / "STAMP").write_text(version + "\n")
    if not quiet:
        print(f"[{tag}] built {out} ({n_params} parameters)")
    return out


def is_current(out: Path, version: str) -> bool:
    stamp = out / "STAMP"
    return stamp.exists() and stamp.read_text().strip() == version


def world_cli(description: str, default_dir, version: str, build_fn, tag: str) -> Path:  # noqa: ANN001
    """The `python -m examples.<world>.build` command of a tiny world; returns the world's folder."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, default=None, help=f"output folder (default {default_dir()})")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    out = a.out or default_dir()
    if not a.force and is_current(out, version):
        print(f"[{tag}] up to date: {out}")
        return out
    build_fn(out, quiet=a.quiet)
    print(f"[{tag}] ready: {out}")
    return out


def build(out: Path | None = None, *, steps: int = 300, quiet: bool = False) -> Path:
    world = build_world(out or tiny_dir(), build_model, BUILD_VERSION, "tiny", steps=steps, quiet=quiet)
    build_hf_cache(world)
    return world


def ensure_tiny_world(out: Path | None = None) -> Path:
    """Return the tiny world folder, building it first if missing or stale."""
    out = out or tiny_dir()
    if not is_current(out, BUILD_VERSION):
        build(out, quiet=True)
    ensure_hf_cache(out)
    return out


def main() -> None:
    ensure_hf_cache(world_cli(__doc__.splitlines()[0], tiny_dir, BUILD_VERSION, build, "tiny"))


if __name__ == "__main__":
    main()
