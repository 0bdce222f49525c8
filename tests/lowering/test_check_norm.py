"""Proof 8: the gradient norm counts every trained parameter exactly once
(`lowering/check_norm.py`), and each planted bug of the issue fails it."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model
from meshplan.ir.kinds import ALL_REDUCE, GRAD_SQ
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.lowering.check import check_plans
from meshplan.lowering.check_norm import norm_coverage
from meshplan.lowering.lower import lower

CLIP = OptimizerConfig.of("adamw", max_grad_norm=1.0)
LAYERS = r"blocks\.\d+"
LAYOUTS = {
    "dp2·tp2·pp2·vpp2": (dict(dp=2, tp=2, pp=2, vpp=2, global_batch_size=8,
                              schedule="interleaved", layer_pattern=LAYERS), {}),
    "tied tp2·pp2": (dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2,
                          layer_pattern=LAYERS), {"tie_embeddings": True}),
    "zero3 dp4": (dict(dp=4, zero=3, global_batch_size=8), {}),
    "zero1 dp2·tp2": (dict(dp=2, tp=2, zero=1, global_batch_size=8), {}),
}


@cache
def job_of(name: str):
    fields, over = LAYOUTS[name]
    s = Strategy(**fields)
    return plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, CLIP, **over).job


def plans_of(job):
    return {r: lower(job, r) for r in range(job.mesh.world)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_norm_counts_every_parameter_once(name):
    job = job_of(name)
    res = check_plans(job, plans_of(job))
    assert res.ok, res.errors
    assert norm_coverage(job, plans_of(job)) == []


def test_a_tied_weight_counted_on_both_stages_fails():
    job = job_of("tied tp2·pp2")
    g = job.graph
    ops = tuple(replace(op, kwargs=tuple(kv for kv in op.kwargs if kv[0] != "counted"))
                if op.kind == GRAD_SQ else op for op in g.ops)
    bad = replace(job, graph=replace(g, ops=ops))
    errors = norm_coverage(bad, plans_of(bad))
    assert errors and all("counts 'wte.weight' more than once" in e for e in errors), errors


def test_a_tp_replicated_norm_weight_counted_by_every_tp_rank_fails():
    job = job_of("dp2·tp2·pp2·vpp2")
    g = job.graph
    victim = "blocks.0.ln1.weight"
    sq = next(op.id for op in g.ops if op.kind == GRAD_SQ
              and g.values[op.args[0].id].name == victim)
    plans = {r: replace(p, tasks=tuple(replace(t, variant=("",) * len(t.variant))
                                       if t.op == sq else t for t in p.tasks))
             for r, p in plans_of(job).items()}
    errors = norm_coverage(job, plans)
    assert errors and f"counts '{victim}' more than once" in errors[0], errors


def test_a_stage_left_out_of_the_norm_fails():
    job = job_of("dp2·tp2·pp2·vpp2")
    g = job.graph
    across = {op.id for op in g.ops if op.kind == ALL_REDUCE
              and dict(op.kwargs).get("param") == "optim@grad_norm"}
    assert len(across) == 2  # one per stage
    plans = {r: replace(p, tasks=tuple(replace(t, group=(r,)) if t.op in across else t
                                       for t in p.tasks))
             for r, p in plans_of(job).items()}
    errors = norm_coverage(job, plans)
    assert errors and "leaves out 'blocks." in errors[0], errors
    assert not check_plans(job, plans).ok


def test_a_partial_set_of_plans_skips_the_proof():
    job = job_of("zero3 dp4")
    res = check_plans(job, {0: lower(job, 0)})
    assert "gradient norm coverage" in res.skipped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=2,
                         max_size=2), min_size=1, max_size=8))
def test_overlap_by_cells_is_overlap_by_pairs(raw):
    """The cell sweep says two boxes share an element exactly when some pair does."""
    from meshplan.lowering.check_norm import _overlap
    boxes = [tuple((a, a + n) for a, n in box) for box in raw]
    pairs = any(all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))
                for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert _overlap(boxes) == pairs
