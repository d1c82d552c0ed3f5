"""The job file's `placement:` section: which devices the rollout engines and the trainer get
(`PlacementConfig`). The planner that checks it against a cluster and reserves the devices is
service/fleet/placement.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.strict_model import StrictModel

_MAX_PARALLEL = 1024  # sanity bound: a typo such as 80 instead of 8 still plans; 10**6 does not


class EnginePlacement(StrictModel):
    """SGLang rollout engines: `count` servers, each spanning `tensor_parallel` GPUs of one node."""

    count: int = Field(1, ge=1, le=_MAX_PARALLEL, description="number of SGLang engines (servers)")
    tensor_parallel: int = Field(
        1, ge=1, le=_MAX_PARALLEL, description="GPUs per engine (SGLang --tp); all on one node"
    )
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for each engine (Ray bundle)")


class TrainerPlacement(StrictModel):
    """Megatron trainer: tensor_parallel x data_parallel ranks, one GPU each."""

    tensor_parallel: int = Field(
        1, ge=1, le=_MAX_PARALLEL, description="Megatron tensor parallel size; a TP group sits on one node"
    )
    data_parallel: int = Field(1, ge=1, le=_MAX_PARALLEL, description="Megatron data parallel size")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs reserved for each trainer rank (Ray bundle)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.data_parallel


class PlacementConfig(StrictModel):
    """The job file's `placement:` section. The default is the embedded tiny CPU plan."""

    accelerator: Literal["cpu", "gpu"] = Field(
        "cpu",
        description="'gpu': every engine TP rank and every trainer rank gets one GPU; "
        "'cpu': no GPU at all (the embedded tiny default)",
    )
    engines: EnginePlacement = Field(default_factory=EnginePlacement)
    trainer: TrainerPlacement = Field(default_factory=TrainerPlacement)
    node_loss_wait_s: float = Field(
        600.0, gt=0, le=86400,
        description="A node lost: its engines and trainer TP groups are placed anew on the nodes left, or on a node that "
        "joins, for up to this many seconds (the trainer; the engines: while none is left in service); then the "
        "service drains (checkpoints every live run it can) and stops, saying why (service/fleet/node_faults.py).",
    )

    @property
    def engine_gpus(self) -> int:
        return self.engines.count * self.engines.tensor_parallel if self.accelerator == "gpu" else 0

    @property
    def trainer_gpus(self) -> int:
        return self.trainer.world_size if self.accelerator == "gpu" else 0

    @property
    def total_gpus(self) -> int:
        return self.engine_gpus + self.trainer_gpus
