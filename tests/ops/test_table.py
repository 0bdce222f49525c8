"""The op rule table is the one source of op facts: every kind meshplan emits
has its rule, each kind string is written once (`ir/kinds.py`), and lowering
takes an op's category from its rule."""

import ast
from pathlib import Path

import pytest

from meshplan.errors import CaptureError
from meshplan.ir import kinds
from meshplan.ir.kinds import (
    ACCUMULATE_GRAD,
    ADAMW,
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    CLIP_COEF,
    DROPOUT,
    GRAD_SQ,
    GRAD_SUM,
    LOCAL_PARTIAL,
    LOCAL_SLICE,
    RANDOM,
    RANDOM_LIKE,
    REDUCE_SCATTER,
    SGD,
    SQ_SUM,
    TRANSFER,
    VJP,
)
from meshplan.lowering.rankplan import TaskKind
from meshplan.ops.rule import Category
from meshplan.ops.table import meshplan_kinds, rule_for
from tests.lowering.jobs import job_of, plans_of

ROOT = Path(__file__).resolve().parents[2]
KINDS = {v for k, v in vars(kinds).items() if k.isupper() and k != "PREFIX"}

# What each meshplan op is, written here independently of the table.
CATEGORY = {
    GRAD_SUM: Category.COMPUTE, ACCUMULATE_GRAD: Category.COMPUTE, VJP: Category.COMPUTE,
    SGD: Category.OPTIMIZER, ADAMW: Category.OPTIMIZER,
    GRAD_SQ: Category.COMPUTE, SQ_SUM: Category.COMPUTE, CLIP_COEF: Category.COMPUTE,
    ALL_REDUCE: Category.COLLECTIVE, REDUCE_SCATTER: Category.COLLECTIVE,
    ALL_GATHER: Category.COLLECTIVE, ALL_TO_ALL: Category.COLLECTIVE,
    LOCAL_SLICE: Category.LOCAL_SLICE, LOCAL_PARTIAL: Category.LOCAL_SLICE,
    TRANSFER: Category.TRANSFER,
    DROPOUT: Category.COMPUTE, RANDOM_LIKE: Category.COMPUTE, RANDOM: Category.COMPUTE,
    kinds.ROUTED_EXPERTS: Category.COMPUTE, kinds.ROUTED_EXPERTS_BACKWARD: Category.COMPUTE,
}
# the meshplan ops autodiff differentiates, by their rules' gradients
DIFFERENTIABLE = {DROPOUT, kinds.ROUTED_EXPERTS}


def test_every_meshplan_kind_has_its_own_rule():
    assert KINDS == meshplan_kinds() == set(CATEGORY)
    for kind in KINDS:
        rule = rule_for(kind)
        assert rule.kind == kind and rule.differentiable == (kind in DIFFERENTIABLE)
        assert rule.category is CATEGORY[kind], kind


def test_a_kind_outside_the_table_is_refused():
    with pytest.raises(CaptureError, match="neither an aten op nor a meshplan op"):
        rule_for(kinds.PREFIX + "no_such_op")


def test_every_kind_a_compiled_job_holds_has_a_rule():
    """Across the zoo's parallel layouts (tp, pp, vpp, uneven shards, a tied
    weight, convolutions): every op's kind has a rule, meshplan's own ones
    listed in the table."""
    seen = set()
    for name in ("gpt_2x4", "gpt_uneven", "gpt_tied_dp4", "resnet_1x4"):
        seen |= {op.kind for op in job_of(name).graph.ops}
    for kind in seen:
        assert rule_for(kind).kind == kind
    ours = {k for k in seen if k.startswith(kinds.PREFIX)}
    assert ours <= meshplan_kinds()
    assert {GRAD_SUM, ACCUMULATE_GRAD, SGD, ALL_REDUCE, TRANSFER} <= ours, ours


def _kind_strings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in KINDS]


def test_each_kind_string_is_written_once():
    found = {p.relative_to(ROOT).as_posix(): _kind_strings(p)
             for p in sorted((ROOT / "meshplan").rglob("*.py"))}
    outside = {p: s for p, s in found.items() if s and p != "meshplan/ir/kinds.py"}
    assert not outside, f"kind strings outside meshplan/ir/kinds.py: {outside}"
    assert sorted(found["meshplan/ir/kinds.py"]) == sorted(KINDS)


def test_lowering_takes_each_task_kind_from_the_op_category():
    """A collective lowers to a collective task (a gradient reduction in the
    optimizer phase), an optimizer op to an optimizer task, a transfer (pp > 1)
    to sends and receives, every other op to compute."""
    job = job_of("gpt_2x4")
    ops = job.graph.ops
    checked = set()
    for plan in plans_of("gpt_2x4").values():
        for task in plan.tasks:
            op = ops[task.op]
            want = {Category.COLLECTIVE: {TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE},
                    Category.OPTIMIZER: {TaskKind.OPTIMIZER},
                    Category.TRANSFER: {TaskKind.SEND, TaskKind.RECV},
                    }.get(CATEGORY.get(op.kind), {TaskKind.COMPUTE})
            assert task.kind in want, (op.kind, task.kind)
            checked.add(task.kind)
    assert checked == set(TaskKind), checked


def test_mutates_knows_schemas_and_hidden_buffer_writes():
    assert rule_for("aten.add_.Tensor").mutates and rule_for("aten.copy_.default").mutates
    assert rule_for("aten.batch_norm.default").mutates  # running stats, unannounced
    assert not rule_for("aten.add.Tensor").mutates
    assert not rule_for("aten.slice_scatter.default").mutates
