"""Imports inside elasticflow/ flow one way: no import cycles, and nothing imports a higher layer.

Every ``import``/``from ... import`` in every module counts, at any nesting level: a lazy import inside a
function only postpones a cycle, it does not remove it. Not counted: imports under ``if TYPE_CHECKING:``
(never executed) and importlib calls (not statements). Importing a submodule is not counted as an edge
to its parent packages: Python has initialized those already, and counting them would make every
``__init__`` that re-exports a submodule look like a cycle.

The layers (``LAYERS``, lowest first; STYLE.md's "Layers") are declared by folder: each layer is one or more
folders of elasticflow/ (``"data.*"``: data/ and everything under it) and, for the public surface and the
loop, a few modules at the package root. A module may import its own layer and the ones below, never one
above (``test_imports_point_down_the_layers``); the cycle test keeps each layer acyclic inside. A new module
goes into the folder of its layer, so it is placed by where it lives; the root holds at most
``MAX_ROOT_MODULES``. docs/architecture.md's layer table is checked against ``LAYERS``
(``test_the_architecture_page_shows_the_declared_layers``), so it cannot drift.

A layer may be divided into rooms (``ROOMS``: distributed/'s store, comm, membership and agent), ordered the same
way: a room imports its own and the rooms below it (``test_imports_point_down_the_rooms``), and docs/architecture.md
shows them. A cycle through ``if TYPE_CHECKING:`` imports counts too (``test_no_cycle_even_through_annotations``):
a part typed with its owner's class still calls up, so the owner passes the part what it needs instead.
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


def _imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.stmt]:
    """Every Import/ImportFrom node, at any depth, except in the body of ``if TYPE_CHECKING:`` (unless
    ``type_checking``)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
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


