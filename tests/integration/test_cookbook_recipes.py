"""tinker-cookbook 0.6.1's recipes, unmodified, against a live `lorafleet serve` (real CLI
process, Ray trainer actor, one SGLang CPU engine) on the tiny world: one service for the module.

Each recipe runs as a user runs it: its own module with command-line arguments (or, for runs
without a command line, the cookbook's own entry point called from a script,
tests/integration/cookbook_runs.py), in a process of its own whose environment has the key
(TINKER_API_KEY) and the tiny world's hub caches (examples.tiny.build.hf_env: the base model is
served as `Qwen/Qwen3-8B-Base`, which the cookbook's tokenizer and renderer lookups resolve
offline). Tiny sizes, local data. What each shows:

* chat_sl on a local JSONL: its NLL falls; its rolling checkpoints are deleted; the final state
  downloads with `tinker_cookbook.weights.download` (age-encrypted external weights, signed URLs)
  and, loaded by HF + PEFT, gives the engine's `compute_logprobs` of the final sampler weights.
* the cookbook's RL loop (rl.train) on a tiny environment of ours (DigitsEnv): reward rises, and
  a second run over the same log folder resumes from the first run's checkpoint.
* DPO (train_dpo.main, the cookbook's JSONL comparison builder): runs; loss ln 2 at step 0.
* math_rl with its default loss, stable_reinforce (lorafleet's definition, docs/tinker.md): it runs to
  its last step; the tiny world cannot earn its reward, so what it shows is the objective's own
  statistics on /metrics (every sampled sequence recorded and trained on, none masked, the
  trainer/sampler ratio 1); sl_loop (its NLL falls) and rl_loop over the tiny world's rows cached
  under the hub datasets they hard-code (rl_loop's reward, a boxed answer graded against gsm8k's,
  never rewards the tiny model: it runs with its default loss, samples with record_stability_info
  and checkpoints, and never trains).
* Without any recipe: the SDK's get_tokenizer() loads the served name offline, and the engine's
  compute_logprobs equals the trainer's forward on the same (untrained) model.

Every recipe creates its model with the SDK's defaults (`train_unembed=True`: LoRA on the
unembedding too, which lorafleet trains and serves).

Runtime on the shared 2-core machine (load 3-6): 191 s, 74 s of it starting the service (chat_sl
19 s, RL 37 s, DPO 10 s, sl_loop 13 s, rl_loop 14 s); math_rl with stable_reinforce 13 s and rl_loop
17 s measured at load 20-40 (the service's start 124 s there).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from examples.tiny.build import SERVED_NAME, hf_env
from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.service_world import REPO, running_service

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-cookbook-key-1", "bob": "tml-bob-cookbook-key-22"}
RECIPE_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cookbook-serve")
    keys = tmp / "tinker_keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    # Recipes end without unloading their models (their sessions time out): idle models give their
    # slots to the next recipe's (evict_idle_s), and dead sessions are reaped within a test.
    with running_service(tmp, tiny_world, slots={"num_slots": 4, "max_rank": 8, "evict_idle_s": 2.0},
                         base_model={"served_name": SERVED_NAME},
                         service={"tinker_keys_file": str(keys), "tinker_window_ms": 10, "tinker_max_seq_len": 256,
                                  "tinker_session_timeout_s": 60}) as svc:
        yield svc


def run(args: list[str], cwd: Path, tiny_world: Path, tenant: str = "alice") -> str:
    """`python <args>` as a user's shell runs it: the key and the tiny world's hub caches in its
    environment, nothing else of this test process. Returns its output; fails with its tail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER_"))}
    env.update(hf_env(tiny_world), TINKER_API_KEY=KEYS[tenant], WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RECIPE_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args[:2]} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoint_records(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def run_of(path: str) -> str:
    return path[len("tinker://"):].split("/")[0]


def kinds_chat(tiny_world: Path, out: Path, n: int) -> Path:
    """The tiny world's kinds task ("42 ae" -> "digits vowels") as chat conversations (JSONL)."""
    rows = [json.loads(line) for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()][:n]
    out.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                    {"role": "assistant", "content": r["completion"].strip()}]}) + "\n"
                           for r in rows))
    return out


def _peft_logprobs(hf_model, folder: Path, tokens: list[int]) -> torch.Tensor:
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return logp[:-1].gather(1, ids[0, 1:, None])[:, 0]  # position i scores token i + 1


PROBE_TOKENIZER = f"""
import sys, tinker
tc = tinker.ServiceClient(base_url=sys.argv[1]).create_lora_training_client(base_model={SERVED_NAME!r}, rank=2).result()
print("IDS", tc.get_tokenizer().encode("User: 42 ae xk"))
"""


