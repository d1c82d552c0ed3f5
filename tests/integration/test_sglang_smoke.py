"""Smoke test: a real SGLang server on CPU serves the tiny model with a PEFT LoRA exactly like HF+PEFT.

The server's whole life is inside the test (one start, ~40 s), so the test can
also check that the server is gone afterwards, including when the block exits
with an error.
"""

from __future__ import annotations

import os

import httpx
import pytest

from rollout.engines.sglang_cpu import resolve_device
from tests.integration.sglang_fixtures import GREEDY, hf_greedy, make_peft_adapter, running_sglang_server

# Opt-in (-m slow, CI budget): test_logprob_parity.py proves more in the default tier (every sampled
# token of three PEFT adapters, by tensors and from disk, and the base, against HF + PEFT).
pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Planned(Exception):
    """Raised on purpose inside the server block to check the server still stops."""


def _group_gone(pgid: int) -> bool:
    """No process is left in the server's process group (server, scheduler, detokenizer)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sglang_cpu_server_serves_peft_lora_like_hf(tiny_world, tmp_path):
    model_dir = tiny_world / "model"
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", seed=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["<|user|>ab 12 ou\n<|assistant|>", "zz 12 aei"]]
    want_lora = hf_greedy(model_dir, adapter, prompts)
    want_base = hf_greedy(model_dir, None, prompts)
    assert want_lora != want_base  # the adapter really changes the output

    seen = {}
    with pytest.raises(Planned):
        with running_sglang_server(model_dir, tmp_path / "logs") as server:
            seen["pid"] = server.engine.pid
            assert server.engine.launch.device == resolve_device("auto")
            assert server.url.startswith("http://127.0.0.1:")

            r = httpx.post(server.url + "/load_lora_adapter", json={"lora_name": "smoke", "lora_path": str(adapter)}, timeout=60)
            assert r.status_code == 200, r.text
            out = {}
            for name in ("smoke", None):
                out[name] = []
                for ids in prompts:
                    r = httpx.post(server.url + "/generate", timeout=60,
                                   json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": name})
                    assert r.status_code == 200, r.text
                    out[name].append(r.json()["output_ids"])
            assert out["smoke"] == want_lora
            assert out[None] == want_base
            raise Planned()
    assert seen["pid"] is not None and _group_gone(seen["pid"])
