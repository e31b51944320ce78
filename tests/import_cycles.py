"""No import circles inside a package: ``python tests/import_cycles.py [PACKAGE]`` (default workbench).

``make lint`` runs it (and so ``make test``, through tests/test_lint.py). It prints every circle it
finds, one shortest round trip per group of modules that import each other, with the line of each
import, and exits 1; it prints nothing and exits 0 when there is none.

What counts as an import: every ``import`` statement of the package's modules, at module level
*and* inside functions. A lazy import only postpones the dependency: the two modules still need
each other, and a reader still cannot understand one without the other. Only imports under
``if TYPE_CHECKING:`` are left out, since they never run and only give a type checker names.
Submodules importing their own package's ``__init__`` count too (``from workbench.serve import x``
inside ``workbench/serve/``), so a package re-exporting its modules' names imports them, never the
other way round. The import graph is grimp's, the library behind import-linter. grimp leaves out
folders without ``__init__.py`` (namespace packages) without a word, so such a folder is reported
as an error of its own: a circle through it would otherwise pass unseen.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import grimp


def _groups(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), sorted for stable output."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph.modules) + 100))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(found)


def _round_trip(graph: grimp.ImportGraph, group: list[str]) -> list[str]:
    """The shortest circle through the group's first module: [a, b, ..., a]."""
    start = group[0]
    best: tuple[str, ...] | None = None
    for other in sorted(graph.find_modules_directly_imported_by(start)):
        if other in group:
            back = graph.find_shortest_chain(importer=other, imported=start)
            if back is not None and (best is None or len(back) < len(best)):
                best = back
    assert best is not None, group  # every module of a group reaches every other
    return [start, *best]


def _line(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    first = graph.get_import_details(importer=importer, imported=imported)[:1]
    where = f"line {first[0]['line_number']}: {first[0]['line_contents']}" if first else "?"
    return f"  {importer} -> {imported}  ({where})"


def _folders_without_init(package: str) -> list[Path]:
    spec = importlib.util.find_spec(package)
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted(d for root in roots for d in [root, *root.rglob("*")]
                  if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
                  and not (d / "__init__.py").is_file())


def main(argv: list[str]) -> int:
    package = argv[0] if argv else "workbench"
    unseen = _folders_without_init(package)
    for folder in unseen:
        print(f"{folder} has Python modules but no __init__.py: the import graph cannot see "
              "them; add an __init__.py with a docstring saying what the folder holds")
    if unseen:
        return 1
    graph = grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)
    groups = _groups(graph)
    for group in groups:
        trip = _round_trip(graph, group)
        print(f"import circle in {package}: {' -> '.join(trip)}")
        for importer, imported in zip(trip, trip[1:]):
            print(_line(graph, importer, imported))
        if len(group) > len(trip) - 1:
            print(f"  (the circle's group also holds: {', '.join(m for m in group if m not in trip)})")
    if groups:
        print(f"{len(groups)} import circle(s): move what both sides need into a module below "
              "them (errors go to workbench/errors.py), or let the lower side register with the "
              "upper one instead of importing it")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
