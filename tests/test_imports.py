"""Imports only run downhill: no cycle between raysc's top-level packages and modules, and the
config package (the bottom layer) imports nothing of raysc outside itself.

Both module-level and function-level imports count (``tools/import_graph.py``, which prints
the graph). Cheap: it parses the source, it imports nothing of raysc.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def test_no_import_cycle_between_raysc_packages():
    graph = _tool()
    found = graph.imports()
    cycles = graph.cycles(graph.edges(found))
    detail = "\n".join(
        f"{' <-> '.join(c)}:\n"
        + "\n".join(f"    {i.path}:{i.line} imports {i.module}" for i in graph.cycle_edges(found, c))
        for c in cycles
    )
    assert not cycles, f"import cycles between raysc packages (python tools/import_graph.py):\n{detail}"


def test_config_imports_nothing_above_it():
    upward = [i for i in _tool().imports() if i.src == "config" and i.dst != "config"]
    assert not upward, "raysc.config must import only raysc.config:\n" + "\n".join(
        f"    {i.path}:{i.line} imports {i.module}" for i in upward
    )


def test_the_graph_sees_function_level_imports(tmp_path: Path):
    """A cycle hidden inside a function is still a cycle."""
    root = tmp_path / "raysc"
    (root / "low").mkdir(parents=True)
    (root / "low" / "__init__.py").write_text("def f():\n    from raysc.high import g\n")
    (root / "high.py").write_text("from raysc.low import f\n")
    graph = _tool()
    found = graph.imports(root)
    assert graph.cycles(graph.edges(found)) == [["high", "low"]]
    assert [i.in_function for i in graph.cycle_edges(found, ["high", "low"])] == [False, True]


def test_the_supervisor_and_the_worker_actor_class_import_no_torch():
    """Every run starts a supervisor process, which holds the TrainWorker class to create workers:
    neither may pull in torch (~4 s of every run's start on a 2-core machine; the ranks import it)."""
    import subprocess

    code = (
        "import sys, raysc.fleet.supervisor, raysc.fleet.worker; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sympy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"the supervisor imports {out.strip()}"


def test_no_module_of_raysc_is_over_500_lines():
    """A module that grows past 500 lines (formatted: `make lint` checks that) is split by what it does."""
    root = TOOL.parent.parent / "raysc"
    long = {
        str(p.relative_to(root.parent)): n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, f"split these by responsibility (docs/architecture.md, house style): {long}"
