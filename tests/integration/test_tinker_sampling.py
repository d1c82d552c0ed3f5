"""Tinker sampling through a real SGLang CPU server (one per module, ~35-60 s to start):
samples after ``save_weights_for_sampler`` follow the new weights and equal HF+PEFT greedy
on the exported folder; the base model's samples equal HF's; another tenant cannot sample
with a caller's sampler checkpoint; an RL loop (sample -> score -> importance_sampling ->
optim_step) raises the reward of the tiny world's digits task. A model made with the SDK's
defaults (LoRA on lm_head too) is served with its unembedding LoRA: every sampled token's
logprob equals HF+PEFT's on the exported folder (SGLang 0.5.23's lm_head LoRA on the CPU
torch_native backend). An empty stop list samples past EOS to max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.sglang_fixtures import hf_greedy, sglang_server_fixture

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-sampling-key", "bob": "tml-bob-sampling-key1"}
BASE = "tiny-qwen3"
sglang_server = sglang_server_fixture(max_lora_rank=8)
ITERATIONS = 12


@pytest.fixture(scope="module")
def world(tiny_world, tmp_path_factory, sglang_server):
    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app

    svc = in_process_service(tiny_world / "model", TenantKeys(KEYS), tmp_path_factory.mktemp("ckpt"), num_slots=2,
                             max_rank=8, base_model=BASE, sglang_url=sglang_server.url)
    with ApiServer(tinker_app(svc)) as server:
        yield svc, server.url


def sft_then_sampler_weights(svc, tc, rows, steps, name):
    """``steps`` cross_entropy steps (lr 5e-2) of alice's model ``tc`` on prompt/completion ``rows``
    (the completion's tokens weighted 1), then its sampler weights: (tinker path, folder)."""
    from tinker import types

    tok = tc.get_tokenizer()
    data = []
    for r in rows:
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        data.append(types.Datum(model_input=types.ModelInput.from_ints((p + c)[:-1]),
                                loss_fn_inputs={"target_tokens": (p + c)[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler(name).result().path
    return path, Path(svc.checkpoint_folder("alice", path, kinds=("sampler_weights",)))  # a local store's reference


def greedy(sampler, prompt, n=2, max_tokens=12, stop=None):
    from tinker import types

    res = sampler.sample(types.ModelInput.from_ints(prompt), n, types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)).result()
    return [list(s.tokens) for s in res.sequences], [list(s.logprobs) for s in res.sequences]


def matches_hf(got, ref):
    # Tinker's sampling stops at EOS (token 0 here); HF's reference does not stop: compare the prefix.
    return got == ref[: len(got)] and (len(got) == len(ref) or got[-1] == 0)


def test_samples_follow_saved_weights_and_equal_hf_peft(world, tiny_world):
    svc, url = world
    sc = open_client(url, KEYS["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0, train_unembed=False).result()
    tok = tc.get_tokenizer()
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:8]
    prompts = [tok.encode(r["prompt"]) for r in rows[:3]]
    base = sc.create_sampling_client(base_model=BASE).result()
    base_ref = hf_greedy(tiny_world / "model", None, prompts, max_new_tokens=12)
    for p, ref in zip(prompts, base_ref):
        tokens, logprobs = greedy(base, p)
        assert tokens[0] == tokens[1] and matches_hf(tokens[0], ref), (tokens, ref)
        assert len(logprobs[0]) == len(tokens[0]) and all(lp <= 0 for lp in logprobs[0])

    path, folder = sft_then_sampler_weights(svc, tc, rows, 4, "after-4")
    tuned = sc.create_sampling_client(model_path=path).result()
    peft_ref = hf_greedy(tiny_world / "model", folder, prompts, max_new_tokens=12)
    assert peft_ref != base_ref  # training changed the greedy outputs
    for p, ref in zip(prompts, peft_ref):
        tokens, _ = greedy(tuned, p)
        assert matches_hf(tokens[0], ref), (tokens[0], ref)

    bob = open_client(url, KEYS["bob"])
    with pytest.raises(Exception, match="no checkpoint"):
        bob.create_sampling_client(model_path=path).result()
    svc.unload(tc.model_id)


def test_an_empty_stop_list_samples_past_eos_to_max_tokens(world, tiny_world):
    """``stop=[]`` (the SDK: it "disables all stop tokens, including EOS, and generation continues until
    max_tokens"): the base model's greedy samples run to max_tokens and equal HF's greedy continuation,
    which never stops; with ``stop`` left None the same prompts end at their first EOS (token 0 here,
    within the first three tokens of each)."""
    _, url = world
    sc = open_client(url, KEYS["alice"])
    from transformers import AutoTokenizer

    base = sc.create_sampling_client(base_model=BASE).result()
    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:3]
    prompts = [tok.encode(r["prompt"]) for r in rows]
    refs = hf_greedy(tiny_world / "model", None, prompts, max_new_tokens=12)
    for p, ref in zip(prompts, refs):
        stopped, _ = greedy(base, p, n=1)
        assert 0 in ref[:3] and stopped[0] == ref[: ref.index(0) + 1], (stopped, ref)  # the default: EOS ends it
        to_max, logprobs = greedy(base, p, n=1, stop=[])
        assert to_max[0] == ref and len(logprobs[0]) == 12, (to_max, ref)


def test_rl_loop_reward_rises(world, tiny_world):
    """sample -> score (the tiny world's digits task) -> importance_sampling forward_backward ->
    optim_step, new sampler weights every iteration: the mean reward rises clearly."""
    import statistics

    from tinker import types

    from rollout.rewards import target_share

    svc, url = world
    sc = open_client(url, KEYS["bob"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3, train_unembed=False).result()
    tok = tc.get_tokenizer()
    rows = [json.loads(line) for line in (tiny_world / "data" / "digits.jsonl").read_text().splitlines()][:4]
    params = types.SamplingParams(max_tokens=10, temperature=1.0)
    rewards = []
    for _ in range(ITERATIONS):
        sampler = tc.save_weights_and_get_sampling_client().result()  # the newest weights
        futures = [(r, tok.encode(r["prompt"]), sampler.sample(types.ModelInput.from_ints(tok.encode(r["prompt"])), 8, params)) for r in rows]
        data, it_rewards = [], []
        for r, prompt, fut in futures:
            seqs = fut.result().sequences
            scores = [target_share(tok.decode(list(s.tokens)), r["label"]) for s in seqs]
            it_rewards += scores
            mean = statistics.fmean(scores)
            for s, score in zip(seqs, scores):
                completion = list(s.tokens)
                if not completion:
                    continue
                full = prompt + completion
                n_p = len(prompt) - 1
                data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                    "target_tokens": full[1:], "logprobs": [0.0] * n_p + list(s.logprobs),
                    "advantages": [0.0] * n_p + [score - mean] * len(completion)}))
        rewards.append(statistics.fmean(it_rewards))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    print("RL rewards", [round(x, 3) for x in rewards])
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.3, rewards  # measured: 0.21 -> 0.99 (means of the first and last three: 0.34 -> 0.98)
    svc.unload(tc.model_id)


def _hf_prompt_logprobs(model_dir, prompt, k):
    """log p(prompt[i] | prompt[:i]) for i >= 1 and the top-k (id, logprob) at each i, from HF (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.integration.sglang_fixtures import one_torch_thread

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad(), one_torch_thread():
        lsm = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    lps = [None] + [float(lsm[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    top = [None] + [list(zip(*(t.tolist() for t in reversed(lsm[i - 1].topk(k))))) for i in range(1, len(prompt))]
    return lps, top


def test_sampling_options_prompt_logprobs_topk_and_seed(world, tiny_world):
    """prompt_logprobs and topk_prompt_logprobs equal HF's on the base model; topk_sample_logprobs
    come per generated token with the sampled token among them at top_k=k; top_k=1 at
    temperature 1 is greedy (top_k reaches SGLang); prompt_logprobs_last_n scores only the last
    tokens. A seed is refused on this CPU engine, which does not honour SGLang's sampling_seed
    (it needs --enable-deterministic-inference, which SGLang refuses with the CPU's torch_native
    attention); same-seed reproducibility is checked on the GPU (tests/gpu/test_tinker_seed_gpu.py)."""
    from tinker import types

    _, url = world
    sc = open_client(url, KEYS["alice"])
    from transformers import AutoTokenizer

    base = sc.create_sampling_client(base_model=BASE).result()
    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:1]
    prompt = tok.encode(rows[0]["prompt"])
    want_lps, want_top = _hf_prompt_logprobs(tiny_world / "model", prompt, 3)

    res = base.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=3),
                      include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=3).result()
    got = res.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None and want_lps[0] is None
    assert None not in got[1:], got  # every position after the first is scored
    worst = max(abs(a - b) for a, b in zip(got[1:], want_lps[1:]))
    assert worst < 1e-3, f"prompt logprobs differ from HF by {worst:.2e}"  # measured: ~1e-6 (fp32 both)
    top = res.topk_prompt_logprobs
    assert top[0] is None and len(top) == len(prompt)
    for i in range(1, len(prompt)):
        assert [t for t, _ in top[i]] == [t for t, _ in want_top[i]], (i, top[i], want_top[i])
        assert max(abs(a - b) for (_, a), (_, b) in zip(top[i], want_top[i])) < 1e-3
    for seq in res.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        for tok_id, lp, tops in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
            assert len(tops) == 3 and tok_id in [t for t, _ in tops]  # top_k=3: the sampled token is one of the top 3
            assert abs(dict(tops)[tok_id] - lp) < 1e-4

    greedy_ref, _ = greedy(base, prompt, n=1, max_tokens=6)
    top1 = base.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1)).result()
    assert all(list(s.tokens) == greedy_ref[0] for s in top1.sequences)

    last = base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                       prompt_logprobs_last_n=3).result().prompt_logprobs
    assert last[:-3] == [None] * (len(prompt) - 3) and max(abs(a - b) for a, b in zip(last[-3:], want_lps[-3:])) < 1e-3

    with pytest.raises(Exception, match="enable-deterministic-inference"):
        base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=7)).result()
    with pytest.raises(Exception, match=r"topk_prompt_logprobs=21 not supported: 0\.\.20"):
        base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4), topk_prompt_logprobs=21).result()


def test_unembedding_lora_is_served_with_hf_peft_logprobs(world, tiny_world):
    """The SDK's default model (attention, MLP and lm_head LoRA) after a few SFT steps: its
    sampler folder lists lm_head; SGLang's logprob of every sampled token (temperature 1, so not
    only the favourite tokens) equals HF+PEFT's teacher-forced one on that folder, and greedy
    equals HF+PEFT greedy. The same folder without its lm_head tensors gives logprobs far from
    the served ones, so the server really applies the unembedding LoRA."""
    import torch
    from safetensors.torch import load_file, save_file
    from tinker import types

    from tests.integration.sglang_fixtures import one_torch_thread

    svc, url = world
    sc = open_client(url, KEYS["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()  # the SDK's defaults
    tok = tc.get_tokenizer()
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][8:16]
    path, folder = sft_then_sampler_weights(svc, tc, rows, 3, "unembed")
    assert "lm_head" in json.loads((folder / "adapter_config.json").read_text())["target_modules"]
    sampler = sc.create_sampling_client(model_path=path).result()
    prompts = [tok.encode(r["prompt"]) for r in rows[:3]]
    params = types.SamplingParams(max_tokens=10, temperature=1.0)
    served = [(p, list(s.tokens), list(s.logprobs)) for p in prompts
              for s in sampler.sample(types.ModelInput.from_ints(p), 2, params).result().sequences]

    def teacher_forced(adapter_dir):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_world / "model", dtype=torch.float32),
                                          str(adapter_dir)).eval()
        out = []
        with torch.no_grad(), one_torch_thread():
            for p, tokens, _ in served:
                lsm = model(torch.tensor([p + tokens])).logits[0].log_softmax(-1)
                out.append([float(lsm[len(p) - 1 + i, t]) for i, t in enumerate(tokens)])
        return out

    ref = teacher_forced(folder)
    worst = max(abs(a - b) for (_, _, got), want in zip(served, ref) for a, b in zip(got, want))
    print(f"unembedding LoRA: worst |SGLang - HF+PEFT| sampled-token logprob {worst:.2e}")
    assert worst <= 1e-5, worst  # fp32 on both sides; measured 1.9e-6 (test_logprob_parity: ~1e-6)
    no_head = folder.parent / "unembed-without-lm_head"
    no_head.mkdir()
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (no_head / "adapter_config.json").write_text(json.dumps(cfg | {"target_modules": [m for m in cfg["target_modules"] if m != "lm_head"]}))
    tensors = {k: v for k, v in load_file(str(folder / "adapter_model.safetensors")).items() if ".lm_head." not in k}
    save_file(tensors, str(no_head / "adapter_model.safetensors"))
    far = max(abs(a - b) for (_, _, got), want in zip(served, teacher_forced(no_head)) for a, b in zip(got, want))
    assert far > 100 * max(worst, 1e-6), (far, worst)
    peft_ref = hf_greedy(tiny_world / "model", folder, prompts, max_new_tokens=10)
    for p, want in zip(prompts, peft_ref):
        tokens, _ = greedy(sampler, p, n=1, max_tokens=10)
        assert matches_hf(tokens[0], want), (tokens[0], want)
    svc.unload(tc.model_id)


def test_ephemeral_sampler_weights_skip_the_disk_wait_and_a_restored_session_checks_them(world, tiny_world, monkeypatch):
    """save_weights_and_get_sampling_client's weights (the SDK: "always ephemeral") are committed
    without waiting for the disk (trainer/storage/store.py S5), a named save_weights_for_sampler's
    with it; the ephemeral folder samples as HF + PEFT does. A session restored after a restart (its
    in-memory entry gone, read back from the records) checks its folder against the manifest first:
    a torn file answers an error saying what happened, never samples from torn weights."""
    from trainer.storage.local_store import LocalStore

    svc, url = world
    commits: list[tuple[str, bool]] = []
    put = LocalStore.put_folder  # a spy: the real commit still runs

    def spy(self, key, local_dir, **kw):  # noqa: ANN001, ANN202
        commits.append((self.url(key), kw.get("durable", True)))  # a local store's folder
        return put(self, key, local_dir, **kw)

    monkeypatch.setattr(LocalStore, "put_folder", spy)
    sc = open_client(url, KEYS["alice"])
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=5, train_unembed=False).result()
    tok = tc.get_tokenizer()
    rows = [json.loads(line) for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()][:4]
    _, named = sft_then_sampler_weights(svc, tc, rows, 3, "named-3")
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler_commits = [(k, d) for k, d in commits if "/sampler_weights/" in k]
    assert [d for _, d in sampler_commits] == [True, False], commits
    ephemeral = Path(sampler_commits[1][0])
    prompt = tok.encode(rows[0]["prompt"])
    ref = hf_greedy(tiny_world / "model", ephemeral, [prompt], max_new_tokens=12)[0]
    assert ref == hf_greedy(tiny_world / "model", named, [prompt], max_new_tokens=12)[0]  # the same weights
    assert matches_hf(greedy(sampler, prompt)[0][0], ref)

    sid = sampler._sampling_session_id
    svc.sampler.sessions.pop(sid)  # what a restart loses: the session is read back from the records
    assert matches_hf(greedy(sampler, prompt)[0][0], ref)  # whole: it samples as before
    weights = ephemeral / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # what a stop of the machine may leave
    svc.sampler.sessions.pop(sid)
    with pytest.raises(Exception, match="weights cannot be read .*adapter_model.safetensors does not match its manifest"
                                        ".*save the weights again"):
        greedy(sampler, prompt)
    svc.unload(tc.model_id)
