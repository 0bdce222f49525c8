"""`meshplan/ops` imports in one direction (rule <- rules <- table <- infer
<- emit): every import is at module level, and the module graph has no cycle,
so no module needs a late import to load."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

OPS = Path(__file__).resolve().parents[2] / "meshplan" / "ops"


def _imports(tree: ast.Module) -> tuple[set[str], list[int]]:
    """The ops modules a module imports, and the lines of imports inside a
    function or class (anything not at module level)."""
    top = set(tree.body)
    mods, late = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if node not in top:
                late.append(node.lineno)
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module == "meshplan.ops":
                mods |= {a.name for a in node.names}
            elif module and module.startswith("meshplan.ops."):
                mods.add(module.split(".")[2])
    return mods, late


def graph() -> tuple[dict[str, set[str]], dict[str, list[int]]]:
    deps, late = {}, {}
    for p in sorted(OPS.glob("*.py")):
        deps[p.stem], lines = _imports(ast.parse(p.read_text()))
        if lines:
            late[p.stem] = lines
    return deps, late


def test_ops_imports_at_module_level_only():
    assert graph()[1] == {}


def test_ops_imports_have_no_cycle():
    try:
        tuple(TopologicalSorter(graph()[0]).static_order())
    except CycleError as e:
        raise AssertionError(f"import cycle in meshplan/ops: {e.args[1]}") from None
