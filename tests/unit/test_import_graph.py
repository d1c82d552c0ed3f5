"""The import graph of api/ service/ trainer/ rollout/, read from the source (AST; nothing is imported).

Rules (DESIGN.md "Processes", issue 12; folders by role, issue 43):
  * no import circles among the four packages (function-level imports count: a lazy import
    still ties two modules together);
  * `service` never imports `api` (the `lorafleet` entry point, api/cli/main.py, sits above both);
  * no trainer module (the rank's actor body trainer/actor.py included) imports ray, fastapi
    or sglang at module level, so the GPU tier imports the trainer without them;
  * no call is dispatched by a method-name string in service/ or api/ (`x.call("train")`,
    `getattr(handle, method)`): every remote call goes through a typed method;
  * every folder's modules import only what its `__init__.py` docstring allows: a paragraph
    `May import: a, b.c, d.` naming packages or modules (a name allows it and everything below
    it; remarks in parentheses are ignored; "nothing of the product" allows none). A module's own
    folder (and the folders inside it) is always allowed; a module answers to the nearest
    enclosing folder that states a rule.

`import_graph`, `cycles` and `floors` are also what the coordinator issue's measurements use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit

PACKAGES = ("api", "service", "trainer", "rollout")
CORE_FORBIDDEN = ("ray", "fastapi", "sglang")
# Calls whose first argument names the method to run: the dispatch wrappers issue 12 removed.
DISPATCHERS = {"call", "_call", "_all", "_rollout", "remote_call", "call_method"}
# Looked up by a name that is configuration, not a call between components: (file, source).
ALLOWED_DYNAMIC: set[tuple[str, str]] = set()  # tenant code named in a config resolves in rollout/tenant_code.py


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, current: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the current package
            base = current.rsplit(".", node.level)[0]
            mod = f"{base}.{node.module}" if node.module else base
        else:
            mod = node.module or ""
        # `from pkg import mod` imports pkg.mod when that is a module
        return [mod] + [f"{mod}.{a.name}" for a in node.names]
    return []


def module_files(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "_cpu_shims" in path.parts:  # stand-ins for sglang's missing CUDA modules, not our code
                continue
            out[module_name(path, root)] = path
    return out


def import_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES, *, module_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (anywhere in the file, or only at module level)."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = top_level_nodes(tree) if module_level_only else ast.walk(tree)
        deps = set()
        for node in nodes:
            names = [n for n in _imported(node, mod) if n in files and n != mod]
            if isinstance(node, ast.ImportFrom) and len(names) > 1:
                names = names[1:]  # `from pkg import mod`: the module, not the package's __init__
            deps.update(names)
        graph[mod] = deps
    return graph


def top_level_nodes(tree: ast.Module) -> list[ast.AST]:
    """Statements run at import: the module body, including inside if/try blocks, not inside def/class."""
    out: list[ast.AST] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return out


def external_imports_at_module_level(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {name.split(".")[0] for node in top_level_nodes(tree) for name in _imported(node, "") if name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]], package: str) -> int:
    """Import floors of `package`: the longest chain of its own modules importing each other
    (a module importing none of them is floor 1; a circle counts as one floor)."""
    inside = {m: {d for d in deps if d.split(".")[0] == package} for m, deps in graph.items() if m.split(".")[0] == package}
    comp_of = {m: m for m in inside}
    for comp in cycles(inside):
        for m in comp:
            comp_of[m] = comp[0]
    memo: dict[str, int] = {}

    def floor(m: str, seen: frozenset[str]) -> int:
        c = comp_of[m]
        if c in memo:
            return memo[c]
        members = [x for x in inside if comp_of[x] == c]
        deps = {comp_of[d] for x in members for d in inside[x]} - {c}
        memo[c] = 1 + max((floor(d, seen | {c}) for d in deps if d not in seen), default=0)
        return memo[c]

    return max((floor(m, frozenset()) for m in inside), default=0)


def string_dispatches(path: Path) -> list[str]:
    """`x.call("name", ...)`-style calls and `getattr(x, <not a literal>)` in one file, as 'line: source'."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        first = node.args[0] if node.args else None
        by_name = name in DISPATCHERS and isinstance(first, ast.Constant) and isinstance(first.value, str)
        dynamic_getattr = name == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant)
        if (by_name or dynamic_getattr) and (str(path.relative_to(REPO)), ast.get_source_segment(text, node)) not in ALLOWED_DYNAMIC:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


# --- the rules ------------------------------------------------------------------------------------


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_service_never_imports_api():
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[0] == "service"
                 for d in deps if d.split(".")[0] == "api")
    assert bad == [], "service/ must not import api/ (api/cli/main.py assembles the entry point above both)"


def test_trainer_imports_no_service_frameworks_at_module_level():
    bad = {}
    for mod, path in module_files(packages=("trainer",)).items():
        hit = external_imports_at_module_level(path) & set(CORE_FORBIDDEN)
        if hit:
            bad[mod] = sorted(hit)
    assert bad == {}