def import_graph(root: Path, package: str, type_checking: bool = False) -> Graph:
    """The edges between the modules of ``root/package`` (each .py parsed with ast, nothing imported);
    ``type_checking``: the imports under ``if TYPE_CHECKING:`` count too."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: Graph = {name: {} for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree, type_checking):
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


def test_no_cycle_even_through_annotations():
    """A part that imports its owner only to annotate it (``if TYPE_CHECKING: from .agent import Agent``) still
    reaches into the owner at run time; the owner hands it the state and callables it needs instead."""
    graph = import_graph(REPO, "elasticflow", type_checking=True)
    found = cycles(graph)
    assert not found, ("import cycles in elasticflow/ through `if TYPE_CHECKING:` imports (pass the part what it "
                       "needs instead of its owner):\n" + "\n".join(describe(graph, c) for c in found))


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


def test_type_checking_imports_count_when_asked(tmp_path):
    _package(tmp_path, {"pkg/a.py": "from . import b\n",
                        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"})
    assert cycles(import_graph(tmp_path, "pkg", type_checking=True)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_the_else_of_type_checking_counts(tmp_path):
    graph = _package(tmp_path, {"pkg/a.py": "from . import b\n",
                                "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\n"
                                            "else:\n    from . import a\n"})
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


# ---------------------------------------------------------------- layers: imports point down only
# Lowest first: (layer, what it holds, modules). Names are relative to elasticflow/; "pkg.*" is the package
# and everything under it; "__init__" is elasticflow/__init__.py itself (the public names).
LAYERS: List[Tuple[str, str, Tuple[str, ...]]] = [
    ("leaf", "helpers and names that import nothing of elasticflow above them",
     ("errors", "_util.*")),
    ("config", "the config schema and what it describes: ranges, help, topologies, devices; optimizer specs",
     ("config.*",)),
    ("backends", "the frameworks: torch and TensorFlow behind one Engine and one set of ops",
     ("backends.*",)),
    ("data", "the global sample order, each worker's share, the dataset forms, reading ahead",
     ("data.*",)),
    ("checkpoint", "the checkpoint format, saving, loading, validating, the job folder",
     ("checkpoint.*",)),
    ("distributed", "membership, collectives, the agent and its store",
     ("distributed.*",)),
    ("replica", "one worker's replica of the state, kept equal to the others' through failures",
     ("replica.*",)),
    ("observability", "what a run shows and leaves: run log, step records, TensorBoard, goodput, plot, status",
     ("observability.*",)),
    ("train", "the trainer's parts: build, step, round, regroup, state, evaluation, checks, the model file; ops",
     ("train.*",)),
    ("trainer", "the loop and export",
     ("trainer", "exporting")),
    ("launchers", "how processes start and end: the launchers, the worker's main, the exit line",
     ("launchers.*",)),
    ("cli", "the commands (parse, hand over, render), fit() from Python, and the package's public names (ops and "
            "optim: the public names of train/ops.py and config/optim.py)",
     ("cli", "fitting", "__init__", "ops", "optim")),
]


def _entry_matches(entry: str, short: str) -> bool:
    if entry.endswith(".*"):
        return short == entry[:-2] or short.startswith(entry[:-1])
    return short == entry


def layer_of(module: str, package: str, layers=LAYERS) -> Optional[int]:
    """The index in ``layers`` of ``module`` (a dotted name under ``package``), None if it has none.

    An exact name wins over a ``pkg.*`` entry, and a longer ``pkg.*`` over a shorter one."""
    short = "__init__" if module == package else module[len(package) + 1:]
    best: Optional[Tuple[int, int]] = None  # (specificity, layer)
    for i, (_, _, entries) in enumerate(layers):
        for entry in entries:
            if _entry_matches(entry, short):
                rank = 10 ** 6 if not entry.endswith(".*") else len(entry)
                if best is None or rank > best[0]:
                    best = (rank, i)
    return None if best is None else best[1]


def unplaced(graph: Graph, package: str, layers=LAYERS) -> List[str]:
    """Modules of ``graph`` in no layer."""
    return sorted(m for m in graph if layer_of(m, package, layers) is None)


def stale_entries(graph: Graph, package: str, layers=LAYERS) -> List[str]:
    """Entries of ``layers`` that name no module (a module renamed or removed: its entry must follow)."""
    shorts = ["__init__" if m == package else m[len(package) + 1:] for m in graph]
    return [f"{name}: {entry}" for name, _, entries in layers for entry in entries
            if not any(_entry_matches(entry, s) for s in shorts)]


def upward_imports(graph: Graph, package: str, layers=LAYERS) -> List[str]:
    """Each import of a higher layer, as 'importer (layer L) imports imported (layer H) at line N'."""
    found = []
    for importer in sorted(graph):
        low = layer_of(importer, package, layers)
        for imported, line in sorted(graph[importer].items()):
            high = layer_of(imported, package, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{importer} (layer {layers[low][0]!r}) imports {imported} (layer {layers[high][0]!r}) "
                             f"at line {line}")
    return found


def test_every_module_has_a_layer():
    graph = import_graph(REPO, "elasticflow")
    missing = unplaced(graph, "elasticflow")
    assert not missing, ("modules in no layer: place each in LAYERS (tests/test_imports.py), in the lowest layer "
                         "whose subject it is:\n  " + "\n  ".join(missing))
    stale = stale_entries(graph, "elasticflow")
    assert not stale, "LAYERS names modules that do not exist (renamed or removed?):\n  " + "\n  ".join(stale)


MAX_ROOT_MODULES = 12


def test_layers_are_folders_and_the_root_stays_small():
    graph = import_graph(REPO, "elasticflow")
    inside = [e for _, _, entries in LAYERS for e in entries if "." in e.rstrip(".*")]
    assert not inside, ("LAYERS places single modules inside a folder; a folder is one layer (move the module "
                        "to the folder of its layer instead):\n  " + "\n  ".join(inside))
    root = sorted(m for m in graph if m.count(".") == 1 and not (REPO / m.replace(".", "/")).is_dir())
    assert len(root) + 1 <= MAX_ROOT_MODULES, (  # + 1: __init__.py
        f"{len(root) + 1} modules at elasticflow/'s root (at most {MAX_ROOT_MODULES}: the public surface and the "
        f"loop); move the others into the folder of their layer: {', '.join(root)}")


def layer_table() -> List[Tuple[str, str, str]]:
    """LAYERS as docs/architecture.md's table rows: (layer, what, modules), a folder written `folder/`."""
    def shown(entry: str) -> str:
        return f"`{entry[:-2]}/`" if entry.endswith(".*") else f"`{entry}`"
    return [(name, what, ", ".join(shown(e) for e in entries)) for name, what, entries in LAYERS]


