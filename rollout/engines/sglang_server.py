"""Entry point of an SGLang server process on a CPU-only machine: ``python -m rollout.engines.sglang_server <sglang flags>``.

Why a module of our own instead of ``python -m sglang.launch_server``: SGLang's
LoRA layers hard-code ``pin_memory=True`` (torch.tensor(..., pin_memory=True),
Tensor.pin_memory()), which raises on a machine without a GPU. The patch below
turns pinning into a no-op. It must be active in *every* server process, and
SGLang starts its scheduler and detokenizer with multiprocessing's "spawn",
which re-imports this module (as ``__mp_main__``) in each child before running
it; so the patch is applied at import time, guarded by the environment variable
that rollout.engines.sglang_cpu.build_server_launch sets. (``main`` turns that spawn into a
fork, `_children_forked`, which inherits the patch; the import-time guard stays for
any child started otherwise.) Nothing here runs on a GPU
machine (the launcher uses sglang.launch_server there).

The second patch keeps a one-rank engine off the network: SGLang's scheduler joins a
torch.distributed group through ``tcp://127.0.0.1:<nccl_port>``, and torch's TCPStore
server listens on the wildcard address whatever host it is given (measured: the only
non-loopback listener of a CPU engine, ``::`` on the nccl port). With one rank there
is nobody to rendezvous with, so the group is made through a FileStore in a private
temporary folder instead: no port at all (docs/operations.md, Ports).

The third patch (rollout/engines/sglang_lm_head_rows.py) fixes SGLang's CPU LoRA backend, which routed
the unembedding's pruned rows of a mixed-adapter prefill batch to the wrong adapters.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

CPU_PATCH_ENV = "LORAFLEET_SGLANG_CPU_PATCHES"  # same value as rollout.engines.sglang_cpu.CPU_PATCH_ENV
ENGINE_SCRATCH_ENV = "LORAFLEET_ENGINE_SCRATCH"  # same value as rollout.engines.sglang_cpu.ENGINE_SCRATCH_ENV


def apply_cpu_process_patches() -> None:
    """Make pinned-memory requests no-ops in this process (idempotent).

    Pinned host memory only speeds host-to-device copies; with no device there
    is no copy, so results are unchanged."""
    import torch

    if getattr(torch, "_lorafleet_pin_memory_patched", False):
        return

    def _drop_pin(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return wrapper

    for name in ("tensor", "empty", "zeros", "ones", "full", "empty_strided", "as_tensor", "arange"):
        if hasattr(torch, name):
            setattr(torch, name, _drop_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch._lorafleet_pin_memory_patched = True
    _one_rank_groups_without_a_port()
    from rollout.engines.sglang_lm_head_rows import route_lm_head_rows_by_adapter

    route_lm_head_rows_by_adapter()


def _one_rank_groups_without_a_port() -> None:
    """torch.distributed.init_process_group of ONE rank over tcp:// -> a FileStore (no listener)."""
    import torch.distributed as dist

    init = dist.init_process_group
    if getattr(init, "_lorafleet_one_rank_file_store", False):
        return

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        method = kwargs.get("init_method")
        if kwargs.get("world_size") == 1 and isinstance(method, str) and method.startswith("tcp://"):
            # In the engine's scratch folder, which its EngineProcess removes at stop: the atexit
            # below does not run in SGLang's children, which end by signal (it left one folder in
            # /tmp per engine start).
            folder = tempfile.mkdtemp(prefix="lorafleet-sglang-store-", dir=os.environ.get(ENGINE_SCRATCH_ENV) or None)
            atexit.register(shutil.rmtree, folder, True)
            kwargs["init_method"] = f"file://{folder}/store"
        return init(*args, **kwargs)

    init_process_group._lorafleet_one_rank_file_store = True
    dist.init_process_group = init_process_group


if os.environ.get(CPU_PATCH_ENV) == "1":
    apply_cpu_process_patches()


def _children_forked() -> None:
    """SGLang's scheduler and detokenizer start as forks of this process instead of being spawned.

    SGLang asks multiprocessing for "spawn" (engine.py), which makes each child import SGLang,
    transformers and torch again: on a 2-core machine about 27 s of an engine's 70 s start
    (measured: 70-73 s spawned, 43-46 s forked, the same tiny model). Spawn is there for CUDA,
    which cannot be initialized again in a forked child; this entry point runs only CPU engines
    (rollout/engines/sglang_cpu.py), whose parent has run no CUDA and no parallel torch op before the
    children start, so a fork is safe, and the children inherit the patches above as they are."""
    import multiprocessing as mp

    real = mp.set_start_method

    @functools.wraps(real)
    def set_start_method(method, force=False):  # noqa: ANN001 - multiprocessing's own signature
        return real("fork" if method == "spawn" else method, force=force)

    mp.set_start_method = set_start_method


def main(argv: list[str] | None = None) -> None:
    import sys

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    _children_forked()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
