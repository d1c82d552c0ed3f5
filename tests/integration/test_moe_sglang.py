"""Serving the tiny MoE base on a real SGLang CPU server (what the MoE job's rollouts use).

SGLang 0.5.23 runs expert LoRA only through its Triton/CUDA MoE runners, so the server
targets the attention projections only (``--lora-target-modules q_proj k_proj v_proj
o_proj``); its MoE layers then run SGLang's native CPU expert loop. Checked: the base and
an attention-only LoRA give HF's (+PEFT's) greedy continuations.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.sglang_fixtures import GREEDY, hf_greedy, make_peft_adapter, running_sglang_server

pytestmark = pytest.mark.integration

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPTS = [[72, 277, 82, 270, 25], [1, 27, 377, 28, 23, 260]]


@pytest.fixture(scope="module")
def moe_world():
    from examples.tiny_moe.build import ensure_tiny_moe_world

    return ensure_tiny_moe_world()


@pytest.fixture(scope="module")
def moe_server(moe_world, tmp_path_factory):
    with running_sglang_server(moe_world / "model", tmp_path_factory.mktemp("sglang-moe-logs"),
                               lora_target_modules=ATTENTION) as server:
        yield server


def _greedy(server, prompts, lora=None):
    out = []
    for ids in prompts:
        body = {"input_ids": ids, "sampling_params": GREEDY} | ({"lora_path": lora} if lora else {})
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
    return out


def test_base_and_attention_lora_match_hf(moe_server, moe_world, tmp_path):
    model = moe_world / "model"
    base = _greedy(moe_server, PROMPTS)
    assert base == hf_greedy(model, None, PROMPTS)
    adapter = make_peft_adapter(model, tmp_path / "attn", seed=3, rank=8, target_modules=ATTENTION)
    r = httpx.post(moe_server.url + "/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(adapter)}, timeout=120)
    assert r.status_code == 200, r.text
    ours = _greedy(moe_server, PROMPTS, lora="attn")
    assert ours == hf_greedy(model, adapter, PROMPTS)
    assert ours != base  # the adapter changes the output
