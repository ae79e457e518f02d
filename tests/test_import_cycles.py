"""No import cycles in the project's packages: ``vit_backbone``, ``vitembed`` (``service/vitembed``) and
``vitembed_client`` (``client/vitembed_client``). A static scan of the source, so it sees every import,
not only those one test run happens to execute.

What counts as "module A imports module B" (an edge A → B):

- every ``import`` and ``from ... import`` statement anywhere in A, inside functions and methods too (a
  function-level import is a cycle postponed, not removed), except in an ``if TYPE_CHECKING:`` block (it
  never runs);
- relative imports resolved against A's package;
- ``from pkg import name`` is an edge to the submodule ``pkg.name`` when that is a module of the scan,
  otherwise to ``pkg`` itself (its ``__init__``, where ``name`` is defined or re-exported);
- ``import pkg.sub`` is an edge to ``pkg.sub``.

A cycle is a strongly connected component of more than one module: A imports something that (through any
chain) imports A back.

Packages and their ``__init__``: importing ``pkg.sub`` runs ``pkg/__init__`` first; that implicit parent
import is NOT an edge. The package is in ``sys.modules`` before its ``__init__`` body runs, so a submodule
that ``pkg/__init__`` imports may itself import its siblings (``pkg.other``) safely: a package whose
``__init__`` re-exports its parts is the normal shape of a package, not a cycle. What IS an edge is a
submodule naming its own package explicitly, ``from vit_backbone import load_backbone`` inside
``vit_backbone/catalog/...``: if ``vit_backbone/__init__`` imports (transitively) that submodule, the name is
looked up on a half-initialised package and works or fails depending on which module was imported first.
That is a real cycle and the scan reports it (see the last test): inside a package, import a name from the
module that defines it. Imports made through ``importlib`` (``vit_backbone/__init__``'s lazy exports) are not
seen by a static scan, so no module of a package imports names from its own top-level package at all (a
test below): the edge it would hide cannot exist.
"""

from __future__ import annotations

import ast
import itertools
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "vit_backbone": ROOT / "vit_backbone",
    "vitembed": ROOT / "service" / "vitembed",
    "vitembed_client": ROOT / "client" / "vitembed_client",
}

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def discover(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of ``packages`` (name -> folder) by dotted name; a package is its ``__init__``."""
    modules: dict[str, Path] = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all nested scopes, ``if TYPE_CHECKING:`` bodies skipped (their
    ``else:`` branch runs and is kept)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_graph(packages: Mapping[str, Path]) -> Graph:
    modules = discover(packages)
    graph: Graph = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(module, is_package, node)
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            for target in targets:
                if target in modules and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, in sorted order (iterative: no recursion
    limit on a long chain)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(found)


def cycle_path(graph: Graph, component: list[str]) -> list[str]:
    """One concrete cycle inside ``component``, from its first module back to it (breadth-first: shortest)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise ValueError(f"{component} is not a cycle")  # unreachable for a strongly connected component


def _shown(path: Path, packages: Mapping[str, Path]) -> str:
    if path.is_relative_to(ROOT):
        return path.relative_to(ROOT).as_posix()
    folder = next(folder for folder in packages.values() if path.is_relative_to(folder))
    return path.relative_to(folder.parent).as_posix()


def describe(graph: Graph, packages: Mapping[str, Path], component: list[str]) -> str:
    modules = discover(packages)
    path = cycle_path(graph, component)
    steps = [f"{a} ({_shown(modules[a], packages)}:{graph[a][b]})" for a, b in itertools.pairwise(path)]
    return " -> ".join([*steps, path[-1]]) + f"   [component: {', '.join(component)}]"


def cycles(packages: Mapping[str, Path]) -> list[str]:
    graph = import_graph(packages)
    return [describe(graph, packages, component) for component in strongly_connected(graph)]


# ------------------------------------------------------------------------------------------- the tree
def test_the_packages_have_no_import_cycle() -> None:
    graph = import_graph(PACKAGES)
    assert len(graph) > 90, f"the scan found only {len(graph)} modules: are the package folders right?"
    assert sum(len(edges) for edges in graph.values()) > 250  # it sees the imports, not only the files
    found = cycles(PACKAGES)
    assert not found, "import cycles (module (file:line of the import) -> ...):\n" + "\n".join(found)


def test_no_module_imports_from_its_own_top_level_package() -> None:
    """``vit_backbone/__init__`` resolves its public names lazily (importlib, unseen by the scan): a module
    of the package importing one of them would hide an edge. Import from the defining module instead."""
    graph = import_graph(PACKAGES)
    through_init = sorted(
        f"{module} imports from {top} (line {graph[module][top]})"
        for module in graph
        for top in PACKAGES
        if module.startswith(f"{top}.") and top in graph[module]
    )
    assert not through_init, "\n".join(through_init)


# ------------------------------------------------------------------------------------------- the scanner
def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return {"pkg": tmp_path / "pkg"}


def test_a_planted_cycle_through_a_function_level_import_is_caught(tmp_path: Path) -> None:
    packages = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.b import helper\n",
            "b.py": "def helper():\n    from . import c\n    return c\n",  # relative, inside a function
            "c.py": "import pkg.a\n",
            "d.py": "from pkg import a\n",  # imports the cycle, is not part of it
        },
    )
    [found] = cycles(packages)
    assert found.startswith("pkg.a (pkg/a.py:1) -> pkg.b (pkg/b.py:2) -> pkg.c (pkg/c.py:1) -> pkg.a")
    assert found.endswith("[component: pkg.a, pkg.b, pkg.c]")


