"""Process group and Megatron-core parallel state for the trainer.

One trainer process per device. World = tp * dp ranks; Megatron-core's
``initialize_model_parallel(tp, pp=1)`` derives the tensor- and data-parallel
groups from it. Pipeline parallelism is not supported (pp = 1): every rank
holds all layers of its tensor-parallel shard.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.platform.cpu_compat import apply_cpu_compat, cuda_available, process_group_backend, seed_model_parallel_rng


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: its ranks and the groups it talks over."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def init_parallel(
    *,
    tp: int,
    dp: int,
    rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> ParallelLayout:
    """Join (or create) the process group and set up Megatron's TP/DP groups.

    Idempotent within a process: an existing process group of the right size is
    reused, and Megatron's parallel state is rebuilt only when tp changes.
    """
    apply_cpu_compat()
    from megatron.core import parallel_state as ps

    world_size = tp * dp
    if not dist.is_initialized():
        if cuda_available():
            local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local_rank)
        port = master_port if master_port is not None else free_loopback_port()
        dist.init_process_group(
            process_group_backend(),
            init_method=f"tcp://{master_addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    elif dist.get_world_size() != world_size:
        raise ValueError(
            f"process group already has world size {dist.get_world_size()}, "
            f"but tp={tp} x dp={dp} needs {world_size}"
        )
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != tp:
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    seed_model_parallel_rng(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()
