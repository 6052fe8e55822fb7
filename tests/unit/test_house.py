"""The house rules (docs/architecture.md), read from the source: every import of every module of
fastio, lowdiff and recovery (function-level and TYPE_CHECKING ones included) runs downward between
lowdiff's sub-packages, ``format`` reads nothing but fastio and the base modules, only ``cli`` and
``integrations`` reach recovery (inside functions), no two modules import each other through any
path, no module outgrows its budget, and the code map names every module."""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OURS = ("fastio", "lowdiff", "recovery")

# lowdiff's units, lowest first: a unit imports only units of a lower layer (and itself). The base
# modules (errors, faults) are below everything; the package's own __init__ (the public API) sits
# below cli and integrations, which import it as users do.
LAYERS = [
    {"lowdiff.errors", "lowdiff.faults"},
    {"lowdiff.format"},
    {"lowdiff.step", "lowdiff.store"},
    {"lowdiff.control"},
    {"lowdiff.distributed"},
    {"lowdiff.tiers"},
    {"lowdiff.capture"},
    {"lowdiff.persist"},
    {"lowdiff.train"},
    {"lowdiff"},
    {"lowdiff.cli", "lowdiff.integrations"},
    {"lowdiff.__main__"},
]
LAYER = {unit: level for level, units in enumerate(LAYERS) for unit in units}
FORMAT_MAY_IMPORT = {"fastio", "lowdiff.errors", "lowdiff.faults", "lowdiff.format"}
MAY_IMPORT_RECOVERY = ("lowdiff.cli", "lowdiff.integrations")
MAX_LINES = 450                 # "about 400": a module past this has outgrown one job
# Modules over the budget, each with the work that brings it under (empty once that work lands).
OVER_BUDGET: dict[str, str] = {}
MODULES_PER_SUBPACKAGE = (3, 8)


def module_files():
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            yield ".".join(parts), path, is_package


MODULES = {name: (path, is_package) for name, path, is_package in module_files()}


def imports_of(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every first-party import of ``name``. An
    ``from pkg import name`` that names a module counts as an import of that module."""
    path, is_package = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []

    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in MODULES else base, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    return [(target, line, nested) for target, line, nested in found if target.split(".")[0] in OURS]


def unit_of(module: str) -> str:
    """lowdiff's unit of a module: its sub-package, or the module itself (base modules, the package)."""
    parts = module.split(".")
    if len(parts) >= 2 and f"lowdiff.{parts[1]}" in LAYER:
        return f"lowdiff.{parts[1]}"
    return module


def resolved(target: str) -> str:
    """``target`` as a module we have (an import of a name inside a module counts as the module)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


EDGES = {name: [(resolved(t), line, nested) for t, line, nested in imports_of(name)] for name in MODULES}


def test_every_lowdiff_module_belongs_to_a_unit_of_the_layers():
    strays = sorted(m for m in MODULES if m.startswith("lowdiff") and unit_of(m) not in LAYER)
    assert not strays, f"modules outside every layer of {__name__}.LAYERS: {strays}"


def test_lowdiff_imports_run_downward():
    wrong = []
    for name, edges in EDGES.items():
        if not name.startswith("lowdiff"):
            continue
        for target, line, _ in edges:
            if not target.startswith("lowdiff"):
                continue
            src, dst = unit_of(name), unit_of(target)
            if src != dst and LAYER[dst] >= LAYER[src]:
                wrong.append(f"{MODULES[name][0].relative_to(ROOT)}:{line} imports {target} ({src} -> {dst})")
    assert not wrong, "imports that do not run downward:\n" + "\n".join(wrong)


def test_format_reads_only_fastio_and_the_base_modules():
    wrong = [f"{MODULES[name][0].relative_to(ROOT)}:{line} imports {target}"
             for name, edges in EDGES.items() if unit_of(name) == "lowdiff.format"
             for target, line, _ in edges if unit_of(target).split(".")[0] != "fastio"
             and unit_of(target) not in FORMAT_MAY_IMPORT]
    assert not wrong, "\n".join(wrong)


def test_fastio_imports_nothing_of_ours_above_it():
    wrong = [f"{name}:{line} imports {target}" for name, edges in EDGES.items() if name.startswith("fastio")
             for target, line, _ in edges if not target.startswith("fastio")]
    assert not wrong, "\n".join(wrong)


def test_only_cli_and_integrations_reach_recovery_and_only_inside_functions():
    wrong = []
    for name, edges in EDGES.items():
        if not name.startswith("lowdiff"):
            continue
        for target, line, nested in edges:
            if target.startswith("recovery") and (not name.startswith(MAY_IMPORT_RECOVERY) or not nested):
                wrong.append(f"{MODULES[name][0].relative_to(ROOT)}:{line} imports {target}"
                             + ("" if nested else " at module level"))
    assert not wrong, "\n".join(wrong)


def test_no_module_reaches_itself_through_its_imports():
    """No circles of any length, function-level imports included (they hide the same knot)."""
    graph = {name: sorted({t for t, _, _ in edges if t != name and t in MODULES}) for name, edges in EDGES.items()}
    # A package's __init__ that re-exports its modules is entered by them only through their own
    # name (``lowdiff.tiers.policy`` imports ``lowdiff.tiers`` first): not an edge back.
    for name, targets in graph.items():
        graph[name] = [t for t in targets if not (MODULES[t][1] and name.startswith(t + "."))]
    state: dict = {}
    cycles = []

    def walk(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_modules_stay_within_the_line_budget():
    over = [f"{path.relative_to(ROOT)}: {n} lines" for path, _ in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES
            and str(path.relative_to(ROOT)) not in OVER_BUDGET]
    assert not over, f"over {MAX_LINES} lines (split it by responsibility):\n" + "\n".join(over)


# Rooms that hold 3..8 modules: lowdiff's sub-packages (integrations holds one module per
# framework, as many as there are frameworks) and recovery's three.
ROOMS = sorted(u for u in LAYER if u.count(".") == 1 and u not in LAYERS[0]
               and u not in ("lowdiff.__main__", "lowdiff.integrations")) + \
    ["recovery", "recovery.partitioned", "recovery.pipeline"]


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_holds_a_few_modules(room):
    directory = ROOT / room.replace(".", "/")
    count = len([p for p in directory.glob("*.py") if p.name != "__init__.py"])
    low, high = MODULES_PER_SUBPACKAGE
    assert low <= count <= high, f"{room} has {count} modules ({low}..{high}: merge it or split it)"


def test_the_code_map_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = sorted(str(path.relative_to(ROOT)) for path, is_package in MODULES.values()
                     if not is_package and str(path.relative_to(ROOT)) not in text)
    missing += sorted(str(p.relative_to(ROOT)) for top in OURS for p in (ROOT / top).rglob("*.pyx")
                      if str(p.relative_to(ROOT)) not in text)
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)


def test_python_files_are_what_the_scan_reads():
    """The scan above sees every module: a module it cannot parse fails here, not silently."""
    for path, _ in MODULES.values():
        ast.parse(path.read_text(), str(path))
    assert len(MODULES) > 60 and os.path.isdir(ROOT / "lowdiff" / "format")
