"""GPU tier, fp32: the mixed step equals each adapter alone on CUDA as on the CPU, and so do
tensor parallel 2 and data parallel 2 over NCCL on two GPUs.

The proof scenario of tests/integration/test_trainer_equivalence.py in fp32 on the device,
at the CPU's tolerance for two fp32 reduction orders (PADDED_TOL there, 3e-5): cuBLAS picks its
GEMM kernels by shape, so a batch of four adapters and one adapter's batch reduce in another
order. Measured on one H200 (benchmarks/fp32_deviation.py, 2026-12-04, every suspect below
switched off in turn, and all at once): 2.6e-6 to 1.1e-5, the largest always a second moment
of a near-zero gradient (slot 0's layer-3 linear_proj: max 4.2e-10, off by 4.6e-15); the
planted routing bugs give about 1e-1. fp32 on CUDA takes the exact kernels: TF32
is off (PyTorch's default; checked below), Triton's tl.dot runs with input_precision
"ieee" for fp32 (trainer/kernels/triton_lora.py), and packed attention goes to the per-document
SDPA path because flash/varlen kernels take 16-bit inputs only (fused_attention.py).
Where this fails, benchmarks/fp32_deviation.py measures which kernel is responsible (one
run, every suspect switched off in turn).

Multi-GPU tests spawn one process per GPU (NCCL, ``NCCL_NVLS_ENABLE=0``) and are skipped
with fewer than two GPUs.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _scenario_module():
    path = Path(__file__).resolve().parents[1] / "integration" / "test_trainer_equivalence.py"
    spec = importlib.util.spec_from_file_location("trainer_equivalence_scenario", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scenario():
    return _scenario_module()


def _config(scenario, tiny_world, **overrides):
    from trainer.config import TrainerConfig

    return TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                         micro_batch_tokens=scenario.MICRO_BATCH_TOKENS, dtype="float32", **overrides)


@pytest.fixture(scope="module")
def trainer(tiny_world, scenario):
    from trainer.core import MultiLoraTrainer

    t = MultiLoraTrainer(_config(scenario, tiny_world))
    assert t.device.type == "cuda" and t.base.dtype == torch.float32
    return t


@pytest.fixture(scope="module")
def batches(trainer, scenario):
    return scenario.make_batches(trainer)


@pytest.fixture(scope="module")
def tp1_mixed_run(trainer, scenario, batches):
    return scenario.run_scenario(trainer, scenario.make_hypers(scenario.OBJECTIVES["mixed"]), batches)


def test_fp32_runs_without_tf32(trainer):
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("objectives", ["rl", "sft"])
def test_fp32_mixed_step_equals_each_adapter_alone_on_cuda(trainer, batches, scenario, objectives):
    run = scenario.run_scenario(trainer, scenario.make_hypers(scenario.OBJECTIVES[objectives]), batches)
    worst = scenario.assert_equivalent(run["mixed"], run["alone"], tol=scenario.PADDED_TOL)
    print(f"fp32 CUDA {objectives}: worst relative error {worst:.2e}")


def test_fp32_mixed_objectives_on_cuda(tp1_mixed_run, scenario):
    worst = scenario.assert_equivalent(tp1_mixed_run["mixed"], tp1_mixed_run["alone"], tol=scenario.PADDED_TOL)
    print(f"fp32 CUDA mixed objectives: worst relative error {worst:.2e}")


def test_fp32_first_step_with_tiny_eps_on_cuda(trainer, batches, scenario):
    run = scenario.run_scenario(trainer, scenario.make_hypers(scenario.OBJECTIVES["mixed"], eps=scenario.DEFAULT_ADAM),
                                batches[:1])
    worst = scenario.assert_equivalent(run["mixed"], run["alone"], kinds=("exp_avg", "exp_avg_sq", "grad"))
    print(f"fp32 CUDA first step: worst relative error {worst:.2e}")


def _parallel_worker(rank, port, cfg_kwargs, hypers, batches, out_path):
    import torch.distributed as dist

    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    scenario = _scenario_module()
    trainer = MultiLoraTrainer(TrainerConfig(**cfg_kwargs), rank=rank, master_port=port)
    result = scenario.run_scenario(trainer, hypers, batches)
    if rank == 0:
        torch.save(result, out_path)
    dist.barrier()
    dist.destroy_process_group()


ACROSS_LAYOUTS_TOL = 3e-5


@two_gpus
@pytest.mark.parametrize("layout", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_fp32_two_gpus_over_nccl(trainer, batches, scenario, tp1_mixed_run, tmp_path, layout):
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cfg_kwargs = trainer.config.model_dump() | layout
    out = tmp_path / "run.pt"
    mp.spawn(_parallel_worker, args=(free_loopback_port(), cfg_kwargs, scenario.make_hypers(scenario.OBJECTIVES["mixed"]),
                                     batches, str(out)), nprocs=2, join=True)
    run = torch.load(out, weights_only=False)
    inside = scenario.assert_equivalent(run["mixed"], run["alone"])
    # Same result as one GPU, to a looser bound than mixed vs alone inside one layout: TP=2 sums
    # the row-parallel halves over NCCL (and DP=2 the gradient halves) in another order than
    # the single GEMM of TP=1, and Adam's moments carry that fp32 rounding on. Measured on two
    # H200s (2026-11-30): TP=2 vs one GPU 1.16e-5 (exp_avg, slot 0), inside TP=2 5.1e-6.
    across = scenario.assert_equivalent(run["mixed"], tp1_mixed_run["mixed"], tol=ACROSS_LAYOUTS_TOL)
    print(f"fp32 {layout}: mixed vs alone {inside:.2e}, vs one GPU {across:.2e}")
