"""The embedded tiny MoE world: what the MoE parts expect, and the dense world's tokenizer and data."""

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


def test_config_is_a_small_qwen3_moe(moe_world):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(moe_world / "model")
    assert cfg.model_type == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and not cfg.tie_word_embeddings and cfg.mlp_only_layers == []


def test_shares_the_dense_worlds_tokenizer_and_datasets(moe_world, tiny_world):
    for rel in ("model/tokenizer.json", "data/digits.jsonl", "data/vowels.jsonl", "data/echo_sft.jsonl"):
        assert (moe_world / rel).read_bytes() == (tiny_world / rel).read_bytes(), rel
