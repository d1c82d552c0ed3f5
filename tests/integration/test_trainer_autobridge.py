"""Smoke: the tiny HF model converts through AutoBridge into a Megatron model on
this machine (CPU adjustments from trainer/platform/cpu_compat.py) and gives the HF logits."""

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def megatron_tiny(tiny_world):
    from trainer.base.base_model import build_frozen_base
    from trainer.platform.distributed import init_parallel

    init_parallel(tp=1, dp=1, seed=0)
    return build_frozen_base(tiny_world / "model", tp=1, dtype="auto")


def test_autobridge_logits_match_hf(megatron_tiny, tiny_world):
    from transformers import AutoModelForCausalLM

    from trainer.base.base_model import causal_mask, token_logprobs

    base = megatron_tiny
    assert base.dtype == torch.float32 and base.layer_spec == "local"
    assert all(not p.requires_grad for p in base.model.parameters())
    hf = AutoModelForCausalLM.from_pretrained(tiny_world / "model", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (3, 23), generator=g)
    pos = torch.arange(23).unsqueeze(0).expand(3, -1)
    with torch.no_grad():
        ours = base.model(ids, pos, causal_mask(23, ids.device))
        ref = hf(ids).logits
        assert ours.shape == ref.shape == (3, 23, hf.config.vocab_size)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-5, diff
        # the trainer's per-token log-probs are HF's log-softmax at the labels
        labels = torch.roll(ids, -1, dims=1)
        lp = token_logprobs(base, ids, labels)
        ref_lp = torch.log_softmax(ref, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        assert (lp - ref_lp).abs().max().item() <= 1e-5
    assert ref.abs().max().item() > 1.0  # not a degenerate all-zero comparison
