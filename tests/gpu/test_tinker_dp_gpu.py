"""GPU tier, fp32 on two GPUs over NCCL: Tinker models under data parallelism 2 (issue 46 item 1).

The scenario of tests/integration/test_tinker_dp.py, proven there on two gloo ranks on the CPU, run
on GPUs: three steps of two scheduler rounds (``RoundRunner.run_round``), Tinker models on slots 0
and 1 (several forward_backward calls of six losses, a forward call, each model's optim_step with
its own AdamW parameters) beside two dataset runs, datum counts odd so the ranks' shares are uneven.

* dp=1 on one GPU (this process) against dp=2, one process per GPU (NCCL, ``NCCL_NVLS_ENABLE=0``):
  every call's ``loss:sum`` and outputs, every optim_step's gradient norm, the runs' results, each
  slot's weights and moments after every step; both ranks bit-identical; the datums shared out;
* dp=2 against HF transformers + peft + torch.optim.AdamW on the CPU (test_tinker_ops.py
  ``reference_run``, Tinker's published losses): the Tinker slots' weights and every call's outputs.

The integration module's assertions are called as they are (one home of the scenario), at its
tolerances: 3e-5 relative dp=2 vs dp=1, 5e-5 against the reference. They hold on CUDA in fp32
because fp32 there takes the exact kernels (TF32 off: tests/gpu/test_fp32_gpu.py checks it), so each
difference is a reduction order; fp32 mixed vs alone on one H200 measured 2.6e-6 to 1.1e-5 and TP=2
against one GPU 1.16e-5 (tests/gpu/test_fp32_gpu.py). NCCL sums a slot's gradient parts in its own
order and gives every rank the same sum (the both-ranks-identical check needs that).

Skipped with fewer than two GPUs. ``LORAFLEET_GPU_TESTS_ON_CPU=1`` runs this module on the CPU (two
gloo processes, the CPU's fp32): the integration test's run, through this module's code, so the test
itself is checked where no GPU is.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.integration import test_tinker_dp as scenario
from tests.integration.test_tinker_dp import work  # noqa: F401 - the scenario's rounds, a fixture of this module too

ON_CPU = os.environ.get("LORAFLEET_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2 and not ON_CPU, reason="needs 2 GPUs")]


def _to_cpu(obj):
    """Every tensor in a run's nested dicts, lists and tuples on the CPU (the comparisons meet there)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _state_devices(run: dict) -> set[str]:
    return {str(t.device) for state in run["states"] for tensors in state.values() for t in tensors.values()}


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    t = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                       micro_batch_tokens=scenario.MICRO_BATCH_TOKENS, dtype="float32"))
    assert (t.device.type, t.base.dtype) == ("cpu" if ON_CPU else "cuda", torch.float32)
    return t


@pytest.fixture(scope="module")
def one_rank(trainer, work, tmp_path_factory):  # noqa: F811 - work: the imported fixture
    init = tmp_path_factory.mktemp("tinker-dp-gpu-init")
    run = scenario.run_steps(trainer, work, init_dir=str(init))
    assert _state_devices(run) == {str(trainer.device)}
    return dict(run=_to_cpu(run), init=init)


@pytest.fixture(scope="module")
def two_ranks(trainer, work, tmp_path_factory):  # noqa: F811
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the spawned ranks inherit it
    out = tmp_path_factory.mktemp("tinker-dp2-gpu") / "run"
    cfg_kwargs = trainer.config.model_dump() | {"dp": 2}
    mp.spawn(scenario._dp_worker, args=(free_loopback_port(), cfg_kwargs, work, str(out)), nprocs=2, join=True)
    runs = [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]
    # each rank's state was on its own GPU (the trainer's process group is NCCL there), or on the CPU (gloo)
    assert [_state_devices(r) for r in runs] == ([{"cpu"}, {"cpu"}] if ON_CPU else [{"cuda:0"}, {"cuda:1"}])
    return [_to_cpu(r) for r in runs]


def test_tinker_dp2_over_nccl_answers_and_trains_as_one_gpu(one_rank, two_ranks):
    scenario.test_two_ranks_answer_and_train_as_one(one_rank, two_ranks)


def test_tinker_dp2_over_nccl_matches_hf_peft_adamw(one_rank, two_ranks, work, hf_model):  # noqa: F811
    scenario.test_two_ranks_match_hf_peft_adamw(one_rank, two_ranks, work, hf_model)