def test_served_name_tokenizer_and_compute_logprobs(service, tiny_world, tmp_path):
    from tinker import types
    from transformers import AutoTokenizer

    local = AutoTokenizer.from_pretrained(tiny_world / "model")
    out = run(["-c", PROBE_TOKENIZER, service.url], tmp_path, tiny_world)
    assert f"IDS {local.encode('User: 42 ae xk')}" in out  # the SDK's get_tokenizer() loaded the served name offline

    sc = open_client(service.url, KEYS["bob"])
    tc = sc.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    tokens = local.encode("12 ae 345 xk 6 7 ou")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    trainer = torch.tensor(tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    sampler = sc.create_sampling_client(base_model=SERVED_NAME)  # a new model's LoRA B is zero: the base
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert lps[0] is None and len(lps) == len(tokens)
    engine = torch.tensor(lps[1:])
    print("compute_logprobs - trainer forward: max abs", (engine - trainer).abs().max().item())
    assert torch.allclose(engine, trainer, atol=1e-4), (engine - trainer).abs().max()  # measured 2.4e-7 (fp32 both)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(tokens) - 3) and torch.allclose(torch.tensor(last[-3:]), engine[-3:], atol=1e-5)


def test_chat_sl_learns_deletes_rolling_checkpoints_and_downloads(service, tiny_world, tmp_path, hf_model):
    import tinker
    from tinker import types

    log = tmp_path / "chat_sl"
    run(["-m", "tinker_cookbook.recipes.chat_sl.train", f"base_url={service.url}", f"model_name={SERVED_NAME}",
         f"dataset={kinds_chat(tiny_world, tmp_path / 'kinds_chat.jsonl', 96)}", f"log_path={log}", "batch_size=8",
         "learning_rate=5e-3", "lora_rank=8", "max_length=128", "max_steps=12", "save_every=0", "eval_every=0",
         "infrequent_eval_every=0", "rolling_save_every=3", "rolling_ttl_seconds=7200",
         "behavior_if_log_dir_exists=delete"], tmp_path, tiny_world)
    nll = [m["train_mean_nll"] for m in metrics(log) if "train_mean_nll" in m]
    print("chat_sl train_mean_nll", [round(x, 3) for x in nll])
    assert len(nll) == 12 and sum(nll[-3:]) / 3 < 0.8 * sum(nll[:3]) / 3, nll  # it learns the kinds task

    records = checkpoint_records(log)
    rolling = [r["state_path"] for r in records if r.get("rolling")]
    final = next(r for r in records if r["name"] == "final")
    rest = open_client(service.url, KEYS["alice"]).create_rest_client()
    kept = {c.tinker_path for c in rest.list_checkpoints(run_of(final["state_path"])).result().checkpoints}
    assert rolling and not kept & set(rolling), (rolling, kept)  # each rolling checkpoint was deleted
    assert final["state_path"] in kept and final["sampler_path"] in kept
    bob = open_client(service.url, KEYS["bob"]).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run_by_tinker_path(final["state_path"]).result()

    # weights.download of the final training state (export, signed URLs, age decryption, cleanup).
    out = tmp_path / "download"
    run(["-c", "import sys; from tinker_cookbook import weights; "
               "weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2], base_url=sys.argv[3])",
         final["state_path"], str(out), service.url], tmp_path, tiny_world)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    sampler = open_client(service.url, KEYS["alice"]).create_sampling_client(model_path=final["sampler_path"])
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(tiny_world / "model").encode("User: 42 ae xk\n\nAssistant: digits vowels")
    engine = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
    peft = _peft_logprobs(hf_model, out, tokens)
    print("compute_logprobs - HF+PEFT on the download: max abs", (engine - peft).abs().max().item())
    assert torch.allclose(engine, peft, atol=1e-4), (engine - peft).abs().max()  # measured 4.8e-7


def test_rl_reward_rises_and_a_second_run_resumes(service, tiny_world, tmp_path):
    log = tmp_path / "digits_rl"
    common = ["-m", "tests.integration.cookbook_runs", "digits_rl", f"base_url={service.url}", f"log_path={log}",
              f"data_path={tiny_world / 'data' / 'digits.jsonl'}", f"model_name={SERVED_NAME}", "save_every=3"]
    run([*common, "max_steps=6"], tmp_path, tiny_world)
    first = checkpoint_records(log)
    assert first and first[-1]["batch"] == 6, first
    out = run([*common, "max_steps=12"], tmp_path, tiny_world)
    assert "Resuming" in out or "resum" in out.lower(), out[-3000:]
    rows = [m for m in metrics(log) if "env/all/reward/total" in m]
    steps = [m["step"] for m in rows]
    assert steps == list(range(12)), steps  # the second run went on from step 6, no step twice
    reward = [m["env/all/reward/total"] for m in rows]
    print("digits_rl reward", [round(x, 3) for x in reward])
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.1, reward


def test_dpo_on_local_comparisons(service, tiny_world, tmp_path):
    rows = [json.loads(line) for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()][:32]
    comparisons = tmp_path / "comparisons.jsonl"
    comparisons.write_text("".join(json.dumps({"label": "A", "comparison": {
        "prompt_conversation": [{"role": "user", "content": r["prompt"]}],
        "completion_A": [{"role": "assistant", "content": r["completion"].strip()}],
        "completion_B": [{"role": "assistant", "content": " ".join(reversed(r["prompt"].split()))}]}}) + "\n" for r in rows))
    log = tmp_path / "dpo"
    run(["-m", "tests.integration.cookbook_runs", "dpo", f"base_url={service.url}", f"log_path={log}",
         f"comparisons={comparisons}", f"model_name={SERVED_NAME}", "max_steps=4"], tmp_path, tiny_world)
    losses = [m["dpo_loss"] for m in metrics(log) if "dpo_loss" in m]
    print("dpo_loss", [round(x, 4) for x in losses])
    assert len(losses) == 4 and abs(losses[0] - math.log(2)) < 1e-3, losses  # policy == reference at step 0


def tinker_counters(service) -> dict[str, float]:
    """The service's Tinker counters on /metrics: stable_reinforce's statistics and the sample requests
    (summed over the engines)."""
    from tests.integration.service_world import prometheus_text

    out: dict[str, float] = {}
    with service.client() as c:
        for line in prometheus_text(c).splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("lorafleet_tinker_stable_reinforce_") and name.endswith("_total"):
                out[name[len("lorafleet_tinker_stable_reinforce_"):-len("_total")]] = float(value)
            elif name.startswith("lorafleet_tinker_sample_requests_total{"):
                out["sample_requests"] = out.get("sample_requests", 0.0) + float(value)
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def test_math_rl_with_its_default_loss(service, tiny_world, tmp_path):
    """math_rl, env=arithmetic, unmodified, with its default loss stable_reinforce, to its last step.
    Its reward cannot rise on the tiny world: the model never writes the role_colon renderer's stop
    sequence, so every answer is malformed (reward 0), every group all-bad and every advantage 0. What
    it shows instead is the objective's own statistics (/metrics): the recipe asked for
    record_stability_info, every sequence it sampled was recorded and trained on (none refused, none
    masked), and the trainer's log-probs equal the engine's recorded ones (ratio 1 to 1e-4)."""
    before = tinker_counters(service)
    log = tmp_path / "math_rl"
    run(["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={SERVED_NAME}",
         f"base_url={service.url}", f"log_path={log}", "groups_per_batch=2", "group_size=4", "max_tokens=6",
         "lora_rank=8", "max_steps=2", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"],
        tmp_path, tiny_world)
    rows = [m for m in metrics(log) if "env/all/reward/total" in m]
    assert len(rows) == 2
    d = _delta(tinker_counters(service), before)
    print("math_rl reward", [m["env/all/reward/total"] for m in rows], "stable_reinforce", d)
    assert d["calls"] >= 2 and d["sequences"] == 2 * 2 * 4, d  # max_steps x groups_per_batch x group_size
    assert d["masked_sequences"] == 0 and d["truncated_tokens"] == 0 and d["sampled_tokens"] > 0, d
    assert abs(d["ratio_sum"] / d["sampled_tokens"] - 1) < 1e-4, d


def test_sl_loop_on_local_rows(service, tiny_world, tmp_path):
    log = tmp_path / "sl_loop"
    run(["-m", "tinker_cookbook.recipes.sl_loop", f"base_url={service.url}", f"model_name={SERVED_NAME}",
         f"log_path={log}", "batch_size=8", "learning_rate=5e-3", "lora_rank=8", "max_length=128", "max_steps=10",
         "save_every=0"], tmp_path, tiny_world)
    nll = [m["train_mean_nll"] for m in metrics(log) if "train_mean_nll" in m]
    print("sl_loop train_mean_nll", [round(x, 3) for x in nll])
    assert len(nll) == 10 and sum(nll[-3:]) / 3 < 0.8 * sum(nll[:3]) / 3, nll


def test_rl_loop_on_local_rows_with_its_default_loss(service, tiny_world, tmp_path):
    """rl_loop with its default loss (stable_reinforce): it samples with record_stability_info (one
    request per question) and checkpoints. Its reward (a boxed answer graded against gsm8k's) stays 0
    on the tiny world's rows, so every group's advantages are zero and it skips forward_backward: the
    loss itself is not reached (math_rl's test reaches it)."""
    before = tinker_counters(service)
    log = tmp_path / "rl_loop"
    run(["-m", "tinker_cookbook.recipes.rl_loop", f"base_url={service.url}", f"model_name={SERVED_NAME}",
         f"log_path={log}", "batch_size=2", "group_size=4", "max_tokens=8", "lora_rank=8", "max_steps=2",
         "save_every=0"], tmp_path, tiny_world)
    rows = [m for m in metrics(log) if "reward/total" in m]
    assert len(rows) == 2
    d = _delta(tinker_counters(service), before)
    print("rl_loop reward", [m["reward/total"] for m in rows], "counters", d)
    assert d["sample_requests"] == 2 * 2  # max_steps x batch_size questions, one request each
    assert all(m["reward/total"] == 0 for m in rows) and d["calls"] == 0  # advantages all zero: training skipped
