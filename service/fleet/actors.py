"""Every Ray actor of the service, with its options, in one place.

Three actor roles exist (DESIGN.md "Processes"); everything else runs in the
coordinator process (API, controller, runtime, loop) or is an SGLang process:
  * trainer ranks: `trainer.actor.TrainWorker`, one per device, tp * dp of them;
    rank r sits in bundle tp_rank of the trainer placement group of its dp_rank
    (service/fleet/placement.py plans and reserves the groups);
  * engine launchers: `rollout.engines.engine_launcher.EngineLauncher`, one per engine, in
    that engine's placement group (its GPUs and CPUs, on the node the planner chose);
    each starts its SGLang engine, which dies with it;
  * the rollout worker: `rollout.worker_actor.RolloutWorker` (async), pinned to the
    coordinator's node with no resources reserved (it routes HTTP requests, scores and
    buffers; the engines do the work): it shares the coordinator's fate only, so losing
    an engine or trainer node never loses the rollout state (data cursors, buffers).
No actor restarts by itself (max_restarts=0): a lost trainer, engine launcher or rollout
worker is replaced deliberately by the coordinator (service/fleet/trainer_group.py restarts the
trainer; the loop re-prepares every live run from its checkpoint; service/fleet/node_faults.py
places a lost engine anew).
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.config.job import JobConfig
from service.config.settings import ServiceSettings


# Ray starts its workers at niceness 15 (its `worker_niceness`; each core worker reads RAY_worker_niceness
# from its own environment, as Ray's job supervisor sets it to 0 for itself). A trainer rank is on the
# serial path of every mixed step: at 15 it yields the host's cores to the coordinator, the raylet, the
# GCS and the CPU engines, and the whole fleet waits on it (issue 41, measured: it waited longer for a core
# than it ran). So trainer ranks run at 0, like the coordinator; the other actors keep Ray's default.
TRAINER_RANK_NICENESS = 0


def torch_compile_env() -> dict[str, str]:
    """TORCHDYNAMO_DISABLE as this process has it, else "1": on CPU megatron-core's torch.compile'd helpers
    are slow to compile and not needed (the service's Ray job and the CPU trainer ranks get it)."""
    return {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}


def trainer_rank_env(*, gpu: bool) -> dict[str, Any]:
    """The runtime_env of a trainer rank: niceness 0 (above); on CPU no torch.compile (torch_compile_env)."""
    env_vars = {"RAY_worker_niceness": str(TRAINER_RANK_NICENESS)}
    if not gpu:
        env_vars.update(torch_compile_env())
    return {"env_vars": env_vars}


def trainer_rank_options(rank: int, tp: int, placement_groups: list[Any] | None, *, cpus: float, gpus: float) -> dict[str, Any]:
    """Ray options of trainer rank `rank` (global rank = dp_rank * tp + tp_rank)."""
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0,
                               "runtime_env": trainer_rank_env(gpu=gpus > 0)}
    if placement_groups:
        dp_rank, tp_rank = divmod(rank, tp)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_groups[dp_rank], placement_group_bundle_index=tp_rank
        )
    return options


def start_train_workers(world_size: int, tp: int, placement_groups: list[Any] | None, *, cpus: float, gpus: float) -> list[Any]:
    """Create the (empty) TrainWorker actors of every rank; `TrainerGroup.start` sets them up."""
    from trainer.actor import EXPORT_GROUP, FAULT_GROUP, TrainWorker

    # Default group: max_concurrency 1 (Ray's default for a threaded actor), so collective calls run
    # one at a time in submission order. EXPORT_GROUP: one more thread, where wait_export waits for a
    # background write beside the train calls; FAULT_GROUP: one for tests' fault injection
    # (trainer/actor.py). Ray takes concurrency groups only here, not in .options().
    remote_cls = ray.remote(concurrency_groups={EXPORT_GROUP: 1, FAULT_GROUP: 1})(TrainWorker)
    return [remote_cls.options(**trainer_rank_options(r, tp, placement_groups, cpus=cpus, gpus=gpus)).remote()
            for r in range(world_size)]


def engine_launcher_options(job: JobConfig, engine_group: Any) -> dict[str, Any]:
    """Ray options of an engine's launcher: the whole bundle of the engine's placement group."""
    gpu = job.placement.accelerator == "gpu"
    return {
        "num_cpus": job.placement.engines.cpus,
        "num_gpus": job.placement.engines.tensor_parallel if gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=engine_group, placement_group_bundle_index=0),
        "max_restarts": 0,
    }


def start_engine_launcher(job: JobConfig, settings: ServiceSettings, index: int, engine_group: Any) -> Any:
    """The launcher of engine `index` in its placement group (it starts the engine when its `start` is called)."""
    from rollout.engines.engine_launcher import EngineLauncher

    return EngineLauncher.options(**engine_launcher_options(job, engine_group)).remote(
        index, job.engine_config(settings), job.base_model.path, log_dir=str(settings.state_dir / "engines"))


def start_rollout_worker(job: JobConfig, settings: ServiceSettings, launchers: list[Any]) -> Any:
    """The rollout worker actor on this (the coordinator's) node; it starts the engines through their
    `launchers` when its `start` is called, and routes to them wherever they run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rollout.worker_actor import RolloutWorker

    here = ray.get_runtime_context().get_node_id()
    return RolloutWorker.options(
        num_cpus=0,  # no reservation: it must fit on a head node that offers no CPUs (KubeRay's num-cpus: 0)
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        max_restarts=0,
    ).remote(job.engine_config(settings), job.rollout_config(settings), job.base_model.path,
             log_dir=str(settings.state_dir / "engines"), launchers=launchers)
