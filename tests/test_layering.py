"""Imports go down the layers: a module of `meshplan/` may import its own
package and the packages below it, never one above. Function-level imports
count as much as module-level ones.

The layers follow the data: capture -> autodiff -> passes -> Job -> lower ->
check -> runtime -> driver -> cli/api (`ir` and `ops` below all; the
schedules just above `ir`, since the compiler and the runtime both ask what
a schedule is). One more rule: the Job (`ir/job.py`) is the one thing the
compiler (capture, autodiff, passes) and the runtime half (schedules,
lowering, runtime) share, so
lowering, checking or running a plan never imports the code that made it
(the runtime does not depend on the compiler; the driver, the CLI and the
API, above both, tie them together).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. "meshplan" is the root package (`__version__` only).
LAYERS = [
    "meshplan", "errors",
    "models",  # plain nn.Modules: import only errors
    "ir",  # Graph, Job, SBP, Mesh: pure data
    "schedules",  # what each pipeline schedule is (its registry), orders, checks: ir only
    "data",  # token directories, samplers, tokenizers (files written through ir.fileio)
    "costmodel",  # device models: data, and the seconds of a kernel or collective
    "ops",
    "capture", "autodiff", "passes",  # the compiler, up to the Job
    "lowering",  # lower a Job to RankPlans, and check them
    "runtime",
    "driver",
    "search",  # the strategy search: plans probes through the driver
    "cli", "api", "__main__",
]
COMPILER = {"capture", "autodiff", "passes"}
READS_THE_JOB = {"schedules", "lowering", "runtime"}  # below the compiler, yet never import it
# A rank gets the Job, the weights and its data source: it never builds a model.
NEVER_BUILDS_A_MODEL = READS_THE_JOB


def layer_of(module: str) -> str:
    """"meshplan.ir.graph" -> "ir"; "meshplan" -> "meshplan"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_of(path: str) -> str:
    """"meshplan/ir/graph.py" -> "meshplan.ir.graph" (a package: its name)."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: str, tree: ast.AST) -> list[str]:
    """The meshplan modules `tree` imports, anywhere in it."""
    package = module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [a.name for a in node.names]
            out += [f"{base}.{n}" for n in names] if base == "meshplan" else [base]
    return [m for m in out if m == "meshplan" or m.startswith("meshplan.")]


def violations(path: str, source: str) -> list[str]:
    """One line per import of a layer above the one of `path`."""
    mine = layer_of(module_of(path))
    found = []
    for module in imported(path, ast.parse(source)):
        theirs = layer_of(module)
        if LAYERS.index(theirs) > LAYERS.index(mine):
            found.append(f"{path} imports {module} ({theirs} is above {mine})")
        elif mine in READS_THE_JOB and theirs in COMPILER:
            found.append(f"{path} imports {module} ({theirs} made the Job {mine} reads)")
        elif mine in NEVER_BUILDS_A_MODEL and theirs == "models":
            found.append(f"{path} imports {module} (a rank never builds a model)")
    return found


def sources() -> list[Path]:
    return sorted((ROOT / "meshplan").rglob("*.py"))


def over_the_tree(check) -> list[str]:
    """`check(path, source)`'s lines over every module of meshplan/."""
    return [v for p in sources() for v in check(p.relative_to(ROOT).as_posix(), p.read_text())]


def assert_none(found: list[str]) -> None:
    assert not found, "\n".join(found)


def test_no_module_imports_a_layer_above_its_own():
    assert_none(over_the_tree(violations))


def test_every_package_has_a_layer():
    names = {layer_of(module_of(p.relative_to(ROOT).as_posix())) for p in sources()}
    assert names == set(LAYERS), names ^ set(LAYERS)


def test_an_upward_import_is_reported_wherever_it_is():
    source = ("import meshplan.ir\n"
              "from meshplan import errors, driver\n"
              "def plan(graph):\n"
              "    from meshplan.passes.plan import plan_job\n"
              "    return plan_job(graph)\n")
    assert violations("meshplan/runtime/x.py", source) == [
        "meshplan/runtime/x.py imports meshplan.driver (driver is above runtime)",
        "meshplan/runtime/x.py imports meshplan.passes.plan (passes made the Job runtime reads)",
    ]


def test_a_rank_that_builds_a_model_is_reported():
    source = "def source(cfg):\n    from meshplan.models import build_model\n"
    assert violations("meshplan/runtime/worker.py", source) == [
        "meshplan/runtime/worker.py imports meshplan.models (a rank never builds a model)"]


def test_a_relative_upward_import_is_reported():
    assert violations("meshplan/lowering/x.py", "from ..passes import boxing\n") == [
        "meshplan/lowering/x.py imports meshplan.passes (passes made the Job lowering reads)"]
    assert violations("meshplan/lowering/x.py", "from . import lower\n") == []


