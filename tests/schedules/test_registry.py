"""The schedule registry (`schedules/registry.py`) is the one place a
schedule is described: no module outside it compares or lists schedule
names, and a new schedule, one record and its action function, runs
through plan, check, simulate and the search.

The allow-list is the registry module alone: the action functions
(`gpipe.py`, ...) and `csv_io.py` never name a schedule in a comparison or
a listing, so they need no exemption. `NOT_A_SCHEDULE` holds the one
string that spells a schedule's name while meaning something else.
"""

from __future__ import annotations

import ast
from pathlib import Path

from meshplan.costmodel import load_device_model
from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.schedules import (
    Action,
    ActionType,
    ScheduleSpec,
    add_comm,
    compute_actions,
    placement_of,
    simulate,
    validate,
)
from meshplan.schedules.registry import REGISTRY, registered, spec_of
from meshplan.search.probe import ModelSpec
from meshplan.search.search import search
from meshplan.search.space import Space

ROOT = Path(__file__).resolve().parents[2]
NAMES = frozenset(REGISTRY)
ALLOWED = {"meshplan/schedules/registry.py"}  # the records themselves
# (file, string): a schedule's spelling meaning something else
NOT_A_SCHEDULE = {("meshplan/cli/show_cmd.py", "csv")}  # the --csv file's JSON key


def _named(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return node.value
    return None


def misuses(path: str, source: str) -> list[str]:
    """One line per schedule name `source` compares (==, !=, in) or lists
    (a list, tuple or set element, a dict key), and per `Schedule.X`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        named: list[ast.AST | None] = []
        if isinstance(node, ast.Compare):
            named = [node.left, *node.comparators]
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            named = list(node.elts)
        elif isinstance(node, ast.Dict):
            named = list(node.keys)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "Schedule"):
            found.append(f"{path}:{node.lineno}: Schedule.{node.attr}")
        for n in named:
            name = _named(n)
            if name and (path, name) not in NOT_A_SCHEDULE:
                found.append(f"{path}:{node.lineno}: {type(node).__name__.lower()} "
                             f"names schedule {name!r}")
    return found


def test_no_module_but_the_registry_compares_or_lists_schedule_names():
    found = []
    for p in sorted((ROOT / "meshplan").rglob("*.py")):
        path = p.relative_to(ROOT).as_posix()
        if path not in ALLOWED:
            found += misuses(path, p.read_text())
    assert not found, "ask schedules.spec_of(name) instead:\n" + "\n".join(found)


def test_a_planted_comparison_in_the_search_is_found():
    path = "meshplan/search/space.py"
    source = (ROOT / path).read_text()
    planted = source + '\n\ndef odd(c):\n    return c.schedule == "zbv"\n'
    assert misuses(path, source) == []
    assert misuses(path, planted) == [
        f"{path}:{len(planted.splitlines())}: compare names schedule 'zbv'"]
    assert misuses("meshplan/search/x.py", 'VPPS = {"zbv": 2}\nS = ("1f1b", "gpipe")\n'
                   "k = Schedule.ZBV\n") == [
        "meshplan/search/x.py:1: dict names schedule 'zbv'",
        "meshplan/search/x.py:2: tuple names schedule '1f1b'",
        "meshplan/search/x.py:2: tuple names schedule 'gpipe'",
        "meshplan/search/x.py:3: Schedule.ZBV"]


def test_registry_facts():
    assert spec_of("zbv").vpps_to_search(4) == (2,)
    assert spec_of("interleaved").vpps_to_search(4) == (2, 3, 4)
    assert spec_of("zb1p").vpps_to_search(3) == (1, 2, 3)
    assert spec_of("gpipe").vpps_to_search(4) == spec_of("1f1b").vpps_to_search(4) == (1,)
    assert [n for n, s in REGISTRY.items() if s.splits_backward] == ["zb1p", "zbv"]
    assert not spec_of("csv").searched
    # interleaved at vpp 1 is 1F1B's order
    assert compute_actions("interleaved", 4, 1, 8, 1) == compute_actions("1f1b", 4, 1, 8, 1)


def schedule_lifo(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """A toy: GPipe's forwards, then the backwards last micro-batch first."""
    m = num_microbatches
    return ([Action(stage, ActionType.F, mb) for mb in range(m)]
            + [Action(stage, ActionType.B, mb) for mb in reversed(range(m))])


TOY = ScheduleSpec("lifo", schedule_lifo, chunks=1, live=lambda pp, m, stage: m)


def test_a_toy_schedule_is_one_record_through_plan_check_simulate_and_search():
    with registered(TOY):
        pp, m = 2, 4
        orders = {s: compute_actions("lifo", pp, 1, m, s) for s in range(pp)}
        lowered = add_comm(orders, pp, placement=placement_of("lifo", pp, 1))
        validate(lowered, pp, 1, m, placement=placement_of("lifo", pp, 1))
        assert simulate(lowered, pp).step_time > 0

        cfg = model_config("gpt", "tiny")
        job = plan_model("gpt", "tiny", Mesh(1, pp), zoo_strategy(
            "gpt", cfg, pp=pp, global_batch_size=m, schedule="lifo"), encode=False).job
        assert job.strategy.schedule == "lifo"
        plans = {r: lower(job, r) for r in range(pp)}
        assert [a for a in plans[0].actions if a.type.is_compute] == orders[0]
        assert check_plans(job, plans).ok

        res = search(ModelSpec("gpt", "tiny"), Mesh(1, pp), m, load_device_model("a100-80gb"),
                     prove=False,
                     space=Space(schedules=("lifo",), recompute=("none",), zero=(0,),
                                 micro_batch_sizes=(1,)))
        assert {r.cand.schedule for r in res.ranked if r.cand.pp > 1} == {"lifo"}
    assert "lifo" not in REGISTRY
