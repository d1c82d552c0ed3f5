"""The GPU recipe (examples/gpu/job.yaml) is a valid job file whose placement fits its
stated hardware and the KubeRay worker group it is deployed on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.config.job import load_job
from service.errors import PlacementError
from service.fleet.placement import ClusterShape, plan_placement
from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO
RECIPE = ROOT / "examples" / "gpu" / "job.yaml"


@pytest.fixture(scope="module")
def job():
    return load_job(RECIPE)


def test_recipe_validates_with_two_or_more_rl_math_adapters(job):
    rl = [a for a in job.adapters if a.config.objective == "rl"]
    assert len(rl) >= 2
    assert {a.config.reward.name for a in rl} == {"math"}
    assert all(a.config.data.path.endswith(".parquet") and a.config.data.label_key == "answer" for a in rl)
    assert all(a.config.sampling.n_samples_per_prompt >= 2 for a in rl)
    assert len({a.config.learning_rate for a in rl}) == len(rl)  # a sweep, not copies
    assert Path(job.base_model.path).name.startswith("Qwen3")
    assert max(a.config.rank for a in job.adapters) <= job.slots.max_rank <= job.engines.max_lora_rank


def test_recipe_trainer_section_is_valid_trainer_config(job):
    from trainer.config import TrainerConfig

    cfg = TrainerConfig.model_validate({"base_model_path": job.base_model.path, **dict(job.trainer)})
    assert cfg.dtype == "bfloat16"


def test_recipe_uses_every_gpu_of_one_8_gpu_node(job):
    plan = plan_placement(job.placement, ClusterShape.uniform(1, 8))
    assert job.placement.total_gpus == 8
    assert sorted((e.node, g) for e in plan.engines for g in e.gpus) == [(0, g) for g in range(4, 8)]
    # one SGLang engine per GPU group: the engines section agrees with the placement
    assert (job.engines.num_engines, job.engines.tp) == (job.placement.engines.count, job.placement.engines.tensor_parallel)


def test_recipe_is_refused_on_a_smaller_node(job):
    with pytest.raises(PlacementError, match=r"total 8 > cluster 1 node x 4 GPUs = 4"):
        plan_placement(job.placement, ClusterShape.uniform(1, 4))


@pytest.mark.parametrize("manifest", ["rayjob.yaml", "raycluster-service.yaml"])
def test_recipe_fits_the_kuberay_worker_group(job, manifest):
    (doc,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / manifest).read_text()) if d and d["kind"].startswith("Ray")]
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    (group,) = spec["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    shape = ClusterShape.uniform(group["replicas"], int(limits["nvidia.com/gpu"]))
    plan_placement(job.placement, shape)  # raises with the arithmetic if it does not fit
    p = job.placement
    cpus = p.engines.count * p.engines.cpus + p.trainer.world_size * p.trainer.cpus_per_rank
    assert cpus <= group["replicas"] * float(limits["cpu"])


def test_readme_states_the_hardware():
    readme = (ROOT / "examples" / "gpu" / "README.md").read_text()
    assert "One node with 8 NVIDIA GPUs of 80 GB or more" in readme
    assert "| 4 | SGLang engines" in readme and "| 4 | Megatron trainer: TP 2 x DP 2" in readme
