"""docs/tinker.md's complete example runs as written (the SDK against the Tinker routes on
loopback) and shows what the page says: losses fall and calls were coalesced."""

from __future__ import annotations

import re

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.integration

PAGE = REPO / "docs" / "tinker.md"


def test_docs_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(blocks[0], str(PAGE), "exec"), namespace)  # noqa: S102 - our own page
    losses, metrics = namespace["losses"], namespace["metrics"]
    for tenant, values in losses.items():
        assert len(values) == 10 and values[-1] < 0.9 * values[0], (tenant, values)
    assert metrics["forward_backward_calls"] == 20 and metrics["mixed_steps"] < 20, metrics
    out = capsys.readouterr().out
    assert "checkpoint: tinker://" in out and "coalescing:" in out
