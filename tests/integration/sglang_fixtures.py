"""Shared helpers for tests against a real SGLang server on CPU (tiny model, LoRA enabled).

One server start costs ~35-60 s on this machine, so share one per test module:

    from tests.integration.sglang_fixtures import sglang_server_fixture

    sglang_server = sglang_server_fixture(max_lora_rank=8)   # module-scoped by default

    def test_something(sglang_server):
        sglang_server.url            # http://127.0.0.1:<free port>
        sglang_server.engine         # rollout.engines.engine.EngineProcess (kill(), restart(), log_path)
        sglang_server.model_dir      # the tiny model folder

The factory's keyword arguments are `rollout.config.EngineConfig` fields
(defaults below suit the tiny model: rank <= 8, 4 adapters per batch, 8
loaded). The server picks a free loopback port and is stopped at fixture
teardown, also when a test fails; `running_sglang_server` is the same as a
context manager for a test that wants the server's whole life inside it.

Other helpers: `make_peft_adapter` writes a PEFT adapter for the tiny model
with random non-zero B (so it changes the output), `hf_greedy` gives HF (+PEFT)
greedy continuations to compare the server's with, and `GREEDY` is the
matching SGLang sampling params (no stop at EOS on either side, so sequences
have the full length).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout.engines.client import EngineClient
from rollout.config import EngineConfig
from rollout.engines.engine import EngineProcess

TINY_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_ENGINE = dict(max_lora_rank=8, max_loras_per_batch=4, max_loaded_loras=8, startup_deadline_s=240.0)
GREEDY_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True}


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread: on this shared 2-core machine two OpenMP threads spin-wait on
    each other whenever one is preempted (measured: HF greedy of 16 tokens x 4 prompts 10.3 s
    with 2 threads, 0.37 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class SGLangServer:
    engine: EngineProcess
    model_dir: Path
    cfg: EngineConfig
    startup_s: float

    @property
    def url(self) -> str:
        return self.engine.url

    def client(self, **kwargs) -> EngineClient:
        return EngineClient(self.url, **kwargs)


@contextlib.contextmanager
def running_sglang_server(model_dir: str | Path, log_dir: str | Path, **engine_kwargs) -> Iterator[SGLangServer]:
    """Start a real SGLang server (CPU on this machine) and always stop it when the block exits."""
    cfg = EngineConfig(**{**DEFAULT_ENGINE, **engine_kwargs})
    engine = EngineProcess(0, cfg, model_dir, log_dir=log_dir)
    try:
        engine.start()
        startup_s = engine.wait_ready()
        yield SGLangServer(engine, Path(model_dir), cfg, startup_s)
    finally:
        engine.stop()


def sglang_server_fixture(*, scope: str = "module", **engine_kwargs):
    """A pytest fixture (default module scope) yielding a running `SGLangServer` with the tiny model."""

    @pytest.fixture(scope=scope)
    def _sglang_server(tiny_world, tmp_path_factory):
        with running_sglang_server(tiny_world / "model", tmp_path_factory.mktemp("sglang-logs"), **engine_kwargs) as server:
            yield server

    return _sglang_server


def make_peft_adapter(model_dir: str | Path, out_dir: str | Path, *, seed: int, rank: int = 8, alpha: int = 16,
                      b_std: float = 0.05, target_modules: list[str] | None = None) -> Path:
    """Write a PEFT adapter for the tiny model: PEFT's default A, random normal B (std `b_std`).

    With b_std 0.05 the greedy output differs from the base model's and between seeds."""
    with one_torch_thread():
        return _make_peft_adapter(model_dir, out_dir, seed, rank, alpha, b_std, target_modules)


def _make_peft_adapter(model_dir, out_dir, seed, rank, alpha, b_std, target_modules) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules or TINY_LORA_TARGETS, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def hf_greedy(model_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]],
              max_new_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    """HF (+PEFT when adapter_dir is given) greedy continuations, not stopping at EOS (like GREEDY)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    with torch.no_grad(), one_torch_thread():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(out[0][len(ids):].tolist())
    return outs
