"""Build the embedded tiny mixture-of-experts world, offline and deterministically.

What it makes (under ``.cache/tiny_moe/`` of the repo unless ``LORAFLEET_TINY_MOE_DIR``
says otherwise), next to the dense tiny world (examples/tiny/build.py) and with the
same tokenizer, corpus and datasets (built by that module's code):

* ``model/``: a tiny Qwen3-MoE decoder in Hugging Face format (``qwen3_moe``: hidden 64,
  4 layers, 4 heads / 2 kv heads, head_dim 16, every MLP a sparse block of 8 routed
  experts, top-2 with normalized top-k weights, expert width 32, no shared expert, vocab
  400, untied embeddings as Qwen3-30B-A3B), briefly pre-trained on the dense world's corpus;
* ``data/``: the dense world's datasets (digits / vowels RL, echo_sft SFT).

Seeded and single-threaded, so two builds give the same bytes; a stamp file records
the build version and ``ensure_tiny_moe_world()`` builds only when it is missing or stale.
"""

from __future__ import annotations

import os
from pathlib import Path

from examples.tiny.build import MODEL_CONFIG as DENSE_CONFIG
from examples.tiny.build import build_world, is_current, pretrain_and_save, world_cli

BUILD_VERSION = "tiny-moe-v3"  # v3: the shared datasets gained kinds_sft.jsonl
REPO_ROOT = Path(__file__).resolve().parents[2]

# The dense tiny model's attention and embeddings, with every MLP a sparse MoE block.
MODEL_CONFIG = dict(
    {k: v for k, v in DENSE_CONFIG.items() if k != "intermediate_size"},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,  # as Qwen3-30B-A3B
    decoder_sparse_step=1,
    mlp_only_layers=[],
    intermediate_size=128,  # unused (no dense MLP layer); set for completeness
    # Untied, as Qwen3-30B-A3B; also needed by SGLang 0.5.23, whose Qwen3-MoE model ignores
    # tie_word_embeddings and would serve a zero lm_head (uniform logits) for a tied checkpoint.
    tie_word_embeddings=False,
)


def tiny_moe_dir() -> Path:
    return Path(os.environ.get("LORAFLEET_TINY_MOE_DIR", REPO_ROOT / ".cache" / "tiny_moe"))


def build_model(tokenizer, corpus: list[str], out: Path, steps: int, quiet: bool) -> int:
    """Pre-train and save the tiny MoE model; returns its parameter count."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        **MODEL_CONFIG,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return pretrain_and_save(Qwen3MoeForCausalLM(cfg), tokenizer, corpus, out, steps, quiet, tag="tiny-moe")


def build(out: Path | None = None, *, steps: int = 300, quiet: bool = False) -> Path:
    return build_world(out or tiny_moe_dir(), build_model, BUILD_VERSION, "tiny-moe", steps=steps, quiet=quiet)


def ensure_tiny_moe_world(out: Path | None = None) -> Path:
    """Return the tiny MoE world folder, building it first if missing or stale."""
    out = out or tiny_moe_dir()
    if not is_current(out, BUILD_VERSION):
        build(out, quiet=True)
    return out


def main() -> None:
    world_cli(__doc__.splitlines()[0], tiny_moe_dir, BUILD_VERSION, build, "tiny-moe")


if __name__ == "__main__":
    main()
