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

All of them share batches: in one batch request (one prefill batch), the lm_head adapter's
sequences sit beside the other adapters' and the base's, with and without prompt log-probs.
SGLang 0.5.23's CPU LoRA backend routed the pruned lm_head rows of such a batch by the whole
sequences' lengths (errors up to 0.53); rollout/engines/sglang_lm_head_rows.py fixes it, and these tests
are what fail without it.

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

from rollout.engines.weights import AdapterWeights
from tests.integration.sglang_fixtures import TINY_LORA_TARGETS, make_peft_adapter, one_torch_thread, running_sglang_server

pytestmark = pytest.mark.integration

# SGLang computes prompt log-probs in passes of this many rows (default 2048): small here, so the
# batch request with prompt log-probs also runs lm_head pass by pass, each pass on its own table.
LOGPROB_PASS_ROWS = 16


@pytest.fixture(scope="module")
def sglang_server(tiny_world, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_LOGPROB_CHUNK_SIZE", str(LOGPROB_PASS_ROWS))  # read by the server at its start
        with running_sglang_server(tiny_world / "model", tmp_path_factory.mktemp("sglang-logs")) as server:
            yield server

ABS_TOL = 1e-5
ADAPTERS = {"p8": dict(seed=11, rank=8, alpha=16), "p4": dict(seed=12, rank=4, alpha=4),
            # LoRA on lm_head too (the unembedding; peft also saves the tied base weight beside it)
            "p4u": dict(seed=13, rank=4, alpha=8, target_modules=TINY_LORA_TARGETS + ["lm_head"])}
PROMPTS = ["<|user|>ab 12 ou\n<|assistant|>", "zz 12 aei", "<|user|>7 7 ua kk\n<|assistant|>"]
# The batch requests' own prompts, one set per request: a prompt the server has cached for that
# adapter is extended by its last token only, which would hide a routing error of the pruned rows.
BATCH_PROMPTS = {-1: ["<|user|>kk 3 ie\n<|assistant|>", "ua ou 41 b", "<|user|>9 zz a\n<|assistant|>"],
                 2: ["<|user|>e 5 5 o\n<|assistant|>", "ba 77 ko", "<|user|>12 ie zu\n<|assistant|>"]}
SAMPLES_PER_PROMPT = 2
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("parity-adapters")
    return {name: make_peft_adapter(tiny_world / "model", root / name, **a) for name, a in ADAPTERS.items()}


def tokenized(model_dir, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def prompt_ids(tiny_world):
    return tokenized(tiny_world / "model", PROMPTS)


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
def served(sglang_server, adapter_dirs, prompt_ids, tiny_world):
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
            # Every adapter at once (the lm_head one among them): the scheduler mixes them in its batches.
            keys, jobs = [], []
            for served_name in names:
                for prompt in prompt_ids:
                    for _ in range(SAMPLES_PER_PROMPT):
                        jobs.append(client.generate(rid=f"parity::{uuid.uuid4().hex}", input_ids=prompt,
                                                    sampling_params=SAMPLING, lora_name=served_name))
                        keys.append((served_name, prompt))
            results = await asyncio.gather(*jobs)
            batched = {start: await one_batch_request(sglang_server.url, names, tokenized(tiny_world / "model", texts), start)
                       for start, texts in BATCH_PROMPTS.items()}
            for served_name in names:
                if served_name is not None:
                    await client.unload_adapter(served_name)
        finally:
            await client.aclose()
        out: dict = {}
        for (served_name, prompt), r in zip(keys, results):
            assert r.finish_reason == "length" and len(r.logprobs) == len(r.token_ids) == SAMPLING["max_new_tokens"]
            out.setdefault(served_name, []).append((prompt, r.token_ids, r.logprobs))
        return out, names, batched

    return asyncio.run(run())


async def one_batch_request(url: str, names: dict, prompt_ids: list[list[int]], logprob_start_len: int) -> list:
    """One /generate call with a list of sequences: every served adapter and the base, each on every
    prompt, the lm_head adapter's sequences between the others'. SGLang admits the list together, in
    as few prefill batches as --max-loras-per-batch allows, each mixing several adapters.
    ``logprob_start_len`` >= 0 also asks for the prompts' log-probs from there, so the lm_head sees
    several rows per sequence instead of one. -> [(served name, prompt, GenerateResult)]."""
    import httpx

    from rollout.engines.client import parse_generate_response

    order = sorted(names, key=lambda n: (n is not None, n or ""))  # the base first, then by name
    seqs = [(n, p) for p in prompt_ids for n in order]
    rid = f"parity-batch::{uuid.uuid4().hex}"
    payload = {"rid": [f"{rid}-{i}" for i in range(len(seqs))], "input_ids": [p for _, p in seqs],
               "lora_path": [n for n, _ in seqs], "sampling_params": SAMPLING, "return_logprob": True,
               "logprob_start_len": logprob_start_len}
    async with httpx.AsyncClient(timeout=600.0) as http:
        resp = await http.post(f"{url}/generate", json=payload)
    resp.raise_for_status()
    bodies = resp.json()
    assert isinstance(bodies, list) and len(bodies) == len(seqs), bodies
    return [(n, p, parse_generate_response(f"{rid}-{i}", b)) for i, ((n, p), b) in enumerate(zip(seqs, bodies))]


def test_every_sequence_of_every_adapter_matches_hf_peft(served, adapter_dirs, tiny_world):
    out, names, _ = served
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


@pytest.mark.parametrize("logprob_start_len", [-1, 2])
def test_one_prefill_batch_mixing_the_lm_head_adapter_with_others_matches_hf_peft(served, adapter_dirs, tiny_world,
                                                                                logprob_start_len):
    """The sampled tokens (the first drawn from the prefill's pruned lm_head rows) and, from position 2,
    the prompt tokens of every sequence of one mixed batch request, against HF+PEFT teacher-forced."""
    _, names, batched = served
    rows = batched[logprob_start_len]
    assert any(has_lm_head(names[n]) for n, _, _ in rows) and any(not has_lm_head(names[n]) for n, _, _ in rows)
    worst = 0.0
    for served_name in names:
        mine = [(p, r) for n, p, r in rows if n == served_name]
        source = names[served_name]
        ref = hf_teacher_forced(tiny_world / "model", adapter_dirs[source] if source else None,
                                [(p[:1], p[1:] + r.token_ids) for p, r in mine])
        for (prompt, r), want in zip(mine, ref):
            assert r.finish_reason == "length" and len(r.logprobs) == SAMPLING["max_new_tokens"]
            got = list(r.logprobs)
            want_out = want[len(prompt) - 1:]
            if logprob_start_len >= 0:  # SGLang's list: positions start.. of the prompt, the first one None
                assert r.prompt_logprobs[0] is None and None not in r.prompt_logprobs[1:], r.prompt_logprobs
                got = r.prompt_logprobs[1:] + got
                want_out = want[logprob_start_len:]  # want[k - 1]: position k's token
            assert len(got) == len(want_out), (served_name, len(got), len(want_out))
            err = max(abs(a - b) for a, b in zip(got, want_out))
            worst = max(worst, err)
            assert err <= ABS_TOL, (served_name, prompt, logprob_start_len, err)
    print(f"one mixed batch, logprob_start_len={logprob_start_len}: worst |SGLang - HF+PEFT| {worst:.2e}")


def test_adapters_really_change_the_logprobs(served, adapter_dirs, tiny_world):
    """HF logprobs of one adapter's sampled sequences under the base and under the other
    adapter differ from its own by far more than the tolerance."""
    out, _, _ = served
    seqs = [(p, t) for p, t, _ in out["p8-disk"]]
    own = hf_teacher_forced(tiny_world / "model", adapter_dirs["p8"], seqs)
    for other in (None, adapter_dirs["p4"]):
        theirs = hf_teacher_forced(tiny_world / "model", other, seqs)
        diff = max(abs(a - b) for x, y in zip(own, theirs) for a, b in zip(x, y))
        assert diff > 100 * ABS_TOL, (other, diff)
