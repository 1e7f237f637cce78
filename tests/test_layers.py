"""The floors of the house, read from the source (AST only: nothing is imported).

``bus/`` is the package ``idembus``; ``handlers/``, ``storage/`` and ``transports/`` are its
subpackages (setup.cfg's ``package_dir``). Its modules stand on floors, and an import may
only go down or sideways:

* foundation — the modules at the root of ``bus/``: imports only the foundation;
* adapters — ``storage/``, ``transports/``, ``handlers/``: the foundation and each other;
* runtime — ``bus/runtime/``: the floors below, never the command line, observability or
  the apps;
* observability — ``bus/observability/``: the floors below;
* apps — ``bus/dashboard/``, ``bus/gateway/``, ``bus/spark/``, ``bus/testing/``: anything
  but the command line;
* cli — ``bus/cli/``: anything.

Imports under ``if TYPE_CHECKING:`` are for the type checker and do not count. The package's
own ``__init__`` (the public facade, whose names load on first use), ``__main__`` and the
old import paths kept for one release are outside the floors. At import time (module-level
imports, outside ``TYPE_CHECKING``) no two modules may need each other.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"idembus": "bus", "idembus.handlers": "handlers", "idembus.storage": "storage",
           "idembus.transports": "transports"}
#: Old import paths kept for one release (each re-exports from its new home).
ALIASES = {"idembus.tracing", "idembus.metrics", "idembus.aio"}
OUTSIDE = {"idembus", "idembus.__main__", *ALIASES}
ALLOWED = {
    "foundation": {"foundation"},
    "adapters": {"foundation", "adapters"},
    "runtime": {"foundation", "adapters", "runtime"},
    "observability": {"foundation", "adapters", "runtime", "observability"},
    "apps": {"foundation", "adapters", "runtime", "observability", "apps"},
    "cli": {"foundation", "adapters", "runtime", "observability", "apps", "cli"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (or package)
    where: str  # file:line
    eager: bool  # at module level, outside TYPE_CHECKING


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package in the checkout at ``root``, by its dotted name."""
    found: dict[str, pathlib.Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def floor(module: str) -> str | None:
    """The floor of a module of the package, ``None`` for those outside the floors."""
    if module in OUTSIDE:
        return None
    parts = module.split(".")
    second = parts[1]
    if second in {"handlers", "storage", "transports"}:
        return "adapters"
    if second in {"runtime", "observability", "cli"}:
        return second
    if second in {"dashboard", "gateway", "spark", "testing"}:
        return "apps"
    return "foundation"


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> Iterator[Import]:
    """The package's modules that ``name`` (the file at ``path``) imports."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(child) for inner in node.body for child in ast.walk(inner))
    eager_nodes = {id(child) for statement in tree.body for child in ast.walk(statement)
                   if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef
                                     | ast.ClassDef)}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in known else base)
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            resolved = _known(target, known)
            if resolved is not None and resolved != name:
                eager = id(node) in eager_nodes and id(node) not in checking
                yield Import(name, resolved, f"{path.relative_to(_root(path))}:{node.lineno}",
                             eager and id(node) not in checking)


def _absolute(name: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _known(target: str, known: dict[str, pathlib.Path]) -> str | None:
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def _root(path: pathlib.Path) -> pathlib.Path:
    for parent in path.parents:
        if (parent / "setup.cfg").exists():
            return parent
    return path.parent


def upward_imports(root: pathlib.Path) -> list[str]:
    """Every import that goes up a floor, as ``file:line: a imports b (x may not import y)``."""
    known = modules(root)
    problems: list[str] = []
    for name, path in known.items():
        here = floor(name)
        if here is None:
            continue
        for found in imports(name, path, known):
            there = floor(found.target)
            if not found.eager or there is None or there in ALLOWED[here]:
                continue
            problem = (f"{found.where}: {name} imports {found.target} "
                       f"({here} may not import {there})")
            if problem not in problems:
                problems.append(problem)
    return problems


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """The import-time cycles: strongly connected groups of modules that import each other
    at module level."""
    known = modules(root)
    graph = {name: sorted({found.target for found in imports(name, path, known)
                           if found.eager}) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in graph.get(node, []):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_a_floor_above_its_own():
    assert upward_imports(REPOSITORY) == []


def test_no_two_modules_import_each_other_at_import_time():
    assert import_cycles(REPOSITORY) == []


def test_the_root_of_bus_and_the_runtime_hold_at_most_25_modules_each():
    for folder in ("bus", "bus/runtime"):
        found = sorted(path.name for path in (REPOSITORY / folder).glob("*.py"))
        assert len(found) <= 25, f"{folder} holds {len(found)} modules: {found}"


def copy_of_the_package(tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copy(REPOSITORY / "setup.cfg", tmp_path / "setup.cfg")
    for folder in FOLDERS.values():
        shutil.copytree(REPOSITORY / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_an_upward_import_is_found_with_its_file_and_line(tmp_path):
    # Given the package with one upward import planted: storage (an adapter) imports the
    # runtime's endpoint, below an import that is only for the type checker
    root = copy_of_the_package(tmp_path)
    memory = root / "storage" / "memory.py"
    source = memory.read_text()
    memory.write_text(source + "\nif TYPE_CHECKING:\n    from ..runtime.endpoint import Endpoint\n"
                      "from ..runtime import endpoint as _planted  # noqa\n")
    line = len(source.splitlines()) + 4

    # When the floors are checked
    problems = upward_imports(root)

    # Then that import, and only that one, is reported, with where it is
    assert problems == [f"storage/memory.py:{line}: idembus.storage.memory imports "
                        "idembus.runtime.endpoint (adapters may not import runtime)"]


def test_a_planted_cycle_is_found(tmp_path):
    # Given headers importing envelope, which already imports headers
    root = copy_of_the_package(tmp_path)
    headers = root / "bus" / "headers.py"
    headers.write_text(headers.read_text() + "\nfrom . import envelope  # noqa\n")

    assert ["idembus.envelope", "idembus.headers"] in import_cycles(root)


def runtime_collaborators(root: pathlib.Path) -> Iterator[tuple[str, ast.FunctionDef]]:
    """The ``__init__`` of every class of ``bus/runtime/`` that is not a record (records are
    dataclasses: their fields are their parameters) nor the public :class:`Endpoint`."""
    for path in sorted((root / "bus" / "runtime").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name == "Endpoint":
                continue
            if any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    yield f"{path.relative_to(root)}:{item.lineno} {node.name}", item


def parameters(function: ast.FunctionDef) -> int:
    arguments = function.args
    return len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs) - 1


def test_no_runtime_collaborator_takes_more_than_six_parameters():
    crowded = [f"{where} takes {parameters(init)}"
               for where, init in runtime_collaborators(REPOSITORY) if parameters(init) > 6]
    assert crowded == []


def test_a_collaborator_with_seven_parameters_is_found(tmp_path):
    root = copy_of_the_package(tmp_path)
    (root / "bus" / "runtime" / "planted.py").write_text(
        "class Crowded:\n    def __init__(self, a, b, c, d, e, f, g):\n        pass\n")
    found = [where for where, init in runtime_collaborators(root) if parameters(init) > 6]
    assert found == ["bus/runtime/planted.py:2 Crowded"]


def test_the_endpoint_constructor_validates_and_assembles_in_at_most_60_lines():
    tree = ast.parse((REPOSITORY / "bus" / "runtime" / "endpoint.py").read_text())
    [endpoint] = [node for node in tree.body
                  if isinstance(node, ast.ClassDef) and node.name == "Endpoint"]
    [init] = [node for node in endpoint.body
              if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 <= 60


#: Most lines a module of ``transports/`` may hold: a transport is split by concern (the
#: kombu transport's topology, publishing, consuming, inspection; the database queues'
#: engine, statements and rows) before it grows past this.
TRANSPORT_MODULE_LINES = 600


def long_modules(root: pathlib.Path, folder: str, limit: int) -> list[str]:
    """The modules of ``folder`` longer than ``limit`` lines, as ``path: N lines``."""
    return [f"{path.relative_to(root)}: {len(path.read_text().splitlines())} lines"
            for path in sorted((root / folder).rglob("*.py"))
            if len(path.read_text().splitlines()) > limit]


def test_no_transport_module_exceeds_600_lines():
    assert long_modules(REPOSITORY, "transports", TRANSPORT_MODULE_LINES) == []


def test_a_transport_module_over_600_lines_is_found(tmp_path):
    root = copy_of_the_package(tmp_path)
    (root / "transports" / "planted.py").write_text("x = 1\n" * 601)
    assert "transports/planted.py: 601 lines" in long_modules(root, "transports",
                                                              TRANSPORT_MODULE_LINES)