def test_trainer_imports_neither_rollout_nor_service():
    graph = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[0] == "trainer"
                 for d in deps if d.split(".")[0] in ("rollout", "service", "api"))
    assert bad == []


def test_no_string_dispatched_calls():
    paths = [*module_files(packages=("service", "api")).values(), REPO / "trainer" / "actor.py", REPO / "rollout" / "worker_actor.py"]
    found = [hit for path in paths for hit in string_dispatches(path)]
    assert found == [], "call methods through typed methods, not by name:\n" + "\n".join(found)


def folder_rules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[str, ...]]:
    """folder (dotted) -> what its modules may import, read from each `__init__.py` docstring's
    `May import:` paragraph (module doc). A folder without one has no entry."""
    rules: dict[str, tuple[str, ...]] = {}
    for pkg in packages:
        for init in sorted((root / pkg).rglob("__init__.py")):
            if "_cpu_shims" in init.parts:
                continue
            doc = ast.get_docstring(ast.parse(init.read_text(), str(init))) or ""
            para = next((p for p in doc.split("\n\n") if p.strip().startswith("May import:")), None)
            if para is None:
                continue
            text = " ".join(para.split())[len("May import:"):].strip().rstrip(".")
            while "(" in text:  # remarks in parentheses
                start = text.index("(")
                text = text[:start] + text[text.index(")", start) + 1:]
            names = tuple(n.strip() for n in text.split(",") if n.strip())
            rules[module_name(init, root)] = () if names and names[0].startswith("nothing") else names
    return rules


def folder_of(module: str, files: dict[str, Path]) -> str:
    path = files[module]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def folder_violations(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """'module -> dependency (folder F allows: ...)' for every import a folder's rule does not allow."""
    files = module_files(root, packages)
    graph = import_graph(root, packages)
    rules = folder_rules(root, packages)
    out = []
    for mod, deps in sorted(graph.items()):
        folder = folder_of(mod, files)
        ruled = folder
        while ruled not in rules and "." in ruled:
            ruled = ruled.rsplit(".", 1)[0]
        if ruled not in rules:
            continue
        allowed = rules[ruled]
        for dep in sorted(deps):
            if dep == folder or dep.startswith(folder + "."):
                continue
            if any(dep == a or dep.startswith(a + ".") for a in allowed):
                continue
            out.append(f"{mod} -> {dep} ({ruled} allows: {', '.join(allowed) or 'nothing'})")
    return out


def test_every_folder_states_its_rule():
    files = module_files()
    folders = {folder_of(m, files) for m in files}
    assert sorted(folders - set(folder_rules())) == []


def test_folders_import_only_what_they_allow():
    assert folder_violations() == []


# --- the checks can fail (planted violations in a scratch tree) ------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_planted_violations_are_found(tmp_path):
    root = _tree(tmp_path, {
        "service/__init__.py": "",
        "service/a.py": "from service.b import x\n",
        "service/b.py": "def f():\n    from service import a\n    from api.cli.client import C\n",
        "service/c.py": "import service.a\n",
        "service/d.py": "def g(h, m):\n    h.call('train', 1)\n    return getattr(h, m)\n",
        "api/__init__.py": "",
        "api/cli/client.py": "",
        "trainer/__init__.py": "",
        "trainer/core.py": "try:\n    import ray\nexcept ImportError:\n    pass\n",
    })
    graph = import_graph(root, ("service", "api", "trainer"))
    assert cycles(graph) == [["service.a", "service.b"]]
    assert "api.cli.client" in graph["service.b"]
    assert floors(graph, "service") == 2  # c -> {a, b}
    assert external_imports_at_module_level(root / "trainer" / "core.py") == {"ray"}
    global REPO
    saved, REPO = REPO, root
    try:
        assert len(string_dispatches(root / "service" / "d.py")) == 2
    finally:
        REPO = saved


def test_planted_folder_violation_is_found(tmp_path):
    root = _tree(tmp_path, {
        "trainer/__init__.py": '"""Top.\n\nMay import: trainer.\n"""\n',
        "trainer/kernels/__init__.py": '"""Kernels.\n\nMay import: trainer.platform (devices).\n"""\n',
        "trainer/kernels/gemm.py": "from trainer.platform.dev import x\nfrom trainer.kernels.other import y\n",
        "trainer/kernels/other.py": "def f():\n    from trainer.lora.layer import L\n",
        "trainer/platform/__init__.py": '"""Platform.\n\nMay import: nothing of the product.\n"""\n',
        "trainer/platform/dev.py": "import trainer.kernels.gemm\n",
        "trainer/lora/__init__.py": '"""LoRA.\n\nMay import: trainer.kernels.\n"""\n',
        "trainer/lora/layer.py": "from trainer.kernels import gemm\n",
    })
    assert folder_rules(root, ("trainer",))["trainer.kernels"] == ("trainer.platform",)
    assert folder_violations(root, ("trainer",)) == [
        "trainer.kernels.other -> trainer.lora.layer (trainer.kernels allows: trainer.platform)",
        "trainer.platform.dev -> trainer.kernels.gemm (trainer.platform allows: nothing)",
    ]