def test_the_architecture_page_shows_the_declared_layers():
    text = (REPO / "docs" / "architecture.md").read_text()
    head = "| layer | what | modules |"
    assert head in text, f"docs/architecture.md lost its layer table (the line {head!r})"
    rows = []
    for line in text[text.index(head):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split("|")))
    expected = layer_table()
    assert rows == expected, ("docs/architecture.md's layer table differs from tests/test_imports.py's LAYERS; "
                              "make the table read:\n" + "\n".join(f"| {' | '.join(r)} |" for r in expected))


def test_imports_point_down_the_layers():
    graph = import_graph(REPO, "elasticflow")
    found = upward_imports(graph, "elasticflow")
    layers = " -> ".join(name for name, _, _ in LAYERS)
    assert not found, (f"imports from a lower layer to a higher one ({layers}); a lower layer that needs "
                       "something from a higher one takes it as an argument, or the shared code moves down:\n  "
                       + "\n  ".join(found))


# ---------------------------------------------------------------- rooms: a layer divided, ordered the same way
# Per divided layer, lowest first: (room, what it holds, modules), names relative to the layer's folder
# ("__init__": the folder's own __init__.py). A room imports its own and the rooms below it.
ROOMS: Dict[str, List[Tuple[str, str, Tuple[str, ...]]]] = {
    "distributed": [
        ("protocol", "what the agent and the workers say to each other: store keys, exit codes, the job token, "
                     "sealed records, the store inbox",
         ("__init__", "protocol")),
        ("store", "the job's store: the private and token servers and their wire, etcd, where a server listens, "
                  "picking a store and connecting to one",
         ("store.*",)),
        ("comm", "collectives: a generation's gloo group and its sums, the hierarchical sum, which address a host "
                 "binds",
         ("comm.*",)),
        ("membership", "a worker's side: joining, heartbeats, following generations, the rendezvous records",
         ("membership.*",)),
        ("agent", "the agent, its state and the parts it owns (admission, health, scaling, processes, generations, "
                  "hosts, leadership, workers.json), the roster, node agents, the client of `scale`",
         ("agent.*",)),
    ],
}


def room_graph(graph: Graph, package: str) -> Graph:
    """``graph`` cut down to ``package`` and the modules under it (the edges between them)."""
    inside = {m for m in graph if m == package or m.startswith(package + ".")}
    return {m: {t: line for t, line in graph[m].items() if t in inside} for m in sorted(inside)}


@pytest.mark.parametrize("layer", sorted(ROOMS))
def test_every_module_of_a_divided_layer_has_a_room(layer):
    package = f"elasticflow.{layer}"
    graph = room_graph(import_graph(REPO, "elasticflow"), package)
    missing = unplaced(graph, package, ROOMS[layer])
    assert not missing, (f"modules of {layer}/ in no room: place each in ROOMS[{layer!r}] (tests/test_imports.py), "
                         "in the lowest room whose subject it is:\n  " + "\n  ".join(missing))
    stale = stale_entries(graph, package, ROOMS[layer])
    assert not stale, f"ROOMS[{layer!r}] names modules that do not exist:\n  " + "\n  ".join(stale)


