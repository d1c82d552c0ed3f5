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
