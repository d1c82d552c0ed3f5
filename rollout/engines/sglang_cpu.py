"""How an SGLang server is launched, with every CPU-only adjustment in this one place.

On a machine with a CUDA GPU none of the adjustments apply: the server runs as
``python -m sglang.launch_server`` with the configured flags.

On a machine without one (FINDINGS.md, "SGLang 0.5.23 on CPU"), a real SGLang
server still serves the model, with these adjustments, each needed for the
reason given:

1. ``SGLANG_USE_CPU_ENGINE=1``: without it SGLang does not take its CPU path
   (sglang.srt.platforms falls back to the CPU platform only when it is set).
2. A stand-in ``sgl_kernel`` (rollout/engines/_cpu_shims/sgl_kernel), *only when the
   real package cannot be imported*: the ``sglang-kernel`` wheel pip installs is
   CUDA-only and its import fails without libcuda, yet SGLang imports it on
   paths the CPU engine never calls. The stand-in makes imports succeed and any
   call fail loudly. If a CPU build of the real package is present, it is used.
3. ``pin_memory`` made a no-op inside the server processes
   (rollout/engines/sglang_server.py applies it at import, so SGLang's spawned scheduler
   processes get it too): SGLang's LoRA layers hard-code ``pin_memory=True``,
   which raises without a GPU. Pinned memory only speeds host-to-device copies,
   which do not exist on CPU, so dropping it changes no result.
4. ``--attention-backend torch_native --lora-backend torch_native``: the other
   backends need Triton with a GPU driver.
5. ``--dtype float32`` unless configured otherwise: SGLang's ``--dtype auto``
   picks float16 on CPU even for an fp32 checkpoint, and rollouts must match the
   fp32 trainer (greedy outputs equal HF+PEFT's, logprobs within ~1e-5).
6. ``--max-total-tokens 8192`` unless configured: otherwise SGLang sizes the KV
   cache as a fraction (mem_fraction_static) of the free memory it finds, which
   on CPU is the machine's RAM, shared with everything else; 8192 tokens hold
   the tiny model's rollouts many times over.
7. ``--sleep-on-idle``: without it the idle scheduler busy-polls its sockets and
   holds most of a core (measured: 67% of one core with no request), which on a
   small shared CPU machine slows everything else, including the trainer.
8. ``OMP_NUM_THREADS=<cpu_threads>`` (default 1): SGLang's CPU engine runs torch
   with one thread per core. On a 2-core machine shared with a trainer, OpenMP
   threads spin-wait on each other whenever one is preempted. Measured with the
   tiny model, 64 new tokens per request, while another process held one core:
   2 threads gave 30 / 97 / 325 tokens/s for 1 / 4 / 16 concurrent requests,
   1 thread 187 / 668 / 1693. With less contention 2 threads matched 1 thread
   (docs/benchmarks-history.md, "Rollout on CPU") but varied up to 6x between repeats.
   On a dedicated CPU host, raise EngineConfig.cpu_threads.
9. The unembedding's LoRA rows routed by adapter (rollout/engines/sglang_lm_head_rows.py, applied by
   rollout/engines/sglang_server.py with 3.): SGLang's CPU LoRA backend routes the pruned rows that reach
   ``lm_head`` in a mixed-adapter prefill batch by the whole sequences' lengths, giving them the
   wrong adapters (log-prob errors up to 0.53); the GPU backends route them right.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rollout.config import EngineConfig
from rollout.engines.client import ENGINE_KEEP_ALIVE_S

REPO_ROOT = Path(__file__).resolve().parents[2]
SGL_KERNEL_SHIM_DIR = Path(__file__).resolve().parent / "_cpu_shims"
# Read by rollout/engines/sglang_server.py in every server process (parent and spawned children).
CPU_PATCH_ENV = "LORAFLEET_SGLANG_CPU_PATCHES"
# A folder the server process may write scratch files in; EngineProcess makes it at start and removes it at stop.
ENGINE_SCRATCH_ENV = "LORAFLEET_ENGINE_SCRATCH"
CPU_DEFAULT_MAX_TOTAL_TOKENS = 8192


class ServerLaunch(BaseModel):
    """Everything needed to start one server process: argv, environment, and what was adjusted."""

    model_config = ConfigDict(frozen=True)

    argv: list[str]
    env: dict[str, str]
    device: Literal["cuda", "cpu"]
    sgl_kernel_stand_in: bool


def resolve_device(requested: Literal["auto", "cuda", "cpu"]) -> Literal["cuda", "cpu"]:
    """'auto' -> 'cuda' when torch sees a CUDA device, else 'cpu'."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def real_sgl_kernel_loads(python: str = sys.executable, timeout_s: float = 120.0) -> bool:
    """Whether the installed ``sgl_kernel`` imports in a fresh interpreter.

    Checked in a subprocess: a failing CUDA-extension import can leave a process
    half-initialized, and the answer is about the server's interpreter anyway."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        proc = subprocess.run(
            [python, "-c", "import sgl_kernel"],
            env=env,
            capture_output=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def build_server_launch(
    cfg: EngineConfig,
    model_path: str | Path,
    port: int,
    *,
    python: str = sys.executable,
    device: Literal["cuda", "cpu"] | None = None,
    base_env: dict[str, str] | None = None,
) -> ServerLaunch:
    """The command line and environment of one SGLang server with LoRA enabled."""
    device = device or resolve_device(cfg.device)
    env = dict(os.environ if base_env is None else base_env)
    # idle connections outlive the engine client's expiry by far (rollout/engines/client.py says why)
    env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(ENGINE_KEEP_ALIVE_S))
    args = [
        "--model-path", str(model_path),
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(cfg.tp),
        "--enable-lora",
        "--max-lora-rank", str(cfg.max_lora_rank),
        "--lora-target-modules", *cfg.lora_target_modules,
        "--max-loras-per-batch", str(cfg.max_loras_per_batch),
        "--max-loaded-loras", str(cfg.max_loaded_loras),
    ]
    stand_in = False
    dtype_flag = cfg.server_dtype_flag(device)  # the engines' dtype has one home (EngineConfig.served_dtype)
    if device == "cuda":
        if dtype_flag is not None:
            args += ["--dtype", dtype_flag]
        if cfg.max_total_tokens is not None:
            args += ["--max-total-tokens", str(cfg.max_total_tokens)]
        argv = [python, "-m", "sglang.launch_server", *args]
    else:
        # CPU: adjustments 1-8 of the module docstring.
        args += [
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--lora-backend", "torch_native",
            "--dtype", dtype_flag,
            "--max-total-tokens", str(cfg.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS),
            "--sleep-on-idle",
        ]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
        env[CPU_PATCH_ENV] = "1"
        path_parts = [str(REPO_ROOT)]
        if not real_sgl_kernel_loads(python):
            stand_in = True
            path_parts.insert(0, str(SGL_KERNEL_SHIM_DIR))
        if env.get("PYTHONPATH"):
            path_parts.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path_parts)
        argv = [python, "-m", "rollout.engines.sglang_server", *args]
    argv += list(cfg.extra_server_args)
    return ServerLaunch(argv=argv, env=env, device=device, sgl_kernel_stand_in=stand_in)
