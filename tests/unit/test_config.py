"""The config tree: AdapterConfig rules, ServiceSettings sources, job files, and the
registration checks that need the filesystem (path confinement tables)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from service.config.adapter import AdapterConfig
from service.config.job import SlotCapacity, load_job
from service.config.settings import ConfigError, load_settings
from service.control.config_checks import check_adapter_config, confine_path
from service.errors import BadValue

pytestmark = pytest.mark.unit

RL = {"data": {"path": "d.jsonl"}, "reward": {"name": "target_share"}}


@pytest.mark.parametrize(
    "over, error",
    [
        ({"num_step": 3, "num_epoch": 1}, "at most one of num_step and num_epoch"),
        ({"reward": None}, "objective 'rl' needs a reward"),
        ({"sampling": {"n_samples_per_prompt": 1}}, "n_samples_per_prompt >= 2"),
        ({"objective": "sft"}, "reward applies only to objective 'rl'"),
        ({"init_from": "a", "resume_from": "b"}, "at most one of init_from and resume_from"),
        ({"rank": 0}, "rank\n  Input should be greater than or equal to 1"),
        ({"lr_schedule": "linear"}, "lr_schedule\n  Input should be 'constant' or 'cosine'"),
        ({"learning_rate": 1e-4, "lerning_rate": 1}, "lerning_rate\n  Extra inputs are not permitted"),
        ({"data": {"path": "d.csv"}}, "must end in .jsonl or .parquet"),
        ({"sampling": {"top_p": 0}}, "top_p\n  Input should be greater than 0"),
        ({"target_modules": []}, "need a non-empty set without repeats of attention, mlp, unembed"),
        ({"target_modules": ["mlp", "mlp"]}, "need a non-empty set without repeats of attention, mlp, unembed"),
        ({"target_modules": ["lm_head"]}, "target_modules.0\n  Input should be 'attention', 'mlp' or 'unembed'"),
    ],
)
def test_adapter_config_refusals_name_the_field(over, error):
    with pytest.raises(ValidationError) as err:
        AdapterConfig.model_validate({**RL, **over})
    assert error in str(err.value)


def test_adapter_config_defaults_and_label_key_per_objective():
    rl = AdapterConfig.model_validate(RL)
    assert (rl.rank, rl.alpha, rl.lr_schedule, rl.data.label_key, rl.checkpoint_interval) == (8, 16.0, "constant", "label", 10)
    sft = AdapterConfig.model_validate({"objective": "sft", "data": {"path": "e.jsonl"}})
    assert sft.data.label_key == "completion"
    dc = AdapterConfig.model_validate({**RL, "seed": 7}).data_config()
    assert (dc.shuffle_seed, dc.num_epochs, dc.label_key) == (7, 1, "label")
    assert AdapterConfig.model_validate({**RL, "num_step": 5}).data_config().num_epochs is None
    with pytest.raises(ValidationError):
        rl.rank = 4  # frozen: a validated config cannot drift


def test_target_modules_reach_the_trainer():
    """REST target_modules -> SlotHyperParams.targets (default attention + MLP: no unembedding)."""
    assert AdapterConfig.model_validate(RL).slot_hyper_params(None).targets == ("attention", "mlp")
    cfg = AdapterConfig.model_validate({**RL, "target_modules": ["unembed", "attention"]})
    assert cfg.target_modules == ["attention", "unembed"]
    assert cfg.slot_hyper_params(None).targets == ("attention", "unembed")


def test_registration_refuses_targets_the_service_cannot_train_or_serve(roots, tmp_path):
    """A trainer without output_layer LoRA cannot take unembed; engines that do not load lm_head
    cannot serve an RL adapter with it (SFT is not served and may); a PEFT folder with LoRA on a
    module the config does not train is refused. Each names config.target_modules / init_from."""
    root, _ = roots
    settings = load_settings(data_roots=[root], state_dir=tmp_path / "state")

    def check(cap, **over):
        config = {"data": {"path": "sub/ok.jsonl"}, "reward": {"name": "target_share"}, "prompts_per_step": 1, **over}
        return check_adapter_config(AdapterConfig.model_validate(config), settings, cap)

    unembed = {"target_modules": ["attention", "unembed"]}
    assert check(SlotCapacity(), **unembed).config.target_modules == ["attention", "unembed"]
    with pytest.raises(BadValue, match=r"target_modules \['unembed'\] cannot be trained here: .* for \['attention', "
                                       r"'mlp'\] \(unembed needs output_layer") as err:
        check(SlotCapacity(target_groups=["attention", "mlp"]), **unembed)
    assert err.value.field == "config.target_modules"
    with pytest.raises(BadValue, match="unembed on an rl adapter trains LoRA on lm_head, which this service's engines do not load"):
        check(SlotCapacity(rl_unembed_lora=False), **unembed)
    sft = {"objective": "sft", "reward": None, "data": {"path": "sub/sft.jsonl"}}
    (root / "sub" / "sft.jsonl").write_text('{"prompt": "p", "completion": "c"}\n')
    assert check(SlotCapacity(rl_unembed_lora=False), **unembed, **sft).config.target_modules == ["attention", "unembed"]
    (root / "peft").mkdir()
    (root / "peft" / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "lm_head"]}')
    (root / "peft" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(BadValue, match=r"has LoRA on \['lm_head'\], which config.target_modules \['attention', 'mlp'\] does "
                                       r"not train; add \['unembed'\] to target_modules"):
        check(SlotCapacity(), init_from="peft")
    assert check(SlotCapacity(), init_from="peft", **unembed).config.init_from == str((root / "peft").resolve())


def test_job_capacity_follows_trainer_and_engines(tmp_path):
    """The job's capacity says what adapters may train (trainer.target_modules) and whether RL may
    train the unembedding (engines.lora_target_modules); a job adapter beyond them is refused."""
    from examples.tiny.build import ensure_tiny_world

    world = ensure_tiny_world()
    base = f"base_model: {{path: {world / 'model'}}}\ntrainer: {{}}\n"
    (tmp_path / "a.yaml").write_text(base)
    cap = load_job(tmp_path / "a.yaml").capacity
    assert cap.target_groups == ["attention", "mlp", "unembed"] and cap.rl_unembed_lora is True
    (tmp_path / "b.yaml").write_text(
        f"base_model: {{path: {world / 'model'}}}\ntrainer: {{target_modules: [linear_qkv, linear_fc1]}}\n"
        "engines: {lora_target_modules: [q_proj, gate_proj]}\n")
    cap = load_job(tmp_path / "b.yaml").capacity
    assert cap.target_groups == ["attention", "mlp"] and cap.rl_unembed_lora is False
    adapter = ("adapters:\n  - name: d\n    config: {data: {path: %s}, reward: {name: target_share}, "
               "target_modules: [attention, unembed]}\n" % (world / "data" / "digits.jsonl"))
    (tmp_path / "c.yaml").write_text(base.replace("trainer: {}", "trainer: {}\nengines: {lora_target_modules: [q_proj]}") + adapter)
    with pytest.raises(ConfigError, match="RL adapters d train the unembedding .* has neither all nor lm_head"):
        load_job(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text(base.replace("trainer: {}", "trainer: {target_modules: [linear_qkv]}") + adapter)
    with pytest.raises(ConfigError, match=r"adapters train targets the trainer has no LoRA layers for: d \(unembed\)"):
        load_job(tmp_path / "d.yaml")


def test_settings_precedence_explicit_env_file(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("LORAFLEET_"):
            monkeypatch.delenv(key)
    f = tmp_path / "settings.yaml"
    f.write_text("port: 7001\nmax_body_bytes: 4096\napi_token: from-file\n")
    s = load_settings(f)
    assert (s.port, s.max_body_bytes, s.api_token.get_secret_value(), s.host) == (7001, 4096, "from-file", "127.0.0.1")
    monkeypatch.setenv("LORAFLEET_PORT", "7002")
    monkeypatch.setenv("LORAFLEET_DATA_ROOTS", f"/srv/a{os.pathsep}/srv/b")
    s = load_settings(f)
    assert s.port == 7002 and s.data_roots == [Path("/srv/a"), Path("/srv/b")]
    assert load_settings(f, port=7003).port == 7003
    monkeypatch.setenv("LORAFLEET_SETTINGS_FILE", str(f))
    assert load_settings().max_body_bytes == 4096


def test_non_loopback_bind_needs_a_token(monkeypatch):
    monkeypatch.delenv("LORAFLEET_API_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="host '0.0.0.0' is not a loopback address, so an API token is required"):
        load_settings(host="0.0.0.0")
    assert load_settings(host="0.0.0.0", api_token="x" * 16).host == "0.0.0.0"
    assert load_settings(host="::1").host == "::1"


@pytest.mark.parametrize(
    "host, token, error",
    [
        ("0.0.0.0", "t", "the API token has only 1 characters; use at least 16"),
        ("10.1.2.3", "   ", "api_token is blank"),
        ("0.0.0.0", "  short-token-15c  ", "the API token has only 15 characters"),  # whitespace does not count
        ("127.0.0.1", " \t ", "api_token is blank"),  # a blank token protects nothing, on loopback either
    ],
)
def test_weak_tokens_are_refused_off_loopback(monkeypatch, host, token, error):
    """Issue 14 F10: off loopback, a whitespace-only or short token was accepted."""
    monkeypatch.delenv("LORAFLEET_API_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=error):
        load_settings(host=host, api_token=token)
    assert load_settings(host="127.0.0.1", api_token=" t ").api_token.get_secret_value() == "t"  # loopback: any token, stripped
    assert load_settings(host=host, api_token=" " + "k" * 16 + "\n").api_token.get_secret_value() == "k" * 16


def write_job(tmp_path, body: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(body)
    return p


JOB = """
base_model: {path: model}
slots: {num_slots: 2, max_rank: 8}
adapters:
  - name: digits
    config: {data: {path: data/digits.jsonl}, reward: {name: target_share}, rank: %(rank)s}
  - name: %(second)s
    config: {objective: sft, data: {path: /abs/echo.jsonl}}
