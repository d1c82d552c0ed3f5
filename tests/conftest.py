"""Shared fixtures. The tiny world is built once per machine (into .cache/tiny)."""

import os

import pytest

# Megatron-core compiles some functions with torch.compile; on CPU the first step
# then takes 3 to 21 s for a tiny model (FINDINGS.md). Tests don't need it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def tiny_world():
    from examples.tiny.build import ensure_tiny_world

    return ensure_tiny_world()
