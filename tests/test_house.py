"""The package's shape: no import circles (function-level imports included), imports that point
one way between the sub-packages, and no module over ~400 lines without a stated reason.

The imports are read from the source with ``ast``, every ``import`` statement wherever it stands
(module level, inside functions, under ``TYPE_CHECKING``), so a circle cannot hide in a deferred
import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import turbospark

PACKAGE = Path(turbospark.__file__).parent
MAX_LINES = 400

# Modules allowed over MAX_LINES, each with its reason. Keep this list short.
OVER_THE_LIMIT: Mapping[str, str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: Mapping[str, object]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        # ``from package import module`` imports that module; ``from module import name`` the module
        candidates = [
            f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
            for alias in node.names
        ]
    for candidate in candidates:
        while candidate and candidate not in known:  # an attribute path: its module
            candidate = candidate.rpartition(".")[0]
        if candidate.startswith("turbospark"):
            yield candidate


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (and, for a dotted import, the packages on
    the way, whose ``__init__`` runs first)."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, is_package, node, known):
                    parts = target.split(".")
                    edges.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
        edges.discard(name)
        # a module's own parent packages are initialised before it, not imported by it
        edges -= {".".join(name.split(".")[:k]) for k in range(1, len(name.split(".")))}
        graph[name] = edges
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _area(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "turbospark"


def area_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    areas: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = areas.setdefault(_area(module), set())
        edges.update(_area(t) for t in targets if _area(t) not in (_area(module), "turbospark"))
    return areas


def test_the_circle_finder_finds_a_deferred_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_counts_function_level_imports() -> None:
    graph = import_graph()
    # cli/main.py imports the server inside main(), after the BLAS re-exec
    assert "turbospark.server" in graph["turbospark.cli.main"]


def test_no_module_import_circles() -> None:
    assert circles(import_graph()) == []


def test_sub_packages_import_one_way() -> None:
    """Between sub-packages (routes, web, actors, model, store, ...) imports point one way:
    no two areas import each other, however indirectly."""
    assert circles(area_graph(import_graph())) == []


def test_package_inits_import_nothing_of_their_own() -> None:
    """A sub-package's ``__init__`` is its docstring: importing one module of it never drags in
    the others (which is how package-level circles hide)."""
    for name, (path, is_package) in _modules().items():
        if is_package and name != "turbospark":
            tree = ast.parse(path.read_text(encoding="utf-8"))
            assert ast.get_docstring(tree), f"{name} needs a docstring saying what it owns"
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not imports, f"{name}/__init__.py imports"


def test_no_module_over_the_limit() -> None:
    too_long = {}
    for name, (path, _) in _modules().items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES and name not in OVER_THE_LIMIT:
            too_long[name] = lines
    assert too_long == {}
    stale = [name for name in OVER_THE_LIMIT if name not in _modules()]
    assert stale == []
