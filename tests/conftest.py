"""Shared fixtures. The tiny world is built once per machine (into .cache/tiny)."""

import os

import pytest

# Megatron-core compiles some functions with torch.compile; on CPU the first step
# then takes 3 to 21 s for a tiny model (FINDINGS.md). Tests don't need it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def pytest_configure(config):
    # Tiny models gain nothing from intra-op threads, and on the 2-core CI machine
    # a test's threads compete with the SGLang server it talks to: HF generate on
    # the tiny model took 10.3 s with 2 threads against 0.37 s with 1 (measured).
    import torch

    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # The trainer's Triton kernels run in Triton's interpreter on the CPU (same kernel
        # source as on the GPU). Triton reads this when it is imported, so set it first.
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device():
    """Where the trainer's Triton kernels are tested: compiled on a GPU, else run by Triton's
    interpreter on the CPU (switched on above). Triton is in the lock: no skip without it."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tiny_world():
    from examples.tiny.build import ensure_tiny_world

    return ensure_tiny_world()


@pytest.fixture(scope="module")
def hf_model(tiny_world):
    """The tiny world's model in HF transformers, fp32, eval mode: the independent reference of the
    trainer tests (one per module, so no module sees another's use of it)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_world / "model", dtype=torch.float32).eval()


# The longest test files first (seconds each took alone on the 2-core machine, full tier of
# 2026-12-06): the tier runs two files at a time (pyproject.toml: -n 2 --dist loadfile
# --no-loadscope-reorder), and a long file started last would run alone at the end while the other
# worker has nothing left. The rest keep their collected order (integration, then unit).
LONGEST_FIRST = (
    "tests/integration/test_cookbook_recipes.py",  # 444-520 s
    "tests/integration/test_tinker_restart.py",  # 304
    "tests/integration/test_multinode_s3.py",  # 186
    "tests/integration/test_multinode.py",  # 159
    "tests/integration/test_service_fleet.py",  # 155
    "tests/integration/test_rollout_sglang.py",  # 131
    "tests/integration/test_moe_trainer.py",  # 131
    "tests/integration/test_service_scale.py",  # 112
    "tests/integration/test_service_main_job.py",  # 95
    "tests/integration/test_tinker_fleet_64.py",  # 75
)


def pytest_collection_modifyitems(config, items):
    missing = [p for p in LONGEST_FIRST if not (config.rootpath / p).is_file()]
    if missing:  # a renamed or removed file: the list must follow it
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: each file's order kept
