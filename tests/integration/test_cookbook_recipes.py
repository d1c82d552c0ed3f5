"""tinker-cookbook 0.6.1's recipes, unmodified, with their default loss and settings except size,
against a live `lorafleet serve` (real CLI process, Ray trainer actor, one SGLang CPU engine): one
service for the module, on the tiny world's long-context view (long_world: the same weights with a
4096-token context, the same logits at the tiny model's 512 positions), so the two recipes whose
requests outgrow those 512 tokens (guess_number, rubric) run beside the others.

Each recipe runs as a user runs it: its own module with command-line arguments, in a process of
its own (tests/integration/cookbook_harness.py); what changes is only size (model: the tiny one
under its served name `Qwen/Qwen3-8B-Base`, with its renderer `role_colon` where a recipe names
another model's; steps, batch, group, lengths; LoRA rank where the default exceeds the slots'
32). Learning rates, losses, schedules and the rest stay the recipes' own. Hub datasets come from
the test's datasets cache (tests/integration/cookbook_datasets.py: tiny-world rows in each
dataset's columns); local files are written here. Each test shows learning on the recipe's own
metric, or says why the tiny world cannot and shows what it can (the objective's statistics on
/metrics, the trainer/sampler agreement), and records its row of docs/tinker.md's verified-recipes
table (tests/integration/cookbook_table.py).

Tiers. The default tier (CI's `-m "not gpu and not slow"`) runs the whole module: the service, the
SDK checks and 14 recipes: sl_basic, sl_loop, chat_sl, prompt_distillation, dpo, shorter, rl_loop
and math_rl (their default loss stable_reinforce), on-policy distillation, sdft, the cookbook's RL
loop (rl.train) over DigitsEnv with its resume, rl_basic (2048 samples a step, fixed in its code:
70 s on a quiet machine), then guess_number (15 to 18 s) and rubric (8 s), whose requests pass 512 tokens.
The whole module took 5 min 44 s on the shared 2-core machine with a second service for the last two.

Every recipe creates its model with the SDK's defaults (`train_unembed=True`: LoRA on the
unembedding too, which lorafleet trains and serves). The service seeds each model's LoRA
(tinker_default_seed), so the supervised recipes' numbers repeat from run to run (the sampled ones
vary with the engine's sampling).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from examples.tiny.build import SERVED_NAME, hf_env, long_context_view
from tests.integration import cookbook_datasets as data
from tests.integration.cookbook_harness import (
    checkpoint_records,
    client_env,
    delta,
    falls,
    mean,
    metrics,
    run_recipe,
    series,
    stable_reinforce_metric,
    tinker_counters,
)
from tests.integration.cookbook_table import Verified, publish, start_end
from tests.integration.sdk_clients import close_sdk_clients, open_client  # noqa: F401 - autouse fixture
from tests.integration.service_world import running_service

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-cookbook-key-1", "bob": "tml-bob-cookbook-key-22"}
RANK = 32  # the slots' largest rank: the default of most recipes (the DPO CLI cannot change its 32)
CONTEXT = 512  # the tiny model's context (max_position_embeddings): the engine refuses a longer request
LONG_CONTEXT = 4096  # the long-context view's (long_world): guess_number's and rubric's requests fit


def serve(tmp: Path, world: Path, context: int, engines: dict | None = None):
    """The module's `lorafleet serve` on ``world``, taking Tinker datums of up to ``context`` tokens."""
    keys = tmp / "tinker_keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    # Recipes end without unloading their models (their sessions time out): idle models give their
    # slots to the next recipe's (evict_idle_s), and dead sessions are reaped within a test.
    return running_service(tmp, world, slots={"num_slots": 4, "max_rank": RANK, "evict_idle_s": 2.0},
                           engines={"max_lora_rank": RANK, **(engines or {})}, base_model={"served_name": SERVED_NAME},
                           service={"tinker_keys_file": str(keys), "tinker_window_ms": 10, "tinker_max_seq_len": context,
                                    "tinker_session_timeout_s": 60, "tinker_default_seed": 0})


