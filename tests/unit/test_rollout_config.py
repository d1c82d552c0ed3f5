"""Rollout config validation, names, and the SGLang launch command (CPU adjustments in one place)."""

import pytest
from pydantic import ValidationError

from rollout.config import DataConfig, EngineConfig, RolloutConfig, SamplingConfig, check_adapter_name
from rollout.naming import lora_name, new_rid, rid_prefix
from rollout.engines.sglang_cpu import build_server_launch
from tests.rollout_probes import adapter_of_rid, parse_lora_name

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ports": [8000]}, "ports lists 1 ports for 2 engines"),
        ({"ports": [80000, 0]}, "ports must be in 0..65535"),
        ({"ports": [9000, 9000]}, "ports must differ between engines; repeated: [9000]"),
        ({"max_loaded_loras": 2, "max_loras_per_batch": 4}, "max_loaded_loras (2) must be >= max_loras_per_batch (4)"),
        ({"lora_target_modules": ["q_proj", "attn"]}, "unknown LoRA target modules ['attn']"),
        ({"extra_server_args": ["--port", "1"]}, "extra_server_args must not set ['--port']"),
        ({"extra_server_args": ["--dtype=half"]}, "must not set ['--dtype']"),
        ({"weight_transfer": "nfs"}, "'tensors' or 'disk'"),
        ({"nonsense": 1}, "Extra inputs are not permitted"),
    ],
)
def test_engine_config_refusals(kwargs, message):
    with pytest.raises(ValidationError) as e:
        EngineConfig(num_engines=2, **kwargs)
    assert message in str(e.value)


def test_other_config_refusals():
    with pytest.raises(ValidationError, match=r"max_inflight_per_adapter \(10\) must be <= max_inflight_total \(5\)"):
        RolloutConfig(max_inflight_per_adapter=10, max_inflight_total=5)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        SamplingConfig(n_samples_per_prompt=0)
    assert DataConfig(path="x.parquet").label_key == "label"


def test_sampling_params():
    assert SamplingConfig(temperature=0.0, max_new_tokens=8, stop=["\n"]).sglang_params() == {
        "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop": ["\n"],
    }


@pytest.mark.parametrize("name", ["a", "digits", "A-1.b_c", "x" * 64])
def test_good_adapter_names(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "-a", "a::b", "a@v1", "a b", "x" * 65, "a/b"])
def test_bad_adapter_names(name):
    with pytest.raises(ValueError, match="is not allowed"):
        check_adapter_name(name)


def test_rids_are_prefix_free_and_decode():
    rids = [new_rid(a) for a in ["a", "ab", "a.b", "a-"] for _ in range(50)]
    assert len(set(rids)) == len(rids)
    for r1 in rids:
        assert adapter_of_rid(r1) in {"a", "ab", "a.b", "a-"}
        for r2 in rids:
            assert r1 == r2 or not r2.startswith(r1)
    assert rids[0].startswith(rid_prefix("a")) and not rids[50].startswith(rid_prefix("a"))
    assert parse_lora_name(lora_name("a.b", 12)) == ("a.b", 12)
    with pytest.raises(ValueError):
        parse_lora_name("a.b")
    with pytest.raises(ValueError):
        adapter_of_rid("a::xyz")


def test_cpu_launch_has_every_adjustment():
    cfg = EngineConfig(max_lora_rank=8, max_loras_per_batch=4, max_loaded_loras=8, cpu_threads=1, extra_server_args=["--log-level", "warning"])
    launch = build_server_launch(cfg, "/m", 1234, device="cpu", base_env={"PATH": "/bin"})
    argv = launch.argv
    assert argv[1:3] == ["-m", "rollout.engines.sglang_server"]
    for flag, value in [("--attention-backend", "torch_native"), ("--lora-backend", "torch_native"), ("--dtype", "float32"),
                        ("--device", "cpu"), ("--max-total-tokens", "8192"), ("--port", "1234"), ("--max-lora-rank", "8"),
                        ("--max-loras-per-batch", "4"), ("--max-loaded-loras", "8"), ("--lora-target-modules", "all")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-lora" in argv and "--sleep-on-idle" in argv and argv[-2:] == ["--log-level", "warning"]
    env = launch.env
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["LORAFLEET_SGLANG_CPU_PATCHES"] == "1" and env["OMP_NUM_THREADS"] == "1"
    # the stand-in sgl_kernel is on the path only when the real one cannot load (it cannot, on this CPU machine)
    assert launch.sgl_kernel_stand_in == env["PYTHONPATH"].split(":")[0].endswith("rollout/engines/_cpu_shims")


def test_gpu_launch_has_no_cpu_adjustment():
    launch = build_server_launch(EngineConfig(), "/m", 1234, device="cuda", base_env={"PATH": "/bin"})
    assert launch.argv[1:3] == ["-m", "sglang.launch_server"]
    assert not {"--attention-backend", "--lora-backend", "--dtype", "--device", "--sleep-on-idle"} & set(launch.argv)
    # only the keep-alive every engine gets (rollout/engines/client.py ENGINE_KEEP_ALIVE_S), no CPU setting
    assert launch.env == {"PATH": "/bin", "SGLANG_TIMEOUT_KEEP_ALIVE": "60"} and not launch.sgl_kernel_stand_in
