"""No import cycles inside elasticflow/: data flows one way (CLI -> config -> trainer -> lower layers).

Every ``import``/``from ... import`` in every module counts, at any nesting level: a lazy import inside a
function only postpones a cycle, it does not remove it. Not counted: imports under ``if TYPE_CHECKING:``
(never executed) and importlib calls (not statements). Importing a submodule is not counted as an edge
to its parent packages: Python has initialized those already, and counting them would make every
``__init__`` that re-exports a submodule look like a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]

Graph = Dict[str, Dict[str, int]]  # module -> {imported module: line of the first such import}


def module_name(path: Path, root: Path) -> str:
    """'pkg.sub.mod' for root/pkg/sub/mod.py, 'pkg.sub' for root/pkg/sub/__init__.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every Import/ImportFrom node, at any depth, except in the body of ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)  # an else branch does run
            continue
        todo.extend(ast.iter_child_nodes(node))


def _targets(node: ast.stmt, name: str, is_package: bool, modules: Set[str]) -> Iterator[str]:
    """The modules of ``modules`` that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in modules:
                yield alias.name
        return
    if node.level:
        package = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    for alias in node.names:
        # `from pkg import sub` imports the submodule when there is one; otherwise a name of pkg's __init__.
        candidate = f"{base}.{alias.name}"
        if candidate in modules:
            yield candidate
        elif base in modules:
            yield base


def import_graph(root: Path, package: str) -> Graph:
    """The edges between the modules of ``root/package`` (each .py parsed with ast, nothing imported)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: Graph = {name: {} for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", set(files)):
                if target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: Graph) -> List[List[str]]:
    """Tarjan's components with more than one module, each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: Graph, start: str, goal: str, within: Set[str]) -> Optional[List[str]]:
    """A shortest import chain start -> ... -> goal through modules of ``within`` (breadth first)."""
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in within and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        if goal in came_from:
            chain = [goal]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        frontier = nxt
    return None


def cycles(graph: Graph) -> List[List[str]]:
    """Cycles as chains [a, b, ..., a] that together use every import inside every component."""
    out = []
    for component in strongly_connected(graph):
        members = set(component)
        covered: Set[Tuple[str, str]] = set()
        for a in component:
            for b in sorted(graph[a]):
                if b in members and (a, b) not in covered:
                    chain = [a] + _path(graph, b, a, members)
                    covered.update(zip(chain, chain[1:]))
                    out.append(chain)
    return out


def describe(graph: Graph, chain: List[str]) -> str:
    """'a -> b -> a' and where each import is."""
    where = ", ".join(f"{a} imports {b} at line {graph[a][b]}" for a, b in zip(chain, chain[1:]))
    return f"{' -> '.join(chain)}\n    ({where})"


def test_elasticflow_has_no_import_cycles():
    graph = import_graph(REPO, "elasticflow")
    assert len(graph) > 20 and graph["elasticflow.cli"], "the walker found no modules or no imports"
    found = cycles(graph)
    assert not found, ("import cycles in elasticflow/ (move the shared code down a layer, into a module both "
                       "can import):\n" + "\n".join(describe(graph, c) for c in found))


# ---------------------------------------------------------------- the walker itself can fail
def _package(tmp_path: Path, files: Dict[str, str]) -> Graph:
    for rel, source in {"pkg/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    return import_graph(tmp_path, "pkg")


def test_a_lazy_import_that_closes_a_cycle_is_found(tmp_path):
    graph = _package(tmp_path, {"pkg/a.py": "from . import b\n",
                                "pkg/b.py": "def f():\n    from .a import thing\n    return thing\n"})
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(graph, cycles(graph)[0]).startswith("pkg.a -> pkg.b -> pkg.a")


def test_every_import_of_a_longer_cycle_is_shown(tmp_path):
    graph = _package(tmp_path, {"pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import c\n",
                                "pkg/c.py": "from .sub.d import x\nfrom . import a\n",
                                "pkg/sub/__init__.py": "", "pkg/sub/d.py": "from .. import b\n"})
    found = cycles(graph)
    assert ["pkg.a", "pkg.b", "pkg.c", "pkg.a"] in found
    assert {(a, b) for c in found for a, b in zip(c, c[1:])} >= {("pkg.c", "pkg.sub.d"), ("pkg.sub.d", "pkg.b")}


@pytest.mark.parametrize("b_source", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
    "import typing\nif typing.TYPE_CHECKING:\n    from . import a\n",
    "import importlib\na = importlib.import_module('pkg.a')\n",
    "from . import helper\n",  # a name of pkg/__init__.py, not the module a
])
def test_what_does_not_count_as_an_import(tmp_path, b_source):
    graph = _package(tmp_path, {"pkg/a.py": "from . import b\n", "pkg/b.py": b_source})
    assert cycles(graph) == []


def test_the_else_of_type_checking_counts(tmp_path):
    graph = _package(tmp_path, {"pkg/a.py": "from . import b\n",
                                "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\n"
                                            "else:\n    from . import a\n"})
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
