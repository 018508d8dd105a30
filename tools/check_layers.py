"""Check that imports respect Nebula's layers and form no circle.

Layers, bottom to top::

    library      nebula_common.*  (except the three user-facing packages below)
    services     services.*
    user-facing  nebula_common.sdk, nebula_common.launcher, nebula_common.cli
    top          nebula  (the one-import SDK: ``from nebula import Deployment, Job``)

Imports point down only: the library imports neither services nor user-facing code, services
do not import user-facing code, and nothing imports the top package (it only re-exports). On top
of that no two modules may import each other, directly or through others (a circle makes import
order matter and hides which module owns what).

Why a tool and not a convention: one convenient import is all it takes to undo a layering, and a
deferred import inside a function hides it from a reader. So every ``import`` statement counts,
wherever it sits (module level, inside functions, under ``if TYPE_CHECKING``), because each one
is a dependency someone must keep working. ``from pkg import name`` counts as an import of the
submodule ``pkg.name`` when there is one, else of ``pkg``; importing ``a.b.c`` is not counted as
importing the packages ``a`` and ``a.b`` (their ``__init__`` run first, but a package importing
its own submodules is not a circle worth reporting). Only ``ast`` is used: nothing is imported or executed,
so the check also works on code that would fail to import.

Usage: ``python tools/check_layers.py [ROOT]``; prints every violation and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nebula", "nebula_common", "services")
USER_FACING = ("nebula_common.sdk", "nebula_common.cli", "nebula_common.launcher")
TOP_PACKAGE = "nebula"
LIBRARY, SERVICES, USER, TOP = "library", "services", "user-facing", "top"


@dataclass(frozen=True)
class Import:
    """One import statement of an internal module: who imports what, and where."""

    importer: str
    target: str
    path: Path
    line: int


@dataclass(frozen=True)
class Violation:
    """One broken rule, with a message that names the modules (and the line for a layering import)."""

    kind: str  # "layer" or "cycle"
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> str:
    """The layer ``module`` belongs to (its dotted name decides, nothing else)."""
    if _within(module, TOP_PACKAGE):
        return TOP
    if any(_within(module, package) for package in USER_FACING):
        return USER
    if _within(module, "services"):
        return SERVICES
    return LIBRARY


def forbidden(importer: str, target: str) -> str | None:
    """Why ``importer`` must not import ``target``, or None when the import points down (or sideways)."""
    source, dest = layer_of(importer), layer_of(target)
    if dest == TOP and source != TOP:
        return f"nothing below it may import the top package {TOP_PACKAGE!r} (it only re-exports the SDK)"
    if source == LIBRARY and dest in (SERVICES, USER):
        return f"the shared library must not import {dest} code"
    if source == SERVICES and dest == USER:
        return "services must not import user-facing code (sdk, cli, launcher)"
    return None


def discover(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package is its ``__init__``)."""
    modules: dict[str, Path] = {}
    for package in packages:
        if not (root / package).is_dir():
            continue
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The known module ``name`` refers to: itself, or its longest known prefix (``pkg.attr``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module name of a (possibly relative) ``from ... import`` statement."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """Every import of a known module in ``path``, including those nested in functions and classes."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            # ``from pkg import sub`` depends on the submodule when ``sub`` is one, else on ``pkg``.
            targets = [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
        seen: set[str] = set()  # ``from pkg.m import a, b`` is one dependency on pkg.m, not two
        for name in targets:
            target = _resolve(name, modules)
            if target is not None and target != module and target not in seen:
                seen.add(target)
                yield Import(module, target, path, node.lineno)


def collect(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    """All internal imports of all modules under ``root``."""
    modules = discover(root, packages)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules)]


def layer_violations(imports: Iterable[Import], root: Path) -> list[Violation]:
    """One violation per import statement that points up a layer."""
    found = []
    for imp in imports:
        reason = forbidden(imp.importer, imp.target)
        if reason is not None:
            where = f"{imp.path.relative_to(root)}:{imp.line}"
            found.append(Violation("layer", f"{imp.importer} imports {imp.target} ({where}): {reason}"))
    return found


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component (BFS)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is not on a cycle")  # unreachable for a real component


def cycle_violations(imports: Iterable[Import]) -> list[Violation]:
    """One violation per import circle (strongly connected component), naming a cycle through it."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    found = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _shortest_cycle(graph, set(component), component[0])
        message = " -> ".join(cycle)
        if len(component) > len(cycle) - 1:
            message += f" (circle of {len(component)} modules: {', '.join(component)})"
        found.append(Violation("cycle", message))
    return sorted(found, key=str)


def check(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Violation]:
    """Every layering violation and every import circle among the modules under ``root``."""
    imports = collect(root, packages)
    return layer_violations(imports, root) + cycle_violations(imports)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    violations = check(args.root.resolve())
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} layering violation(s)", file=sys.stderr)
        return 1
    print("layers ok: imports point down only and form no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
