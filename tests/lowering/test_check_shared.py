"""Proof 5 (lowering/check_shared.py): every copy of a tied weight takes the same
update. A tied GPT at tp=2 pp=2 passes; plans that leave a copy stale, give
copies different optimizer ops, or skip the cross-stage all-reduce fail."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.lowering.check import check_plans
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import TaskKind
from meshplan.models import model_config

TIED = "wte.weight"


@pytest.fixture(scope="module")
def tied():
    cfg = model_config("gpt", "tiny", tie_embeddings=True)
    s = zoo_strategy("gpt", cfg, tp=2, pp=2, global_batch_size=8, micro_batch_size=2)
    job = plan_model("gpt", "tiny", Mesh(1, 4), s, tie_embeddings=True).job
    return job, {r: lower(job, r) for r in range(4)}


def _opt_tasks(job, plan):
    return [t for t in plan.tasks if t.kind is TaskKind.OPTIMIZER
            and job.graph.values[job.graph.ops[t.op].args[0].id].name == TIED]


def test_tied_plans_pass(tied):
    job, plans = tied
    res = check_plans(job, plans)
    assert res.ok, res.errors
    assert all(len(_opt_tasks(job, p)) == 1 for p in plans.values())  # a copy per rank


def _errors(job, plans) -> list[str]:
    res = check_plans(job, plans)
    assert not res.ok
    return res.errors


def test_a_stale_copy(tied):
    job, plans = tied
    last = plans[3]
    (t,) = _opt_tasks(job, last)
    broken = dict(plans) | {3: replace(last, tasks=tuple(x for x in last.tasks if x != t))}
    errors = _errors(job, broken)
    assert any("rank 3 (stage 1) reads parameter 'wte.weight'" in e and "stale" in e
               for e in errors)


def test_copies_with_different_optimizer_ops(tied):
    job, plans = tied
    (t,) = _opt_tasks(job, plans[3])
    ops = list(job.graph.ops)
    kw = tuple((k, 0.5 if k == "lr" else v) for k, v in ops[t.op].kwargs)
    ops[t.op] = replace(ops[t.op], kwargs=kw)
    bad = replace(job, graph=replace(job.graph, ops=tuple(ops)))
    errors = _errors(bad, plans)
    assert any("take different optimizer ops" in e for e in errors)


def test_a_copy_whose_gradient_skips_the_cross_stage_reduction(tied):
    job, plans = tied
    p = plans[1]
    drop = [t for t in p.tasks if t.kind is TaskKind.GRAD_REDUCE
            and "stages" in dict(job.graph.ops[t.op].kwargs)]
    assert drop
    broken = dict(plans) | {1: replace(p, tasks=tuple(t for t in p.tasks if t not in drop))}
    errors = _errors(job, broken)
    assert any("does not run over the copies' ranks" in e for e in errors)
