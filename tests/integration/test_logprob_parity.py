"""SGLang's log-probabilities against HF+PEFT, for every sampled token of every sequence.

Three adapters (different rank and alpha, PEFT-made, so q/k/v have different lora_A; one with
LoRA on lm_head as well: SGLang 0.5.23 serves the unembedding's LoRA on the CPU torch_native
backend), each loaded into one real SGLang CPU server twice: from tensors sent in the request
(what weight sync does by default) and from its folder on disk. Sequences are
*sampled* (temperature 1, so they are not the model's favourite tokens and cover more
of the distribution), several per prompt; every returned token log-probability must
equal HF+PEFT's teacher-forced log p(token | prompt, earlier tokens) on the same
sequence, which is what the trainer's importance ratios rely on. The base model (no
adapter) is checked the same way, and the two adapters must differ from it and from
each other (so a server that ignored the adapter would fail).

Tolerance: fp32 on both sides, different kernels (SGLang's torch_native attention and
LoRA backend vs HF eager): worst measured here 9.5e-7 (FINDINGS: 1.5e-5 on another
set-up); ABS_TOL is 1e-5. Module runtime about 150 s on the shared 2-core machine, most of
it the server's start.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from rollout.weights import AdapterWeights
from tests.integration.sglang_fixtures import TINY_LORA_TARGETS, make_peft_adapter, one_torch_thread, sglang_server_fixture

pytestmark = pytest.mark.integration

sglang_server = sglang_server_fixture()

ABS_TOL = 1e-5
ADAPTERS = {"p8": dict(seed=11, rank=8, alpha=16), "p4": dict(seed=12, rank=4, alpha=4),
            # LoRA on lm_head too (the unembedding; peft also saves the tied base weight beside it)
            "p4u": dict(seed=13, rank=4, alpha=8, target_modules=TINY_LORA_TARGETS + ["lm_head"])}
PROMPTS = ["<|user|>ab 12 ou\n<|assistant|>", "zz 12 aei", "<|user|>7 7 ua kk\n<|assistant|>"]
SAMPLES_PER_PROMPT = 2
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("parity-adapters")
    return {name: make_peft_adapter(tiny_world / "model", root / name, **a) for name, a in ADAPTERS.items()}


@pytest.fixture(scope="module")
def prompt_ids(tiny_world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    return [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]


def hf_teacher_forced(model_dir, adapter_dir, sequences):
    """[(prompt, tokens)] -> log p(tokens[i] | prompt + tokens[:i]) lists under HF (+PEFT)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad(), one_torch_thread():
        for prompt, tokens in sequences:
            logp = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
            out.append([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])
    return out


def has_lm_head(adapter: str | None) -> bool:
    return adapter is not None and "lm_head" in ADAPTERS[adapter].get("target_modules", [])


@pytest.fixture(scope="module")
def served(sglang_server, adapter_dirs, prompt_ids):
    """{served name: [(prompt, tokens, logprobs)]}: every adapter by tensors and by disk, and the base."""

    async def run():
        client = sglang_server.client()
        names = {None: None}
        try:
            for name, folder in adapter_dirs.items():
                for transfer in ("tensors", "disk"):
                    served_name = f"{name}-{transfer}"
                    await client.load_adapter(served_name, AdapterWeights.from_folder(folder), transfer=transfer)
                    names[served_name] = name
            # Two batches: the adapters without LoRA on lm_head beside the base, then the lm_head
            # adapter alone. SGLang's CPU backend (0.5.x) returns wrong log-probs when one batch mixes
            # an lm_head adapter with sequences that have none (up to 0.53 for it, 0.099 for the
            # others; each alone within 2e-6): FINDINGS.md, docs/tinker.md "Known problem".
            keys, results = [], []
            for group in ([n for n, src in names.items() if not has_lm_head(src)], [n for n, src in names.items() if has_lm_head(src)]):
                jobs = []
                for served_name in group:
                    for prompt in prompt_ids:
                        for _ in range(SAMPLES_PER_PROMPT):
                            jobs.append(client.generate(rid=f"parity::{uuid.uuid4().hex}", input_ids=prompt,
                                                        sampling_params=SAMPLING, lora_name=served_name))
                            keys.append((served_name, prompt))
                results += await asyncio.gather(*jobs)
            for served_name in names:
                if served_name is not None:
                    await client.unload_adapter(served_name)
        finally:
            await client.aclose()
        out: dict = {}
        for (served_name, prompt), r in zip(keys, results):
            assert r.finish_reason == "length" and len(r.logprobs) == len(r.token_ids) == SAMPLING["max_new_tokens"]
            out.setdefault(served_name, []).append((prompt, r.token_ids, r.logprobs))
        return out, names

    return asyncio.run(run())


def test_every_sequence_of_every_adapter_matches_hf_peft(served, adapter_dirs, tiny_world):
    out, names = served
    worst = 0.0
    for served_name, source in names.items():
        seqs = out[served_name]
        assert len(seqs) == len(PROMPTS) * SAMPLES_PER_PROMPT
        ref = hf_teacher_forced(tiny_world / "model", adapter_dirs[source] if source else None,
                                [(p, t) for p, t, _ in seqs])
        for (prompt, tokens, got), want in zip(seqs, ref):
            err = max(abs(a - b) for a, b in zip(got, want))
            worst = max(worst, err)
            assert err <= ABS_TOL, (served_name, prompt, tokens, err)
    print(f"worst |SGLang - HF+PEFT| logprob: {worst:.2e}")


def test_adapters_really_change_the_logprobs(served, adapter_dirs, tiny_world):
    """HF logprobs of one adapter's sampled sequences under the base and under the other
    adapter differ from its own by far more than the tolerance."""
    out, _ = served
    seqs = [(p, t) for p, t, _ in out["p8-disk"]]
    own = hf_teacher_forced(tiny_world / "model", adapter_dirs["p8"], seqs)
    for other in (None, adapter_dirs["p4"]):
        theirs = hf_teacher_forced(tiny_world / "model", other, seqs)
        diff = max(abs(a - b) for x, y in zip(own, theirs) for a, b in zip(x, y))
        assert diff > 100 * ABS_TOL, (other, diff)
