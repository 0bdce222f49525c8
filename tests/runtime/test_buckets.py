"""Gradient buckets: the step's reductions over dp coalesced, started in the
last micro-batch's backward, equal to eager; the check sees them where they
start; a bucket started before the gradients are final fails the run's
equality (planted)."""

from __future__ import annotations

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import verify
from meshplan.ir.mesh import Mesh
from meshplan.lowering.buckets import plan_buckets
from meshplan.lowering.check import check_plans, expand_collectives
from meshplan.lowering.lower import lower
from meshplan.models import model_config

TINY_BUCKETS = 0.2  # MiB: GPT tiny's 53 gradients in 5 buckets at dp=4


def _job(bucket_mb: float, **fields):
    fields = {"dp": 4, "global_batch_size": 8, "micro_batch_size": 1} | fields
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), bucket_mb=bucket_mb, **fields)
    return plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, optimizer="adamw").job


def test_buckets_are_bounded_and_in_backward_order():
    job = _job(TINY_BUCKETS)
    plan = lower(job, 0)
    buckets = plan_buckets(job, plan)
    assert len(buckets) == 5 and sum(len(b.ops) for b in buckets) == 53
    size = {b.value: b.nbytes for b in plan.buffers}
    assert all(sum(size[s] for s in b.sources) <= TINY_BUCKETS * 2**20 for b in buckets)
    order = [t.op for t in plan.tasks]
    afters = [order.index(b.after) for b in buckets]
    assert afters == sorted(afters)  # each starts as soon as the backward completes it
    assert plan_buckets(_job(0), lower(_job(0), 0)) == ()
    assert plan_buckets(_job(25, precision="fp16"), lower(_job(25, precision="fp16"), 0)) == ()


def test_the_check_orders_buckets_where_they_start():
    job = _job(TINY_BUCKETS)
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    where = job.strategy.stage_placement
    seq = expand_collectives(plans[0], where, job.graph.ops, plan_buckets(job, plans[0]))
    (group,) = seq
    buckets = [(k, item) for k, item in enumerate(seq[group]) if isinstance(item[0], tuple)]
    assert [item[0][0] for _, item in buckets] == ["bucket"] * 5
    assert all(mb == job.strategy.num_microbatches - 1 for _, (_, mb) in buckets)
    # bucketed reductions are no longer in the STEP: 53 fewer single collectives
    assert len(seq[group]) == len(expand_collectives(plans[0], where, job.graph.ops)[group]) \
        - 53 + 5


@pytest.mark.parametrize("fields", [dict(), dict(zero=1), dict(dp=2, pp=2, vpp=2,
                                                                schedule="zb1p")])
def test_equal_to_eager_with_buckets(fields):
    job = _job(TINY_BUCKETS, **fields)
    s = job.strategy
    r = verify("gpt", "tiny", steps=3, mesh=job.mesh, strategy=s, optimizer="adamw")
    assert r["ok"], r["problems"]
    assert r["max_abs_diff"] <= 1e-5


def _local_verdict() -> bool:
    """GPT tiny at dp=4, 4 micro-batches, ranks on threads, against eager."""
    import torch

    from meshplan.api import optimizer_of
    from meshplan.driver.verify import against_eager
    from meshplan.models import build_model, example_batch
    from meshplan.runtime.local import run_local

    job = _job(TINY_BUCKETS, global_batch_size=16, micro_batch_size=2)
    cfg = model_config("gpt", "tiny")
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, 16, seed=i) for i in range(2)]
    mine = run_local(job, module, batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches,
                               job.strategy.num_microbatches, optimizer_of(job))
    return verdict["ok"]


def test_a_bucket_started_early_breaks_equality(monkeypatch):
    """Planted: start every bucket in the first micro-batch's backward, before
    the gradients are final (threads run the ranks, so the patch reaches them)."""
    from meshplan.runtime.grad_buckets import GradBuckets

    assert _local_verdict()
    monkeypatch.setattr(GradBuckets, "start_step", lambda self, m: (
        setattr(self, "microbatches", 1), self.runs.clear()))
    assert not _local_verdict()


def test_the_check_fails_when_members_bucket_differently(monkeypatch):
    """Planted: rank 1 forms its buckets with another bound than the others."""
    import meshplan.lowering.check as check
    from meshplan.lowering.buckets import grad_buckets

    def uneven(job, plan):
        size = {b.value: b.nbytes for b in plan.buffers}
        bound = 2**16 if plan.rank == 1 else int(TINY_BUCKETS * 2**20)
        return grad_buckets(job.graph, plan.tasks, bound, size.__getitem__)

    monkeypatch.setattr(check, "plan_buckets", uneven)
    job = _job(TINY_BUCKETS)
    res = check_plans(job, {r: lower(job, r) for r in range(4)})
    assert any("collective order differs" in e for e in res.errors), res.errors