@pytest.fixture(scope="module")
def long_world(tiny_world, hf_model, tmp_path_factory) -> Path:
    """The tiny world with a LONG_CONTEXT-token context (examples/tiny/build.py long_context_view: the same
    weights and tokenizer, max_position_embeddings raised). Checked here with HF transformers: at every
    position of the tiny model's own context the two give bit-identical logits (RoPE of type default
    depends on the position alone), and past it the view gives finite ones."""
    from transformers import AutoModelForCausalLM

    view = long_context_view(tiny_world, tmp_path_factory.mktemp("tiny-long"), LONG_CONTEXT)
    model = AutoModelForCausalLM.from_pretrained(view / "model", dtype=torch.float32).eval()
    assert model.config.max_position_embeddings == LONG_CONTEXT and hf_model.config.max_position_embeddings == CONTEXT
    ids = torch.randint(0, model.config.vocab_size, (1, 3 * CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert torch.equal(logits[:, :CONTEXT], hf_model(input_ids=ids[:, :CONTEXT]).logits)
    assert torch.isfinite(logits).all()
    return view


@pytest.fixture(scope="module")
def service(long_world, tmp_path_factory):
    """The module's one service, on long_world: guess_number's and rubric's requests outgrow the tiny
    model's CONTEXT, and every other recipe's stay within it, where long_world's logits are the tiny
    world's own (long_world's check), so one service serves them all (a second one cost a start and
    a stop). Its engine's KV cache holds 32768 tokens (the tiny model's: 32 MiB), room for rubric's
    graders' 2048-token budgets at once."""
    with serve(tmp_path_factory.mktemp("cookbook-serve"), long_world, LONG_CONTEXT, {"max_total_tokens": 32768}) as svc:
        yield svc


@pytest.fixture(scope="module")
def hub(tiny_world, tmp_path_factory) -> dict[str, str]:
    """The hub caches a recipe's process sees: the tiny world's model, this module's datasets."""
    cache = data.build_datasets_cache(tmp_path_factory.mktemp("hf-datasets"))
    return {**hf_env(tiny_world), "HF_DATASETS_CACHE": str(cache)}


@pytest.fixture(scope="module")
def verified():
    """Rows measured by this module's tests; published (cookbook_table.publish) when the module ends."""
    rows: dict[str, Verified] = {}
    yield rows
    if rows:
        publish(rows)


@pytest.fixture(scope="module")
def user_env(service, hub):
    """A tenant's shell environment (cookbook_harness.client_env)."""
    return lambda tenant="alice": client_env(hub, KEYS[tenant], service.url)


def recipe_runner(svc, hub: dict[str, str], tmp_path: Path):
    def run(module: str, *settings: str, base_url: bool = True, expect_rc: int = 0):
        args = ["-m", module, *([f"base_url={svc.url}"] if base_url else []), f"model_name={SERVED_NAME}",
                f"log_path={tmp_path / 'log'}", *settings]
        return run_recipe(client_env(hub, KEYS["alice"], svc.url), tmp_path, args, expect_rc=expect_rc)

    return run


@pytest.fixture
def recipe(service, hub, tmp_path):
    """``recipe(module, *settings)``: the recipe run by alice in ``tmp_path`` against the service, its log
    folder ``tmp_path / "log"`` (``log_path``); base_url passed unless ``base_url=False`` (recipes
    without that option read TINKER_BASE_URL)."""
    return recipe_runner(service, hub, tmp_path)


def kinds_chat(tiny_world: Path, out: Path, n: int) -> Path:
    """The tiny world's kinds task ("42 ae" -> "digits vowels") as chat conversations (JSONL); the
    restart test's data (tests/integration/test_tinker_restart.py)."""
    import json

    rows = [json.loads(line) for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines()][:n]
    return data.write_jsonl(out, data.chats([{"prompt": r["prompt"], "completion": r["completion"].strip()} for r in rows]))


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


def test_served_name_tokenizer_and_compute_logprobs(service, user_env, tiny_world, tmp_path):
    from tinker import types
    from transformers import AutoTokenizer

    local = AutoTokenizer.from_pretrained(tiny_world / "model")
    out = run_recipe(user_env(), tmp_path, ["-c", PROBE_TOKENIZER, service.url]).out
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


# --- supervised recipes: cross_entropy, their NLL falls ------------------------------------------------------


def test_sl_basic(recipe, tmp_path, verified):
    """sl_basic (no_robots: kinds chats). Its batch (128) and length are fixed in its code; its own
    evaluator scores the same 128 held-out chats at steps 0 and 8 (eval_every=8): that NLL must fall."""
    run = recipe("tinker_cookbook.recipes.sl_basic", "max_steps=10")
    log = tmp_path / "log"
    train, held_out = series(log, "train_mean_nll"), series(log, "test/nll")
    print("sl_basic train_mean_nll", [round(x, 4) for x in train], "test/nll", held_out)
    assert len(train) == 10 and len(held_out) >= 2
    assert held_out[-1] < held_out[0] - 0.05, held_out
    verified["sl_basic"] = run.row("sl_basic", "cross_entropy", len(train), start_end("held-out NLL", held_out))


def test_sl_loop(recipe, tmp_path, verified):
    run = recipe("tinker_cookbook.recipes.sl_loop", "batch_size=64", "max_steps=20")
    nll = series(tmp_path / "log", "train_mean_nll")
    print("sl_loop train_mean_nll", [round(x, 4) for x in nll])
    assert len(nll) == 20 and falls(nll, 0.05), nll
    verified["sl_loop"] = run.row("sl_loop", "cross_entropy", len(nll), start_end("train NLL", nll))


def test_chat_sl_learns_deletes_rolling_checkpoints_and_downloads(recipe, service, user_env, tiny_world, tmp_path,
                                                                  hf_model, verified):
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    chats = data.write_jsonl(tmp_path / "kinds_chat.jsonl", data.chats(data.kinds_rows(640)))
    run = recipe("tinker_cookbook.recipes.chat_sl.train", f"dataset={chats}", "batch_size=64", "max_steps=10",
                 "rolling_save_every=3", "behavior_if_log_dir_exists=delete")
    log = tmp_path / "log"
    nll = series(log, "train_mean_nll")
    print("chat_sl train_mean_nll", [round(x, 4) for x in nll])
    assert len(nll) == 10 and falls(nll, 0.05), nll
    verified["chat_sl"] = run.row("chat_sl", "cross_entropy", len(nll), start_end("train NLL", nll))

    records = checkpoint_records(log)
    rolling = [r["state_path"] for r in records if r.get("rolling")]
    final = next(r for r in records if r["name"] == "final")
    rest = open_client(service.url, KEYS["alice"]).create_rest_client()
    run_id = final["state_path"][len("tinker://"):].split("/")[0]
    kept = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert rolling and not kept & set(rolling), (rolling, kept)  # each rolling checkpoint was deleted
    assert final["state_path"] in kept and final["sampler_path"] in kept
    bob = open_client(service.url, KEYS["bob"]).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run_by_tinker_path(final["state_path"]).result()

    # weights.download of the final training state (export, signed URLs, age decryption, cleanup).
    out = tmp_path / "download"
    download = ("import sys; from tinker_cookbook import weights; "
                "weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2], base_url=sys.argv[3])")
    run_recipe(user_env(), tmp_path, ["-c", download, final["state_path"], str(out), service.url])
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    sampler = open_client(service.url, KEYS["alice"]).create_sampling_client(model_path=final["sampler_path"])
    tokens = AutoTokenizer.from_pretrained(tiny_world / "model").encode("User: 42 ae xk\n\nAssistant: digits vowels")
    engine = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
    peft = _peft_logprobs(hf_model, out, tokens)
    print("compute_logprobs - HF+PEFT on the download: max abs", (engine - peft).abs().max().item())
    assert torch.allclose(engine, peft, atol=1e-4), (engine - peft).abs().max()  # measured 4.8e-7


def test_prompt_distillation(recipe, tmp_path, verified):
    """prompt_distillation's train step on its data format (the text, then the teacher's one-word label).
    Its create_data step is not run: it samples a 35B teacher by name and keeps only answers that read
    "Final Answer: xx", which the tiny model never writes; the labels here are the kinds task's."""
    rows = data.write_jsonl(tmp_path / "labels.jsonl", data.labels(data.kinds_rows(640)))
    run = recipe("tinker_cookbook.recipes.prompt_distillation.train", f"file_path={rows}", "batch_size=64",
                 "max_steps=10", "behavior_if_log_dir_exists=delete")
    nll = series(tmp_path / "log", "train_mean_nll")
    print("prompt_distillation train_mean_nll", [round(x, 4) for x in nll])
    assert len(nll) == 10 and falls(nll, 0.05), nll
    verified["prompt_distillation"] = run.row("prompt_distillation", "cross_entropy", len(nll), start_end("train NLL", nll))


# --- preference ----------------------------------------------------------------------------------------------


def test_dpo(recipe, tmp_path, verified):
    """The DPO CLI on dataset=hhh (Anthropic/hh-rlhf rows: the kinds answer chosen over the words reversed).
    At step 0 the policy is its reference: loss ln 2; then it falls."""
    run = recipe("tinker_cookbook.recipes.preference.dpo.train", "batch_size=64", "max_steps=10",
                 "behavior_if_log_dir_exists=delete")
    loss = series(tmp_path / "log", "dpo_loss")
    print("dpo_loss", [round(x, 5) for x in loss], "accuracy", series(tmp_path / "log", "accuracy"))
    assert len(loss) == 10 and abs(loss[0] - math.log(2)) < 1e-4, loss
    assert loss[-1] < loss[0] and falls(loss, 1e-4), loss
    verified["preference/dpo"] = run.row("preference/dpo", "DPO (forward_backward_custom)", len(loss),
                                         start_end("DPO loss", loss, 4))


def test_shorter(recipe, tmp_path, verified):
    """preference/shorter: a preference model that prefers the shorter of two answers. Each answer's reward is
    its wins minus losses against the group's other answers (zero-sum: the mean is 0) plus a format penalty
    of -1 (the tiny model never writes role_colon's stop sequence), so the mean reward is -1 at every step
    and cannot rise. Its default learning rate (3e-5) moves the tiny model's answer length by less than its
    sampling noise within a CI-size run (measured over 6 steps of 8 answers: 9.5, 12.1, 9.0, 13.0, 6.8, 15.4
    tokens), so no length trend is asserted. What it shows: most groups mixed (answers of different lengths in
    characters: non-zero advantages; a group is constant only when its 4 sampled answers are all one length,
    which the unseeded sampling does now and then: 1 group of 12 in one CI run of 2026-12-07), each step with a
    mixed group trained with importance_sampling and moving the policy (compute_post_kl, on by the recipe's
    default: kl_pre_post_v2 > 0), the trainer's log-probs equal to the sampler's."""
    groups = 2  # a step's groups (the recipe's batch_size)
    run = recipe("tinker_cookbook.recipes.preference.shorter.train", "renderer_name=role_colon", f"batch_size={groups}",
                 "group_size=4", "max_steps=6", "behavior_if_log_dir_exists=delete", base_url=False)
    rows = [m for m in metrics(tmp_path / "log") if "env/all/reward/total" in m]
    tokens = [m["env/all/ac_tokens_per_turn"] for m in rows]
    print("shorter ac_tokens_per_turn", tokens, "kl_pre_post_v2", [m.get("kl_pre_post_v2") for m in rows])
    assert len(rows) == 6, rows
    for m in rows:
        assert m["env/all/reward/total"] == pytest.approx(-1.0) and abs(m["env/all/win_minus_loss"]) < 1e-9, m
        assert m["kl_pre_post_v2"] > 0 or m["env/all/by_group/frac_mixed"] == 0, m  # a mixed group moves the policy
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-4, m
    mixed = sum(round(m["env/all/by_group/frac_mixed"] * groups) for m in rows)
    assert mixed >= 7, [m["env/all/by_group/frac_mixed"] for m in rows]
    verified["preference/shorter"] = run.row(
        "preference/shorter", "importance_sampling", len(rows),
        f"reward -1 -> -1 (zero-sum wins minus losses, format penalty -1: cannot rise); {start_end('answer tokens', tokens, 1)} "
        f"(no trend at lr 3e-5); {mixed} of {groups * len(rows)} groups mixed, policy moved by each step with one (kl_pre_post_v2 {rows[0]['kl_pre_post_v2']:.1e} "
        f"-> {rows[-1]['kl_pre_post_v2']:.1e})")


# --- RL recipes ----------------------------------------------------------------------------------------------


def test_rl_loop_with_its_default_loss(recipe, service, tmp_path, verified):
    """rl_loop with its default loss (stable_reinforce): it samples with record_stability_info (one request
    per question) and checkpoints. Its reward (a boxed answer graded against gsm8k's) stays 0 on the tiny
    world, so every group's advantages are zero and it skips forward_backward: the loss itself is not
    reached (math_rl's and rubric's tests reach it)."""
    before = tinker_counters(service)
    run = recipe("tinker_cookbook.recipes.rl_loop", "batch_size=2", "group_size=4", "max_tokens=8", "max_steps=2")
    reward = series(tmp_path / "log", "reward/total")
    d = delta(tinker_counters(service), before)
    print("rl_loop reward", reward, "counters", d)
    assert len(reward) == 2 and d["sample_requests"] == 2 * 2  # max_steps x batch_size questions, one request each
    assert all(r == 0 for r in reward) and d.get("calls", 0) == 0  # advantages all zero: training skipped
    verified["rl_loop"] = run.row("rl_loop", "stable_reinforce", 2, "reward 0 -> 0 (cannot be earned): "
                                  "4 recorded sample requests, training skipped (advantages 0)")


def test_math_rl_with_its_default_loss(recipe, service, tmp_path, verified):
    """math_rl, env=arithmetic, with its default loss stable_reinforce, to its last step. Its reward cannot
    rise on the tiny world: the model never writes the role_colon stop sequence (format penalty 0.1 on
    every answer) and writes the sum of two numbers only by chance. What it shows instead is the
    objective's own statistics (/metrics): every sequence it sampled was recorded and trained on (none
    refused, none masked), and the trainer's log-probs equal the engine's recorded ones (ratio 1)."""
    before = tinker_counters(service)
    run = recipe("tinker_cookbook.recipes.math_rl.train", "env=arithmetic", "groups_per_batch=2", "max_steps=2",
                 "behavior_if_log_dir_exists=delete")
    reward = series(tmp_path / "log", "env/all/reward/total")
    d = delta(tinker_counters(service), before)
    print("math_rl reward", reward, "stable_reinforce", d)
    assert len(reward) == 2 and d["calls"] >= 2 and d["sequences"] == 2 * 2 * 4, d  # steps x groups x group_size
    assert d["masked_sequences"] == 0 and d["truncated_tokens"] == 0 and d["sampled_tokens"] > 0, d
    assert abs(d["ratio_sum"] / d["sampled_tokens"] - 1) < 1e-4, d
    verified["math_rl"] = run.row("math_rl", "stable_reinforce", 2, f"reward {reward[0]:.2f} -> {reward[-1]:.2f} "
                                  f"(cannot be earned); {stable_reinforce_metric(d)}")


@pytest.fixture(scope="module")
def kinds_teacher(service, tiny_world) -> str:
    """A sampler checkpoint of the tiny model taught the kinds task (12 SDK cross_entropy steps at 5e-3 on
    role_colon chats): the distillation recipe's teacher, so that teacher and student differ."""
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from transformers import AutoTokenizer

    renderer = renderers.get_renderer("role_colon", AutoTokenizer.from_pretrained(tiny_world / "model"))
    tc = open_client(service.url, KEYS["alice"]).create_lora_training_client(base_model=SERVED_NAME, rank=8, seed=1).result()
    convos = data.chats(data.kinds_rows(96, seed=11))
    for step in range(12):
        batch = [conversation_to_datum(c["messages"], renderer, 128) for c in convos[8 * step: 8 * step + 8]]
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    return tc.save_weights_for_sampler("kinds-teacher").result().path


def test_on_policy_distillation(recipe, kinds_teacher, tmp_path, verified):
    """distillation/on_policy_distillation (dataset=deepmath: kinds prompts), the tiny model as its own
    teacher: the teacher is the tiny model taught the kinds task (kinds_teacher), the student the base.
    Its metric, the student's reverse KL to the teacher on its own samples (teacher_kl), does not fall
    within a CI-size run: at the recipe's learning rate (1e-4) six steps move the student by less than
    the KL's sampling noise between steps (measured 4.81, 5.47, 5.22, 4.86, 5.90, 5.58 nats over 16
    answers a step; a 30-step run measured the mean of the first / last 10 steps 5.18 -> 4.92, a fall
    about one step-to-step deviation deep, in 52 s), so no trend is asserted. What it shows: the teacher scored every sampled token
    (teacher_kl > 0: teacher and student differ), the reward is the KL penalty alone (the dataset's
    reward 0), and each step trained with importance_sampling on the trainer's log-probs equal to the
    sampler's."""
    run = recipe("tinker_cookbook.recipes.distillation.on_policy_distillation", f"teacher_model={SERVED_NAME}",
                 f"teacher_checkpoint={kinds_teacher}", f"lora_rank={RANK}", "groups_per_batch=4", "max_tokens=16",
                 "max_steps=6", "behavior_if_log_dir_exists=delete")
    rows = [m for m in metrics(tmp_path / "log") if "teacher_kl" in m]
    kl = [m["teacher_kl"] for m in rows]
    print("distillation teacher_kl", [round(x, 4) for x in kl])
    assert len(rows) == 6, rows
    for m in rows:
        assert m["teacher_kl"] > 0.5 and m["env/all/reward/total"] == 0, m
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-4, m
    verified["distillation"] = run.row("distillation", "importance_sampling", len(kl),
                                       f"{start_end('teacher KL', kl)} (no trend: lr 1e-4, 6 steps, noise ~0.5 nat); "
                                       "every sampled token scored by the teacher, sampler/trainer KL < 1e-4")


def test_sdft(recipe, tmp_path, verified):
    """sdft (dataset=sciknoweval rows: kinds questions with a golden answer): the teacher is the base model
    with the golden answer in its prompt; the student learns the teacher's top-K distribution with
    cross_entropy on (N, K=20) targets (trainer/losses/table.py: K columns of one datum; the definition is
    proven in tests/integration/test_tinker_calls.py against Hugging Face). The recipe logs no loss (its
    metrics: the teacher's entropy, the datums, grad_norm), and each step distills other questions, so
    what is checked is that it runs: 3 steps of 20 top-K targets a position, every gradient norm finite and
    non-zero exactly in the steps that kept some position's top-K (the recipe skips each answer's first 3
    tokens).
    eval_every=0: the cookbook's own test-set evaluator fails at step 0 whatever the server (0.6.1's
    RLTestSetEvaluator takes SDFTDataset.get_batch's (builders, questions, answers) tuple for the builders:
    "'list' object has no attribute 'make_envs'")."""
    run = recipe("tinker_cookbook.recipes.sdft.train", f"lora_rank={RANK}", "groups_per_batch=2", "max_tokens=16",
                 "eval_every=0", "max_steps=3", "behavior_if_log_dir_exists=delete")
    rows = [m for m in metrics(tmp_path / "log") if "sdft/topk" in m]
    assert [m["step"] for m in rows] == [0, 1, 2] and all(m["sdft/topk"] == 20 for m in rows), rows
    grad = [m["grad_norm:last"] for m in rows]
    # a step trains exactly when some position kept its teacher's top-K (the teacher's entropy is the mean over
    # those; the recipe skips each answer's first 3 tokens, so answers of 3 tokens or fewer train nothing)
    assert all(0 <= g < math.inf for g in grad), rows
    assert [g > 0 for g in grad] == [m["sdft/mean_teacher_entropy"] > 0 for m in rows] and any(grad), rows
    verified["sdft"] = run.row("sdft", "cross_entropy (top-K, K = 20)", len(rows), start_end("grad_norm", grad))


def test_rl_reward_rises_and_a_second_run_resumes(service, user_env, tiny_world, tmp_path, verified):
    """The cookbook's RL loop (rl.train, its default loss importance_sampling) over DigitsEnv, a tiny
    environment of ours (tests/integration/cookbook_runs.py) whose reward the tiny model can earn: it
    rises, and a second run over the same log folder resumes from the first run's checkpoint."""
    log = tmp_path / "digits_rl"
    common = ["-m", "tests.integration.cookbook_runs", "digits_rl", f"base_url={service.url}", f"log_path={log}",
              f"data_path={tiny_world / 'data' / 'digits.jsonl'}", f"model_name={SERVED_NAME}", "save_every=3"]
    first_run = run_recipe(user_env(), tmp_path, [*common, "max_steps=6"])
    first = checkpoint_records(log)
    assert first and first[-1]["batch"] == 6, first
    second_run = run_recipe(user_env(), tmp_path, [*common, "max_steps=12"])
    assert "resum" in second_run.out.lower(), second_run.out[-3000:]
    rows = [m for m in metrics(log) if "env/all/reward/total" in m]
    assert [m["step"] for m in rows] == list(range(12))  # the second run went on from step 6, no step twice
    reward = [m["env/all/reward/total"] for m in rows]
    print("digits_rl reward", [round(x, 3) for x in reward])
    assert mean(reward[-4:]) > mean(reward[:4]) + 0.1, reward
    second_run.seconds += first_run.seconds
    verified["rl.train (DigitsEnv)"] = second_run.row("rl.train (DigitsEnv)", "importance_sampling", 12,
                                                      start_end("reward", reward))


# last on the tiny world's service: its 2048 samples a step are the heaviest load here (70 s on a quiet machine). It
# used to hang the service (> 600 s, every heartbeat timing out): the read front's capped pool, fixed
# in b2bec2b (tests/integration/test_read_front.py)
def test_rl_basic(recipe, tmp_path, verified):
    """rl_basic (gsm8k rows; its batch of 128 questions x 16 is fixed in its code): its reward (a \\boxed{}
    answer) cannot be earned on the tiny world (never a backslash or a brace), so every group is all-bad.
    What it shows: one step of 2048 sampled answers trained with importance_sampling, the trainer's
    log-probs equal to the sampler's (kl_sample_train about 0)."""
    run = recipe("tinker_cookbook.recipes.rl_basic", "max_steps=1", "max_tokens=8")
    rows = [m for m in metrics(tmp_path / "log") if "env/all/reward/total" in m]
    print("rl_basic", {k: v for k, v in rows[0].items() if k.startswith(("env/all/reward", "optim/"))})
    assert len(rows) == 1 and rows[0]["env/all/reward/total"] == pytest.approx(-0.1)  # malformed, wrong: -0.1
    assert abs(rows[0]["optim/kl_sample_train_v1"]) < 1e-4, rows[0]
    verified["rl_basic"] = run.row("rl_basic", "importance_sampling", 1, "reward -0.1 (its \\boxed{} answer is never "
                                   "written by the tiny model: cannot be earned); 2048 answers trained, sampler/trainer "
                                   f"KL {rows[0]['optim/kl_sample_train_v1']:.1e}")


# --- past the tiny model's context (the long-context view) ------------------------------------------------------------------


def test_guess_number(recipe, service, tmp_path, verified):
    """multiplayer_rl/guess_number, its default loss importance_sampling, to its last step, on the long-context
    view: a game is up to ten turns in one growing conversation, and each turn the tiny model fails to
    write "Guess: <n>" adds the recipe's fixed parse-failure message (about 117 tokens with its framing) to a
    prompt of 203, so the tenth turn's prompt is about 1,250 tokens (the tiny world's 512 were passed by
    turn 4, and the engine refused it). Its reward cannot rise: the tiny model never writes "Guess: ",
    so every turn earns the format penalty (-1), every game runs all ten turns (reward -10) and every
    group's advantages are zero (grad_norm 0). What it shows: every game ran its ten turns, each turn one
    sample request (the service's counter), prompts averaging past 512 tokens, and every turn's answer
    scored by the trainer with the sampler's log-probs (kl_sample_train about 0: engine and trainer agree
    at positions past 512 too)."""
    before = tinker_counters(service)
    run = recipe("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", "renderer_name=role_colon",
                      "batch_size=1", "group_size=2", "max_tokens=8", "eval_every=0", "max_steps=3",
                      "behavior_if_log_dir_exists=delete", base_url=False)
    d = delta(tinker_counters(service), before)
    rows = [m for m in metrics(tmp_path / "log") if "env/all/reward/total" in m]
    reward, prompt = [m["env/all/reward/total"] for m in rows], [m["env/all/ob_tokens_per_turn"] for m in rows]
    print("guess_number reward", reward, "prompt tokens per turn", prompt, "trained tokens",
          [m["tokens/trained"] for m in rows], "kl", [m["optim/kl_sample_train_v1"] for m in rows], "counters", d)
    assert len(rows) == 3, rows
    for m in rows:
        assert m["env/all/total_episodes"] == 2 and m["env/all/turns_per_episode"] == 10, m  # batch 1 x group 2
        assert m["env/all/reward/total"] == -10 and m["env/all/by_group/frac_all_bad"] == 1, m
        assert m["grad_norm:last"] == 0, m  # advantages all zero: the policy does not move
        assert m["env/all/ob_tokens_per_turn"] > CONTEXT and m["tokens/trained"] > m["env/all/total_ac_tokens"], m
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-4, m
    assert d["sample_requests"] == sum(m["env/all/total_turns"] for m in rows) == 3 * 2 * 10, d
    verified["multiplayer_rl/guess_number"] = run.row(
        "multiplayer_rl/guess_number", "importance_sampling", len(rows),
        f"reward -10 -> -10 (never writes \"Guess: <n>\": -1 on each of a game's 10 turns, cannot rise); "
        f"{3 * 2 * 10} turns sampled and trained (advantages 0), prompts {mean(prompt):.0f} tokens a turn on average, "
        f"about 1,250 at turn 10 (past the tiny world's {CONTEXT}: long-context view); sampler/trainer KL "
        f"{max(abs(m['optim/kl_sample_train_v1']) for m in rows):.0e}")


def test_rubric_with_the_tiny_model_as_grader(recipe, service, tmp_path, verified):
    """rubric with its default loss stable_reinforce, to its last step, on the long-context view: the
    grader (the tiny base model, sampled by the recipe's own TinkerMessageCompleter) asks for 2048 new
    tokens after a prompt of about 350 (max_tokens fixed in rubric/env.py), more than the tiny world's
    512-token context, where the engine refused it. Its reward cannot rise: the tiny grader judges
    nothing (the rows' extraction_regex reads the first digit it writes: cookbook_datasets.rubric_rows),
    so the reward is that digit's noise (measured over 3 steps: 1.5, 5.3, 1.1, then 6.0, 2.9, 4.2) less
    the format penalty 0.1 (the policy never writes role_colon's stop sequence). What it shows: each
    answer, train and test, was graded by one 2048-token grader request (sample requests = 2 x answers),
    scores varied within groups (non-zero advantages, grad_norm > 0), and the objective's statistics on
    /metrics: every sequence recorded and trained on, none masked, the trainer's log-probs equal to the
    engine's (ratio 1)."""
    kinds = data.kinds_rows(8, seed=5)
    train = data.write_jsonl(tmp_path / "rubric_train.jsonl", data.rubric_rows(kinds[:6]))
    test = data.write_jsonl(tmp_path / "rubric_test.jsonl", data.rubric_rows(kinds[6:]))
    before = tinker_counters(service)
    run = recipe("tinker_cookbook.recipes.rubric.train", "renderer_name=role_colon", f"grader_llm_name={SERVED_NAME}",
                      "grader_renderer_name=role_colon", "groups_per_batch=2", "max_tokens=8", f"train_jsonl_path={train}",
                      f"test_jsonl_path={test}", "max_steps=3", "behavior_if_log_dir_exists=delete")
    d = delta(tinker_counters(service), before)
    logged = metrics(tmp_path / "log")
    rows = [m for m in logged if "env/all/reward/total" in m]
    reward = [m["env/all/reward/total"] for m in rows]
    answers = sum(m.get("env/all/total_episodes", 0) + m.get("test/env/all/total_episodes", 0) for m in logged)
    print("rubric reward", reward, "rubric_score", [m["env/all/rubric_score"] for m in rows], "grad_norm",
          [m["grad_norm:last"] for m in rows], "answers", answers, "stable_reinforce", d)
    assert len(rows) == 3 and all(m["env/all/total_episodes"] == 2 * 4 for m in rows), rows  # groups x group_size 4
    assert d["sample_requests"] == 2 * answers, (answers, d)  # each answer sampled, then graded once (1 rubric item)
    for m in rows:
        assert m["env/all/format"] == 0 and m["env/all/reward/total"] == pytest.approx(m["env/all/rubric_score"] - 0.1), m
        assert m["grad_norm:last"] > 0 or m["env/all/by_group/frac_mixed"] == 0, m  # a mixed group moves the policy
    assert any(m["env/all/by_group/frac_mixed"] > 0 for m in rows), rows
    assert d["calls"] >= 3 and d["sequences"] == 3 * 2 * 4, d  # steps x groups x group_size
    assert d["masked_sequences"] == 0 and d["truncated_tokens"] == 0 and d["sampled_tokens"] > 0, d
    assert abs(d["ratio_sum"] / d["sampled_tokens"] - 1) < 1e-4, d
    verified["rubric"] = run.row("rubric", "stable_reinforce", len(rows), f"reward {reward[0]:.2f} -> {reward[-1]:.2f} "
                                 "(the tiny grader's first digit: judges nothing, cannot rise); "
                                 f"{answers} answers each graded by a 2048-token grader request (long-context view); "
                                 f"{stable_reinforce_metric(d)}")
