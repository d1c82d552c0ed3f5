"""The hand-written docs stay true to the code: lifecycle, names, metrics, settings, links."""

from __future__ import annotations

import re

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

ROOT = REPO
DOCS = ROOT / "docs"
CONCEPTS = (DOCS / "concepts.md").read_text()
OPERATIONS = (DOCS / "operations.md").read_text()
# Pages whose links and settings are checked (generated references included).
PAGES = sorted(DOCS.rglob("*.md")) + [ROOT / "deploy" / "README.md", ROOT / "examples" / "gpu" / "README.md"]


def table_after(text: str, header: str) -> list[list[str]]:
    """Rows (cells stripped of backticks) of the first Markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|")])
    return rows


def test_lifecycle_states_and_transitions_match_the_registry():
    from service.registry.registry import LEGAL_TRANSITIONS, LIVE_STATES, AdapterState

    states = table_after(CONCEPTS, "| state | meaning | holds a slot |")
    assert [r[0] for r in states] == [s.value for s in AdapterState]
    assert {r[0]: r[2] == "yes" for r in states} == {s.value: s in LIVE_STATES for s in AdapterState}
    transitions = table_after(CONCEPTS, "| from | to |")
    documented = {r[0]: set() if r[1] == "(final)" else {t.strip() for t in r[1].split(",")} for r in transitions}
    assert documented == {s.value: {t.value for t in targets} for s, targets in LEGAL_TRANSITIONS.items()}


def test_adapter_name_rule_matches_the_code():
    from rollout.config import ADAPTER_NAME_PATTERN

    assert f"(pattern `{ADAPTER_NAME_PATTERN}`)" in CONCEPTS


def test_metrics_table_lists_exactly_what_the_control_plane_exports():
    source = (ROOT / "api" / "metrics.py").read_text() + (ROOT / "api" / "tinker" / "metrics.py").read_text()  # + Tinker gauges
    exported = set(re.findall(r'"(lorafleet_[a-z_]+)"', source))
    documented = {r[0] for r in table_after(OPERATIONS, "| metric | labels | meaning |")}
    assert documented == exported, f"only in docs: {documented - exported}; only in code: {exported - documented}"


def test_every_lorafleet_environment_variable_named_in_docs_and_deploy_exists():
    from service.config.settings import ServiceSettings

    known = {f"LORAFLEET_{name.upper()}" for name in ServiceSettings.model_fields}
    # and the switches the GPU tier reads (LORAFLEET_GPU_TESTS_ON_CPU, LORAFLEET_GPU_DUMP): read by tests, not settings
    known |= {m for path in (ROOT / "tests").rglob("*.py")
              for m in re.findall(r"environ(?:\.get\(|\[)\"(LORAFLEET_[A-Z_]+)\"", path.read_text())}
    files = PAGES + sorted((ROOT / "deploy").rglob("*.yaml")) + [ROOT / "deploy" / "Dockerfile"]
    for path in files:
        for var in set(re.findall(r"\bLORAFLEET_[A-Z_]+\b", path.read_text())):
            assert var in known, f"{path.relative_to(ROOT)} names {var}, which is no setting; known: {sorted(known)}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-'."""
    return {
        re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", m.group(1).strip().lower()))
        for m in re.finditer(r"^#+ (.+)$", text, re.M)
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        assert dest.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), f"{page.relative_to(ROOT)} links to missing anchor {target}"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / "environments.md").read_text(), re.S)


def test_the_docs_environment_is_under_50_lines_and_works(monkeypatch):
    """docs/environments.md's environment and rollout function, run as written: the environment
    resolves as one (import roots and all), calls its tool from the text and rewards the answer."""
    import sys
    import types

    from rollout.config import RolloutSpec
    from rollout.data import PromptRow
    from rollout.environment import Action
    from rollout.rollouts import load_rollout

    env_code, fn_code = _doc_blocks()
    assert len(env_code.splitlines()) < 50
    for name, code in (("docs_envs.calc", env_code), ("docs_envs.fn", fn_code)):
        module = types.ModuleType(name)
        exec(compile(code, name, "exec"), module.__dict__)  # noqa: S102 - the page's own code
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "docs_envs", types.ModuleType("docs_envs"))
    assert load_rollout(RolloutSpec(name="docs_envs.calc:Calculator", kwargs={"max_calls": 2}), ["docs_envs"]).kind == "environment"
    assert load_rollout(RolloutSpec(name="docs_envs.fn:self_check"), ["docs_envs"]).kind == "function"
    env = sys.modules["docs_envs.calc"].Calculator(max_calls=1)
    assert env.reset(PromptRow(index=0, epoch=0, prompt="12*7?", prompt_text="12*7?", input_ids=[1], label=84)) is None
    first = env.step(Action("let me see: calc(12*7)", (1,), "stop", 1))
    assert first.observation == "\n<|tool|>84\n<|assistant|>" and not first.done
    assert env.step(Action("calc(1+1)", (1,), "stop", 2)).done  # no calls left: that was the answer (wrong)
    env.reset(PromptRow(index=0, epoch=0, prompt="", prompt_text="", input_ids=[1], label=84))
    assert env.step(Action("it is 84", (1,), "stop", 1)).reward == 1.0
