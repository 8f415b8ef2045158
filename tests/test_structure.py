"""The import structure: dependencies point one way. Every import of a module of
``moe_service`` or ``pipeline`` counts, wherever it is written (module level, inside a
function, under ``TYPE_CHECKING``), and importing ``a.b.c`` counts as importing the packages
``a`` and ``a.b`` too (their ``__init__`` runs and imports what it imports). A module's own
enclosing packages are not counted as its imports (Python has already run them). In that
graph no module may reach itself."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("moe_service", "pipeline")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of PACKAGES."""
    out: dict[str, tuple[Path, bool]] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``from a.b import f`` names
    a.b; ``from a import b`` may name the module a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, (path, is_pkg) in modules.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                dep = _resolve(name, modules)
                if dep is None or dep == mod:
                    continue
                parts = dep.split(".")
                for i in range(1, len(parts) + 1):
                    anc = ".".join(parts[:i])
                    if anc in modules and anc != mod and not mod.startswith(anc + "."):
                        graph[mod].add(anc)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted; [] when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _path_in(comp: list[str], graph: dict[str, set[str]]) -> str:
    """One cycle through the component, as 'a -> b -> ... -> a', for the failure message."""
    members = set(comp)
    start = comp[0]
    seen = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while seen[path[-1]] is not None:
                        path.append(seen[path[-1]])
                    return " -> ".join([start] + path[::-1][1:] + [start]) if len(path) > 1 else f"{start} -> {start}"
                if w not in seen:
                    seen[w] = v
                    nxt.append(w)
        frontier = nxt
    return ", ".join(comp)


def test_the_walk_sees_function_local_and_type_checking_imports() -> None:
    graph = import_graph()
    # function-local: pipeline.engine imports the KV plan inside build_engine
    assert "moe_service.engine.kv" in graph["pipeline.engine"]
    # TYPE_CHECKING: the context names the stages' products for the type checker only
    assert "pipeline.products" in graph["pipeline.context"]
    # a submodule import counts its packages: moe_service.engine's __init__ runs first
    assert "moe_service.engine" in graph["pipeline.engine"]


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _path_in(["a", "b", "c"], graph) == "a -> b -> c -> a"


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_path_in(c, graph) for c in found)


ENGINE_MODULE_MAX_LINES = 1000


def test_no_engine_module_over_1000_lines() -> None:
    """No module under moe_service/engine/ is longer than ENGINE_MODULE_MAX_LINES lines: a
    module that grows past it becomes a package with one module per concern (as quant/ and
    attention/)."""
    over = []
    for path in sorted((REPO / "moe_service" / "engine").rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > ENGINE_MODULE_MAX_LINES:
            over.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not over, f"modules over {ENGINE_MODULE_MAX_LINES} lines:\n" + "\n".join(over)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_file_facts_sit_below_the_engine() -> None:
    """The block-format declarations (moe_service/formats.py) and the GGUF catalog that reads
    them (gguf_model.py) reach nothing of moe_service.engine: the kernels import the
    declarations, never the other way round."""
    graph = import_graph()
    for mod in ("moe_service.formats", "moe_service.gguf_model"):
        up = sorted(m for m in _reach(graph, mod) if m == "moe_service.engine" or m.startswith("moe_service.engine."))
        assert not up, f"{mod} reaches {', '.join(up)}"