def test_the_compiler_importing_the_runtime_is_reported():
    assert violations("meshplan/passes/x.py", "from meshplan.runtime import comm\n") == [
        "meshplan/passes/x.py imports meshplan.runtime (runtime is above passes)"]


def imported_modules(path: str, tree: ast.AST, known: set[str]) -> set[str]:
    """The modules in `known` that `tree` imports, anywhere in it: `from a import b`
    names module `a.b` where that is a file, else `a`."""
    package = module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out |= {full} if full in known else {base} & known
    return out - {module_of(path)}


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """The import cycles among `files` (path -> source): each strongly connected
    set of two or more modules, sorted (Tarjan's algorithm, iterative)."""
    known = {module_of(p) for p in files}
    edges = {module_of(p): sorted(imported_modules(p, ast.parse(s), known))
             for p, s in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = stack[stack.index(v):]
                    del stack[stack.index(v):]
                    if len(comp) > 1:
                        cycles.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                work.append((w, iter(edges[w])))
            elif w in stack:
                low[v] = min(low[v], index[w])
    return sorted(cycles)


def test_no_two_files_import_each_other():
    files = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sources()}
    assert import_cycles(files) == []


def test_a_cycle_through_a_function_level_import_is_reported():
    files = {"meshplan/cli/a.py": "from meshplan.cli import b\n",
             "meshplan/cli/b.py": "def f():\n    from meshplan.cli.c import g\n",
             "meshplan/cli/c.py": "from .a import x\n",
             "meshplan/cli/d.py": "import meshplan.cli.a\n"}
    assert import_cycles(files) == [["meshplan.cli.a", "meshplan.cli.b", "meshplan.cli.c"]]
    files["meshplan/cli/c.py"] = "x = 1\n"
    assert import_cycles(files) == []


# Executing a plan needs only the plan: runtime/ imports from lowering/ only
# the plan's types and its file reader, and one module lowers a rank's own
# plan (`runtime/own_plan.py`: the rank-per-process compile).
PLAN_ONLY = {"meshplan.lowering.rankplan", "meshplan.lowering.files"}
OWN_LOWERING = ("meshplan/runtime/own_plan.py", "meshplan.lowering.lower")


def plan_only_violations(path: str, source: str) -> list[str]:
    """One line per import of `lowering/` by a runtime module beyond the plan."""
    if layer_of(module_of(path)) != "runtime":
        return []
    return [f"{path} imports {module} (executing a plan needs only the plan: "
            "lowering.rankplan and lowering.files)"
            for module in imported(path, ast.parse(source))
            if layer_of(module) == "lowering" and module not in PLAN_ONLY
            and (path, module) != OWN_LOWERING]


def test_the_runtime_needs_only_the_plan():
    assert_none(over_the_tree(plan_only_violations))


def test_a_runtime_module_deriving_from_the_job_is_reported():
    source = ("from meshplan.lowering.rankplan import RankPlan\n"
              "def f(job, plan):\n"
              "    from meshplan.lowering.buckets import buckets_of\n"
              "    from meshplan.lowering import lower\n")
    assert plan_only_violations("meshplan/runtime/rank_executor.py", source) == [
        "meshplan/runtime/rank_executor.py imports meshplan.lowering.buckets (executing a plan "
        "needs only the plan: lowering.rankplan and lowering.files)",
        "meshplan/runtime/rank_executor.py imports meshplan.lowering (executing a plan needs "
        "only the plan: lowering.rankplan and lowering.files)"]
    own = "from meshplan.lowering.lower import lower\n"
    assert plan_only_violations("meshplan/runtime/own_plan.py", own) == []
    assert plan_only_violations("meshplan/runtime/local.py", own) != []
    assert plan_only_violations("meshplan/driver/plan.py", own) == []


def unexplained_local_imports(path: str, source: str) -> list[str]:
    """One line per import inside a function whose last line gives no reason
    (a comment: `# optional` for an extra's library). Module-level imports
    are the rule; a function-level one is deliberate and says why."""
    lines = source.splitlines()
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and \
                        "#" not in lines[node.end_lineno - 1]:
                    found.append(f"{path}:{node.lineno} imports inside a function without "
                                 "saying why; import at the top, or add `# <reason>`")
    return sorted(set(found))


def test_every_function_level_import_says_why():
    assert_none(over_the_tree(unexplained_local_imports))


def test_an_unexplained_function_level_import_is_reported():
    source = ("import json\n"
              "def f():\n"
              "    import transformers  # optional\n"
              "    from meshplan.driver.plan import plan_model\n")
    assert unexplained_local_imports("meshplan/cli/x.py", source) == [
        "meshplan/cli/x.py:4 imports inside a function without saying why; import at the "
        "top, or add `# <reason>`"]