"""


def test_load_job_rebases_relative_paths_and_derives_trainer_fields(tmp_path):
    job = load_job(write_job(tmp_path, JOB % {"rank": 8, "second": "echo"}))
    assert job.base_model.path == job.trainer.base_model_path == str(tmp_path / "model")
    assert (job.trainer.num_slots, job.trainer.max_rank, job.trainer.tp, job.trainer.dp) == (2, 8, 1, 1)
    assert (job.engines.num_engines, job.engines.tp) == (1, 1)
    hp = job.adapters[0].config.slot_hyper_params(total_steps=10)
    assert (hp.rank, hp.lr, hp.samples_per_step, hp.objective, hp.total_steps) == (8, 1e-4, 16, "rl", 10)
    assert job.adapters[1].config.slot_hyper_params(None).samples_per_step == 4
    assert job.adapters[0].config.data.path == str(tmp_path / "data" / "digits.jsonl")
    assert job.adapters[1].config.data.path == "/abs/echo.jsonl"
    settings = job.service_settings(reward_import_roots=["myorg.rewards"])
    assert settings.host == "127.0.0.1"
    assert job.rollout_config(settings).reward_import_roots == ["myorg.rewards"]


def test_served_name_is_what_clients_call_the_base_model(tmp_path):
    named = load_job(write_job(tmp_path, "base_model: {path: models/tiny, served_name: Qwen/Qwen3-8B}\n"))
    assert (named.base_model.name, named.base_model.path) == ("Qwen/Qwen3-8B", str(tmp_path / "models" / "tiny"))
    assert load_job(write_job(tmp_path, "base_model: {path: models/tiny}\n")).base_model.name == "tiny"  # the folder's name


@pytest.mark.parametrize(
    "body, error",
    [
        (JOB % {"rank": 0, "second": "echo"}, "adapters.0.config.rank: Input should be greater than or equal to 1 (got 0)"),
        (JOB % {"rank": 16, "second": "echo"}, "adapter rank above slots.max_rank 8: digits (rank 16)"),
        (JOB % {"rank": 8, "second": "digits"}, "adapter names must be unique; repeated: digits"),
        (JOB % {"rank": 8, "second": "'bad::name'"}, "adapters.1.name: String should match pattern"),
        ("base_model: {path: m}\nengines: {max_lora_rank: 4}\n", "engines.max_lora_rank (4) must be >= slots.max_rank (16)"),
        ("base_model: {path: m}\nservice: {host: 10.0.0.1}\n", "service section: invalid service settings"),
        ("base_model: {path: m}\ntrainer: {num_slots: 3}\n", "trainer.num_slots (3) disagrees with slots.num_slots (4); state it once, in slots"),
        ("base_model: {path: m}\nplacement: {engines: {count: 2}}\nengines: {num_engines: 1}\n", "engines.num_engines (1) disagrees with placement.engines.count (2)"),
        ("base_model: {path: m}\ntrainer: {base_model_path: other}\n", "trainer.base_model_path (other) disagrees with base_model.path (m)"),
        ("base_model: {path: m}\ntrainer: {lora_kernel: fast}\n", "trainer.lora_kernel: Input should be 'auto', 'grouped_mm' or 'loop'"),
        ("base_model: {path: m}\nrollout: {reward_import_roots: [x]}\n", "rollout.reward_import_roots is taken from the service settings"),
        ("base_model: {path: m, served_name: 'Qwen/Qwen3-8B/x'}\n", "base_model.served_name: String should match pattern"),
        ("base_model: {path: m, served_name: '../m'}\n", "base_model.served_name: String should match pattern"),
        ("adapters: [\n", "is not valid YAML"),
        ("{}", "base_model: Field required"),
    ],
)
def test_load_job_errors_name_the_field(tmp_path, monkeypatch, body, error):
    monkeypatch.delenv("LORAFLEET_API_TOKEN", raising=False)
    with pytest.raises(ConfigError) as err:
        load_job(write_job(tmp_path, body))
    assert error in str(err.value)


@pytest.fixture
def roots(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "ok.jsonl").write_text('{"prompt": "p", "label": "l"}\n')
    (outside / "secret.jsonl").write_text('{"prompt": "p", "label": "l"}\n')
    (root / "link_out.jsonl").symlink_to(outside / "secret.jsonl")
    (root / "dir_out").symlink_to(outside)
    (root / "link_in.jsonl").symlink_to(root / "sub" / "ok.jsonl")
    return root, outside


@pytest.mark.parametrize(
    "raw, error",
    [
        ("sub/ok.jsonl", None),
        ("{root}/sub/ok.jsonl", None),
        ("link_in.jsonl", None),
        ("sub/../sub/ok.jsonl", "'..' is not allowed in paths"),
        ("{root}/../outside/secret.jsonl", "'..' is not allowed in paths"),
        ("{outside}/secret.jsonl", "is outside the allowed roots"),
        ("{outside}/missing.jsonl", "is outside the allowed roots"),  # no existence oracle outside
        ("link_out.jsonl", "leads outside the allowed roots through a symlink"),
        ("dir_out/secret.jsonl", "leads outside the allowed roots through a symlink"),
        ("sub/missing.jsonl", "does not exist"),
        ("sub", "is not a regular file"),
    ],
)
def test_path_confinement(roots, raw, error):
    root, outside = roots
    raw = raw.format(root=root, outside=outside)
    if error is None:
        assert confine_path(raw, [root], "config.data.path", want="file") == (root / "sub" / "ok.jsonl").resolve()
    else:
        with pytest.raises(BadValue, match="config.data.path: .*" + error.replace("(", r"\(").replace(")", r"\)")):
            confine_path(raw, [root], "config.data.path", want="file")


def test_registration_checks(roots, tmp_path):
    root, _ = roots
    settings = load_settings(data_roots=[root], state_dir=tmp_path / "state", reward_import_roots=["json"])
    cap = SlotCapacity(num_slots=2, max_rank=16)

    def check(**over):
        # ok.jsonl has one row: one prompt per step is the most it can serve in one epoch (see the refusal below)
        config = {"data": {"path": "sub/ok.jsonl"}, "reward": {"name": "target_share"}, "prompts_per_step": 1, **over}
        return check_adapter_config(AdapterConfig.model_validate(config), settings, cap)

    assert check().total_steps == 1 and check().data_rows == 1
    (root / "rows.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    refusals = [
        ({"data": {"path": "rows.jsonl"}}, "line 1 of .* lacks key\\(s\\) \\['label'\\]"),
        ({"data": {"path": "rows.jsonl", "label_key": "answer", "input_key": "question"}}, "lacks key\\(s\\) \\['question'\\]"),
        ({"reward": {"name": "nosuch"}}, "unknown built-in reward 'nosuch'"),
        ({"reward": {"name": "os.path:join"}}, "module 'os.path' is not under an allowed reward import root; allowed: \\['json'\\]"),
        ({"reward": {"name": "json:nosuch"}}, "'json' has no callable 'nosuch'"),
        ({"init_from": "sub"}, "not a PEFT adapter folder: missing \\['adapter_config.json', 'adapter_model.safetensors'\\]"),
        ({"resume_from": "sub/ok.jsonl"}, "config.resume_from: 'sub/ok.jsonl' is not a folder"),
        ({"warmup_steps": 5, "lr_schedule": "cosine"}, "does not fit the trainer \\(1 steps\\): .*warmup_steps 5 exceeds total_steps 1"),
        # one row and a step of 4 (the default): less than one whole step, which the run would drop (planned_steps)
        ({"prompts_per_step": 4}, re.escape("config.prompts_per_step: a step takes 4 rows (prompts_per_step) but ok.jsonl has 1 row(s) "
                                            "x 1 epoch(s) (num_epoch) = 1, so the run would end without a single step; allowed: "
                                            "prompts_per_step at most 1, or add rows, raise num_epoch, or set num_step")),
        ({"prompts_per_step": 4, "num_epoch": 3}, re.escape("1 row(s) x 3 epoch(s) (num_epoch) = 3, so the run would end without")),
    ]
    for over, error in refusals:
        with pytest.raises(BadValue, match=error):
            check(**over)
    assert check(prompts_per_step=4, num_epoch=4).total_steps == 1  # 4 epochs of the one row fill one step
    assert check(prompts_per_step=4, num_step=3).total_steps == 3  # with num_step the data repeats until step 3
    assert check(reward={"name": "json:dumps"}).config.reward.name == "json:dumps"
    (root / "sub" / "adapter_config.json").write_text('{"r": 4}')
    (root / "sub" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(BadValue, match="has rank 4 but config.rank is 8"):
        check(init_from="sub")
    assert check(init_from="sub", rank=4).config.init_from == str((root / "sub").resolve())


def test_engines_bind_to_loopback_when_the_service_does(tmp_path, monkeypatch):
    """Issue 14 F10: engines stay on loopback with a loopback service (a job asking otherwise is
    refused at load), and bind to the interface the job names when the service is not on loopback."""
    monkeypatch.delenv("LORAFLEET_HOST", raising=False)
    monkeypatch.setenv("LORAFLEET_API_TOKEN", "k" * 16)
    base = "base_model: {path: model}\n"
    job = load_job(write_job(tmp_path, base))
    assert job.engine_config(job.service_settings()).host == "127.0.0.1"
    with pytest.raises(ConfigError, match="engines.host '0.0.0.0' is not a loopback address but the service binds to '127.0.0.1'"):
        load_job(write_job(tmp_path, base + "engines: {host: 0.0.0.0}\n"))
    job = load_job(write_job(tmp_path, base + "engines: {host: 10.1.2.3}\nservice: {host: 10.1.2.3}\n"))
    assert job.engine_config(job.service_settings()).host == "10.1.2.3"
    from api.app import create_app  # the API checks the token again, with the same rule

    weak = job.service_settings().model_copy(update={"api_token": SecretStr("short")})
    with pytest.raises(ValueError, match="refusing to serve on '10.1.2.3'.*only 5 characters"):
        create_app(None, weak)


def test_registration_fills_the_length_limits_and_bounds_a_step(roots, tmp_path):
    """Issue 14 F1: the stored config names the limits its rows are read with (the tenant's where lower,
    else the service's and the model's context), and a step that could exceed max_step_tokens is refused."""
    root, _ = roots
    settings = load_settings(data_roots=[root], state_dir=tmp_path / "state", max_prompt_tokens=300, max_completion_tokens=200,
                             max_step_tokens=20_000, max_row_bytes=4096)
    cap = SlotCapacity(num_slots=2, max_rank=16, context_tokens=512)

    def limits(**over):
        # num_step: the one-row file repeats until then, so a step of any size can be made from it
        base = {"data": {"path": "sub/ok.jsonl", **over.pop("data", {})}, "reward": {"name": "target_share"}, "num_step": 10, **over}
        if base.get("objective") == "sft":
            base.pop("reward")
            base["data"]["label_key"] = "label"
        data = check_adapter_config(AdapterConfig.model_validate(base), settings, cap).config.data
        return data.max_row_bytes, data.max_prompt_tokens, data.max_completion_tokens, data.max_sample_tokens

    # rl: prompt <= min(300, 512 - 64 new tokens); the completion is sampling.max_new_tokens
    assert limits() == (4096, 300, None, 364)
    assert limits(sampling={"max_new_tokens": 200}) == (4096, 300, None, 500)
    assert limits(sampling={"max_new_tokens": 200, "n_samples_per_prompt": 2}, data={"max_prompt_tokens": 50}) == (4096, 50, None, 250)
    # sft: prompt 300, completion 200, sample min(512, 500)
    assert limits(objective="sft") == (4096, 300, 200, 500)
    assert limits(objective="sft", data={"max_sample_tokens": 100, "max_row_bytes": 2048}) == (2048, 300, 200, 100)
    refusals = [
        ({"data": {"max_prompt_tokens": 301}}, "config.data.max_prompt_tokens 301 is above the service's limit of 300"),
        ({"sampling": {"max_new_tokens": 201}}, "config.sampling.max_new_tokens 201 is above the service's limit of 200"),
        ({"data": {"max_row_bytes": 5000}}, "config.data.max_row_bytes 5000 is above the service's limit of 4096"),
        ({"prompts_per_step": 16, "sampling": {"n_samples_per_prompt": 4}},
         "a step of this adapter may hold 64 samples of up to 364 tokens = 23296 tokens, above the service's per-step budget of 20000 tokens (max_step_tokens)"),
        ({"objective": "sft", "prompts_per_step": 41}, "41 samples of up to 500 tokens = 20500 tokens, above"),
    ]
    for over, error in refusals:
        with pytest.raises(BadValue, match=re.escape(error)):
            limits(**over)
    with pytest.raises(ValidationError, match="data.max_completion_tokens applies only to objective 'sft'"):
        AdapterConfig.model_validate({"data": {"path": "x.jsonl", "max_completion_tokens": 5}, "reward": {"name": "target_share"}})
    small = SlotCapacity(num_slots=2, max_rank=16, context_tokens=64)
    with pytest.raises(BadValue, match=re.escape("config.sampling.max_new_tokens 64 leaves no room for a prompt in the model's context of 64 tokens")):
        check_adapter_config(AdapterConfig.model_validate({"data": {"path": "sub/ok.jsonl"}, "reward": {"name": "target_share"}}), settings, small)


def test_the_job_reads_the_model_context_from_the_base_model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 512}')
    job = load_job(write_job(tmp_path, "base_model: {path: model}\n"))
    assert job.capacity.context_tokens == 512
    assert load_job(write_job(tmp_path, "base_model: {path: model}\nslots: {context_tokens: 256}\n")).capacity.context_tokens == 256
    assert load_job(write_job(tmp_path, "base_model: {path: nowhere}\n")).capacity.context_tokens is None


def test_relative_paths_as_records_show_them_resolve_under_any_root(roots, tmp_path):
    """Records show paths relative to their root (issue 14 F8); given back, they resolve: a checkpoint
    under the state dir is found there although data roots come first."""
    root, _ = roots
    state = tmp_path / "state"
    (state / "runs" / "a-1" / "ckpt").mkdir(parents=True)
    assert confine_path("runs/a-1/ckpt", [root, state], "config.resume_from", want="dir") == (state / "runs" / "a-1" / "ckpt").resolve()
    with pytest.raises(BadValue, match="'runs/nope' does not exist"):
        confine_path("runs/nope", [root, state], "config.resume_from", want="dir")


ENVS = "tests.integration.envs_for_tests"


def test_rollout_rules_of_the_adapter_config():
    custom = {"rollout": {"name": f"{ENVS}:ThreeTurns"}}
    assert AdapterConfig.model_validate({**RL, **custom, "reward": None}).custom_rollout  # it computes its own rewards
    with pytest.raises(ValidationError, match="objective 'rl' needs a reward"):
        AdapterConfig.model_validate({**RL, "reward": None, "rollout": {"name": "single_turn"}})
    with pytest.raises(ValidationError, match="rollout applies only to objective 'rl'"):
        AdapterConfig.model_validate({"objective": "sft", "data": {"path": "e.jsonl"}, **custom})
    with pytest.raises(ValidationError, match="rollout.timeout_s\n  Input should be greater than 0"):
        AdapterConfig.model_validate({**RL, "rollout": {"name": "single_turn", "timeout_s": 0}})
    with pytest.raises(ValidationError, match="numbers must be finite; kwargs.k is Infinity or NaN"):
        AdapterConfig.model_validate({**RL, "rollout": {"name": f"{ENVS}:ThreeTurns", "kwargs": {"k": float("inf")}}})


def test_registration_checks_a_rollout_as_the_worker_will_load_it(roots, tmp_path):
    """Import path (confined to rollout_import_roots, never imported when refused), kind, kwargs and the
    token budget; the checked config carries the budget in force (default: the model's context)."""
    root, _ = roots
    settings = load_settings(data_roots=[root], state_dir=tmp_path / "state", rollout_import_roots=[ENVS], max_step_tokens=20_000)
    cap = SlotCapacity(num_slots=2, max_rank=16, context_tokens=512)

    def check(rollout, **over):
        config = {"data": {"path": "sub/ok.jsonl"}, "rollout": rollout, "prompts_per_step": 1,
                  "sampling": {"n_samples_per_prompt": 4, "max_new_tokens": 16}, **over}
        return check_adapter_config(AdapterConfig.model_validate(config), settings, cap)

    checked = check({"name": f"{ENVS}:ThreeTurns", "kwargs": {"note": "hi"}})
    assert checked.config.rollout.max_tokens == 512 and checked.config.reward is None
    assert checked.config.data.max_prompt_tokens == 512 - 16
    small = check({"name": f"{ENVS}:two_tries", "max_tokens": 100}).config
    # the budget is the trajectory's context: prompts are read with room left for a turn
    assert small.rollout.max_tokens == 100 and small.data.max_prompt_tokens == 100 - 16 and small.data.max_sample_tokens == 100
    refusals = [
        ({"name": "os:system"}, re.escape("config.rollout.name: custom rollout module 'os' is not under an allowed rollout import "
                                          f"root; allowed: ['{ENVS}']")),
        ({"name": f"{ENVS}:not_a_rollout"}, "config.rollout.name: 'not_a_rollout' in rollout module .* is neither an environment class"),
        ({"name": f"{ENVS}:ThreeTurns", "kwargs": {"colour": 1}}, "config.rollout.kwargs: the kwargs do not fit the environment"),
        ({"name": f"{ENVS}:ThreeTurns", "max_tokens": 513}, "config.rollout.max_tokens 513 does not fit: .* stay within the model's "
                                                             "context \\(512\\); allowed: 17..512"),
        ({"name": f"{ENVS}:ThreeTurns", "max_tokens": 16}, "config.rollout.max_tokens 16 does not fit: a trajectory must hold a prompt "
                                                            "and one turn of sampling.max_new_tokens \\(16\\)"),
    ]
    for rollout, error in refusals:
        with pytest.raises(BadValue, match=error) as e:
            check(rollout)
        assert e.value.field in ("config.rollout.name", "config.rollout.kwargs", "config.rollout.max_tokens")
    with pytest.raises(BadValue, match="4 trajectories of up to 512 tokens = 2048 tokens, above the service's per-step budget of 2000"):
        check_adapter_config(AdapterConfig.model_validate({"data": {"path": "sub/ok.jsonl"}, "prompts_per_step": 1,
                                                           "rollout": {"name": f"{ENVS}:ThreeTurns"},
                                                           "sampling": {"n_samples_per_prompt": 4, "max_new_tokens": 16}}),
                             load_settings(data_roots=[root], state_dir=tmp_path / "state", rollout_import_roots=[ENVS],
                                           max_step_tokens=2000, max_prompt_tokens=100), cap)
