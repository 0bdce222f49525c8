"""The ZeRO level is one enum: nothing outside `ir/zero.py` compares it with an int.

Invariants:
- `zero_comparisons` finds every comparison (==, !=, <, <=, >, >=, in, not in)
  of a name like the level (`zero`, `x.zero`, `zero_level`, `x["zero"]`)
  with an int literal, or a tuple/list/set/range of them; the tree has none
  outside `meshplan/ir/zero.py`, and a planted `strategy.zero == 3` is found.
- A level round-trips through the Job as the enum, and the Job's bytes are
  the int's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from meshplan.errors import ConfigError
from meshplan.ir.graph import Role
from meshplan.ir.mesh import Strategy
from meshplan.ir.zero import ZeroLevel

ROOT = Path(__file__).resolve().parents[2] / "meshplan"
HOME = Path("ir/zero.py")  # the one module that may compare a level with an int


def _names_zero(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = str(node.slice.value)
    elif isinstance(node, ast.Call) and node.args:  # f.get("zero", 0), ZeroLevel(z)
        return any(_names_zero(a) or isinstance(a, ast.Constant) and a.value == "zero"
                   for a in node.args)
    else:
        return False
    return name.lower() in ("zero", "z") or name.lower().startswith("zero_")


def _int_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _int_like(node.operand)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_int_like(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id == "range"
    return False


def zero_comparisons(source: str) -> list[int]:
    """Lines of `source` comparing a ZeRO-level name with ints."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for a, b in zip(sides, sides[1:]):
            if (_names_zero(a) and _int_like(b)) or (_names_zero(b) and _int_like(a)):
                out.append(node.lineno)
    return out


def test_no_zero_level_is_compared_with_an_int_outside_its_module():
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted(ROOT.rglob("*.py")) if path.relative_to(ROOT) != HOME
             for line in zero_comparisons(path.read_text())]
    assert not found, f"compare the ZeRO level through ZeroLevel (ir/zero.py): {found}"


@pytest.mark.parametrize("planted", [
    "if strategy.zero == 3:\n    pass\n",
    "x = cand.zero >= 2\n",
    "ok = s.zero not in (0, 1, 2, 3)\n",
    "ok = z in range(4)\n",
    "ok = 1 <= zero_level\n",
    "ok = f.get('zero', 0) > 0\n",
    "ok = out['zero'] > 3\n",
])
def test_a_planted_comparison_in_search_is_found(planted):
    # what a fake `search/` module would hold; the checker reads source only
    assert zero_comparisons("from meshplan.ir.mesh import Strategy\n" + planted) == [2]


def test_the_levels_answer_what_they_shard():
    shards = {z: {r for r in (Role.OPT_STATE, Role.GRAD, Role.PARAM) if z.shards(r)}
              for z in ZeroLevel}
    assert shards == {ZeroLevel.NONE: set(), ZeroLevel.OPTIMIZER: {Role.OPT_STATE},
                      ZeroLevel.GRADIENTS: {Role.OPT_STATE, Role.GRAD},
                      ZeroLevel.PARAMETERS: {Role.OPT_STATE, Role.GRAD, Role.PARAM}}
    assert [z.regathers for z in ZeroLevel] == [False, False, False, True]
    assert [z.reduce_scatters for z in ZeroLevel] == [False, False, True, True]
    assert [z.shards_optimizer for z in ZeroLevel] == [False, True, True, True]
    assert not ZeroLevel.PARAMETERS.shards(Role.DATA)


def test_a_strategy_holds_the_enum_and_encodes_the_int():
    s = Strategy(dp=2, zero=3)
    assert s.zero is ZeroLevel.PARAMETERS
    assert json.dumps({"zero": s.zero}) == json.dumps({"zero": 3})
    assert f"zero{s.zero}" == "zero3"
    with pytest.raises(ConfigError, match="zero=4 is not a ZeRO stage; use --zero 0"):
        Strategy(zero=4)


def test_a_job_round_trips_the_level_as_the_enum():
    from meshplan.driver.plan import plan_model, zoo_strategy
    from meshplan.ir.job import Job
    from meshplan.ir.mesh import Mesh
    from meshplan.models import model_config

    strategy = zoo_strategy("gpt", model_config("gpt", "tiny"), dp=2, global_batch_size=4,
                            zero=2)
    job = plan_model("gpt", "tiny", Mesh(1, 2), strategy, "adamw").job
    back = Job.from_bytes(job.to_bytes())
    assert back.strategy.zero is ZeroLevel.GRADIENTS
    assert back.to_bytes() == job.to_bytes() and back.digest() == job.digest()
    assert b'"zero": 2' in job.to_bytes() or b'"zero":2' in job.to_bytes()
