"""Print the import graph between raysc's top-level packages and modules, and its cycles.

A node is a package directly under ``raysc/`` (``config``, ``fleet``...) or a
top-level module (``cli``, ``driver``...). Every ``import raysc.X`` and
``from raysc.X import ...`` counts, at module level and inside functions alike
(an import inside a function still couples the two packages). Run from the
repository root::

    python tools/import_graph.py            # the graph, function-level imports marked, then cycles
    python tools/import_graph.py --cycles   # the cycles only; the exit status is their count

``tests/test_imports.py`` uses ``edges`` and ``cycles`` from this file.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "raysc"


@dataclass(frozen=True)
class Import:
    """One import of raysc code: which file, which line, what, and whether inside a function."""

    src: str  # node of the importing file
    dst: str  # node of the imported module
    module: str  # the dotted module imported, e.g. raysc.data.mixture
    path: str  # the importing file, relative to the repository root
    line: int
    in_function: bool


def node_of(module: str) -> str | None:
    """The top-level node of a dotted ``raysc...`` module name (None for ``raysc`` itself)."""
    parts = module.split(".")
    if parts[0] != "raysc" or len(parts) < 2:
        return None
    return parts[1]


def _file_node(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0].removesuffix(".py")


def _imports_of(path: Path, root: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    src = _file_node(path, root)
    rel = str(path.relative_to(root.parent))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            modules: list[str] = []
            if isinstance(child, ast.Import):
                modules = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                modules = [child.module]
                if child.module == "raysc":  # from raysc import hashing
                    modules = [f"raysc.{a.name}" for a in child.names]
            for m in modules:
                dst = node_of(m)
                if dst is not None:
                    found.append(Import(src, dst, m, rel, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of raysc code in every file under ``root``."""
    out: list[Import] = []
    for path in sorted(root.rglob("*.py")):
        out.extend(_imports_of(path, root))
    return out


def edges(found: list[Import]) -> dict[str, set[str]]:
    """node -> the other nodes it imports."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.src, set())
        graph.setdefault(imp.dst, set())
        if imp.src != imp.dst:
            graph[imp.src].add(imp.dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def cycle_edges(found: list[Import], component: list[str]) -> list[Import]:
    """The imports that run between the nodes of one cycle (what to cut)."""
    members = set(component)
    return [i for i in found if i.src != i.dst and i.src in members and i.dst in members]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", action="store_true", help="print only the cycles")
    args = ap.parse_args(argv)
    found = imports()
    graph = edges(found)
    if not args.cycles:
        local = {(i.src, i.dst) for i in found if not i.in_function}
        for src in sorted(graph):
            targets = [d if (src, d) in local else f"{d}*" for d in sorted(graph[src])]
            print(f"{src:>10} -> {', '.join(targets) or '-'}")
        n_fn = sum(1 for i in found if i.in_function and i.src != i.dst)
        print(f"\n(* = only inside functions; {n_fn} function-level imports across nodes)")
    found_cycles = cycles(graph)
    print(f"\n{len(found_cycles)} cycle(s)")
    for comp in found_cycles:
        print(f"  {' <-> '.join(comp)}")
        for i in cycle_edges(found, comp):
            where = " (in a function)" if i.in_function else ""
            print(f"      {i.src} -> {i.dst}: {i.path}:{i.line} imports {i.module}{where}")
    return len(found_cycles)


if __name__ == "__main__":
    sys.exit(min(main(), 125))
