"""A stage's view of a Job (ir/job.py): decoded from the bytes it equals the
one cut from the decoded Job; it holds every update of its stage (a tied
parameter's gradient has one update per stage, under one name), the data
inputs in batch order and the rank-wide scalars on every stage; and the
states a checkpoint's manifest lists are the Job's."""

from __future__ import annotations

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir import Role
from meshplan.ir.graph import LOSS_SCALE, RANK_WIDE
from meshplan.ir.job import JobReader
from meshplan.ir.mesh import Mesh
from meshplan.models import model_config

JOBS = {
    "tied pp2": (dict(pp=2), {"tie_embeddings": True}),
    "dp2 tp2 pp2 vpp2": (dict(dp=2, tp=2, pp=2, vpp=2, schedule="interleaved"), {}),
    "fp16 pp2": (dict(pp=2, precision="fp16"), {}),
}


def _job(name):
    fields, overrides = JOBS[name]
    cfg = model_config("gpt", "tiny", **overrides)
    s = zoo_strategy("gpt", cfg, global_batch_size=8, micro_batch_size=2, **fields)
    return plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, "adamw", **overrides).job


@pytest.mark.parametrize("name", list(JOBS))
def test_a_view_read_from_bytes_is_the_jobs_view(name):
    job = _job(name)
    reader = JobReader(job.to_bytes())
    for stage in range(job.strategy.pp):
        assert reader.view(stage) == job.view(stage)
    assert reader.states() == job.states()
    assert set(job.states()) == {v.name for v in job.graph.values
                                 if v.role in (Role.PARAM, Role.BUFFER, Role.OPT_STATE)}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_view_holds_its_stages_updates_data_order_and_rank_wide_scalars(name):
    job = _job(name)
    g = job.graph
    made_on = {o: job.stage[op.id] for op in g.ops for o in op.outputs if o >= 0}
    data = tuple(v.id for v in g.inputs_by_role(Role.DATA))
    rank_wide = {v for v in g.inputs if g.values[v].name in RANK_WIDE}
    for stage in range(job.strategy.pp):
        view = job.view(stage)
        mine = {(u.name, u.value) for u in g.updates if made_on.get(u.value) == stage}
        assert mine and mine <= set(view.finals.items())
        assert view.data == data and rank_wide <= set(view.values)
        assert [v.id for v in view.inputs_by_role(Role.DATA)] == \
            [v for v in data if v in view.values]
    names = [u.name for u in g.updates]
    if name == "tied pp2":  # the tied gradient: one update per stage, one name
        assert len(names) > len(set(names))
    if name == "fp16 pp2":
        assert any(g.values[v].name == LOSS_SCALE for v in rank_wide)
