"""deploy/record_top_levels.py writes, for a distribution without `top_level.txt`, exactly what
importlib.metadata infers for it: checked against the standard library's own inference, for
distributions of this interpreter, and on a distribution made here (a dist-info folder read directly)."""

import importlib.metadata as md
import runpy

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

RECORD = runpy.run_path(str(REPO / "deploy" / "record_top_levels.py"))


def test_the_inference_is_the_standard_librarys_for_installed_distributions():
    dists = sorted(md.distributions(), key=lambda d: d.metadata["Name"].lower())
    assert len(dists) > 50  # the venv's stack
    for dist in dists[::8]:  # every eighth (each reads and stats its whole RECORD)
        assert RECORD["_inferred"](dist) == sorted(set(md._top_level_inferred(dist))), dist.metadata["Name"]


def test_a_distribution_without_top_level_gets_its_inferred_names(tmp_path):
    (tmp_path / "pkg_a").mkdir()
    (tmp_path / "pkg_a" / "__init__.py").write_text("")
    (tmp_path / "mod_b.py").write_text("")
    info = tmp_path / "demo_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-dist\nVersion: 1.0\n")
    # RECORD lists a package, a module, a missing file (skipped, as importlib skips it) and a .pth (not importable)
    (info / "RECORD").write_text("pkg_a/__init__.py,,\nmod_b.py,,\ngone_c.py,,\ndemo.pth,,\ndemo_dist-1.0.dist-info/METADATA,,\n")
    dist = md.PathDistribution(info)
    assert RECORD["_inferred"](dist) == ["mod_b", "pkg_a"] == sorted(md._top_level_inferred(dist))
