"""The layering contract (docs/concepts.md, "Architecture") holds, and no mdb module takes part in an import cycle.

Both read the import graph statically (grimp, the engine of import-linter), so an import hidden
inside a function or under ``TYPE_CHECKING`` counts like any other: a late import that dodges a
cycle at run time is still a cycle in the design.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check below could pass by finding nothing; on a graph with a cycle it must report it."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycle_among_mdb_modules() -> None:
    graph = grimp.build_graph("mdb")
    assert len(graph.modules) > 50  # the package was found, not an empty graph
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_import_linter_contracts_hold() -> None:
    """``lint-imports`` with the project's .importlinter: the declared layers and sibling rules."""
    linter = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(linter), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: " in result.stdout and " broken" in result.stdout  # it ran and reported its contracts