@pytest.mark.parametrize("layer", sorted(ROOMS))
def test_imports_point_down_the_rooms(layer):
    package = f"elasticflow.{layer}"
    graph = room_graph(import_graph(REPO, "elasticflow"), package)
    assert len(graph) > len(ROOMS[layer]), f"the walk found too few modules under {layer}/"
    found = upward_imports(graph, package, ROOMS[layer])
    rooms = " -> ".join(name for name, _, _ in ROOMS[layer])
    assert not found, (f"imports from a lower room of {layer}/ to a higher one ({rooms}); pass what the lower room "
                       "needs as an argument, or move the shared code down:\n  " + "\n  ".join(found))


def room_table(layer: str) -> List[Tuple[str, str, str, str]]:
    """ROOMS[layer] as docs/architecture.md's rows: (room, what, modules, the rooms it may import)."""
    def shown(entry: str) -> str:
        return f"`{entry[:-2]}/`" if entry.endswith(".*") else f"`{entry}.py`"
    rooms = ROOMS[layer]
    return [(name, what, ", ".join(shown(e) for e in entries),
             ", ".join(below for below, _, _ in rooms[:i]) or f"nothing of {layer}/")
            for i, (name, what, entries) in enumerate(rooms)]


@pytest.mark.parametrize("layer", sorted(ROOMS))
def test_the_architecture_page_shows_the_rooms(layer):
    text = (REPO / "docs" / "architecture.md").read_text()
    head = f"| room of {layer}/ | what | modules | may import |"
    assert head in text, f"docs/architecture.md lost the table of {layer}/'s rooms (the line {head!r})"
    rows = []
    for line in text[text.index(head):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split("|")))
    expected = room_table(layer)
    assert rows == expected, (f"docs/architecture.md's table of {layer}/'s rooms differs from ROOMS; make it read:\n"
                              + "\n".join(f"| {' | '.join(r)} |" for r in expected))


# ---------------------------------------------------------------- the layer check itself can fail
TOY_LAYERS = [("low", "", ("base", "sub.*")), ("high", "", ("top", "sub.up", "__init__"))]


def test_a_planted_upward_import_is_named_with_both_layers(tmp_path):
    graph = _package(tmp_path, {"pkg/base.py": "def f():\n    from .top import x\n    return x\n",
                                "pkg/top.py": "from . import base\n", "pkg/sub/__init__.py": "",
                                "pkg/sub/up.py": "from .. import top\n"})
    assert upward_imports(graph, "pkg", TOY_LAYERS) == [
        "pkg.base (layer 'low') imports pkg.top (layer 'high') at line 2"]


def test_a_longer_entry_places_a_module_over_its_package(tmp_path):
    graph = _package(tmp_path, {"pkg/base.py": "", "pkg/top.py": "", "pkg/sub/__init__.py": "",
                                "pkg/sub/down.py": "from . import up\n", "pkg/sub/up.py": ""})
    assert [layer_of(m, "pkg", TOY_LAYERS) for m in ("pkg", "pkg.sub", "pkg.sub.down", "pkg.sub.up")] == [1, 0, 0, 1]
    assert upward_imports(graph, "pkg", TOY_LAYERS) == [
        "pkg.sub.down (layer 'low') imports pkg.sub.up (layer 'high') at line 1"]


def test_same_layer_and_downward_imports_pass(tmp_path):
    graph = _package(tmp_path, {"pkg/base.py": "from .sub import helper\n", "pkg/sub/__init__.py": "",
                                "pkg/sub/helper.py": "", "pkg/top.py": "from . import base\nfrom .sub import up\n",
                                "pkg/sub/up.py": "from . import helper\n"})
    assert upward_imports(graph, "pkg", TOY_LAYERS) == []


def test_a_module_in_no_layer_and_an_entry_for_no_module_are_named(tmp_path):
    graph = _package(tmp_path, {"pkg/base.py": "", "pkg/new.py": "", "pkg/sub/__init__.py": ""})
    assert unplaced(graph, "pkg", TOY_LAYERS) == ["pkg.new"]
    assert stale_entries(graph, "pkg", TOY_LAYERS) == ["high: top", "high: sub.up"]
