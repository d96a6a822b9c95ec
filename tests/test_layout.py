"""The floor plan as docs/architecture.md draws it: the import graph has no cycle, the planner's solver reaches
no engine, scan or signal module, and every file the page names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cardfit"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """cardfit module -> the cardfit modules it imports anywhere in its text (inside functions too)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                named = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                found = named or ([base] if base in modules else [])
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names if a.name in modules]
            else:
                continue
            graph[name] |= {m for m in found if m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += graph[v]
    return seen


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_solver_reaches_no_engine_scan_or_signal():
    reached = reaches(import_graph(), "cardfit.solver")
    assert not {m for m in reached if m.startswith(("cardfit.engine", "cardfit.scan"))}, reached
    assert "cardfit.plan" not in reached


def test_a_signal_is_found_only_through_its_registry():
    """No module outside scan/ names a signal's module: the doors read the registry."""
    graph = import_graph()
    signal_modules = {m for m in graph if m.startswith("cardfit.scan.signals.") and not m.endswith((".base", ".sampling"))}
    for module, imported in graph.items():
        if not module.startswith("cardfit.scan"):
            assert not imported & signal_modules, (module, imported & signal_modules)


def test_every_file_the_architecture_page_names_exists():
    """Paths in backticks: under the repository when they start with cardfit/ or tests/, else under cardfit/."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    files = set(re.findall(r"`([\w/]+\.py)`", page)) | set(re.findall(r"(tests/test_\w+\.py)", page))
    folders = set(re.findall(r"`([\w/]+)/`", page)) - {"cardfit"}
    assert len(files) >= 30 and {"scan", "engine", "targets", "scan/signals"} <= folders
    where = [ROOT / f if f.startswith(("cardfit/", "tests/")) else PACKAGE / f for f in files]
    assert sorted(str(p) for p in where if not p.is_file()) == []
    assert sorted(f for f in folders if not (PACKAGE / f).is_dir()) == []