def test_a_type_checking_back_import_is_not_a_cycle(tmp_path: Path) -> None:
    packages = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg.b import B\n",
            "b.py": (
                "from typing import TYPE_CHECKING\nimport typing\n"
                "if TYPE_CHECKING:\n    from pkg.a import A\n"
                "if typing.TYPE_CHECKING:\n    import pkg.a\n"
                "class B: ...\n"
            ),
        },
    )
    assert cycles(packages) == []
    assert import_graph(packages)["pkg.b"] == {}
    packages["pkg"].joinpath("b.py").write_text(  # the else branch of the same block does run
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    pass\nelse:\n    from pkg.a import A\n"
    )
    assert len(cycles(packages)) == 1


def test_from_package_import_name_is_the_submodule_or_the_init(tmp_path: Path) -> None:
    packages = _package(
        tmp_path,
        {
            "__init__.py": "from pkg.core import run\n",
            "core.py": "def run(): ...\n",
            "sub/__init__.py": "",
            "sub/tool.py": "from .. import core\nfrom ..sub import tool2\n",
            "sub/tool2.py": "from pkg import run\n",  # a name re-exported by pkg/__init__: an edge to pkg
        },
    )
    graph = import_graph(packages)
    assert graph["pkg.sub.tool"] == {"pkg.core": 1, "pkg.sub.tool2": 2}
    assert graph["pkg.sub.tool2"] == {"pkg": 1}
    assert graph["pkg"] == {"pkg.core": 1}
    assert cycles(packages) == []  # pkg -> core, nothing back


def test_a_submodule_importing_its_package_init_that_imports_it_back_is_a_cycle(tmp_path: Path) -> None:
    packages = _package(
        tmp_path,
        {
            "__init__.py": "from pkg.model import Model\nfrom pkg.loader import load\n",
            "model.py": "class Model: ...\n",
            "loader.py": "from pkg import Model\ndef load(): return Model()\n",  # via the half-made package
        },
    )
    [found] = cycles(packages)
    assert found == (
        "pkg (pkg/__init__.py:2) -> pkg.loader (pkg/loader.py:1) -> pkg   [component: pkg, pkg.loader]"
    )
    packages["pkg"].joinpath("loader.py").write_text("from pkg.model import Model\n")  # the fix
    assert cycles(packages) == []
