"""runtime/early_collectives.py: cross-entropy's count of targets is summed
over dp first in the forward, in the background, and waited where the plan
has it; a planted bug in it breaks equality with eager."""

from __future__ import annotations

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir import Phase
from meshplan.ir.kinds import ALL_REDUCE
from meshplan.ir.mesh import Mesh
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import TaskKind, template_of
from meshplan.models import build_model, model_config
from meshplan.runtime.early_collectives import EarlyCollectives
from tests.runtime._util import local_verdict

CFG = model_config("gpt", "tiny")


def _job(**fields):
    fields = {"dp": 4, "global_batch_size": 16, "micro_batch_size": 2} | fields
    s = zoo_strategy("gpt", CFG, **fields)
    return plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, optimizer="adamw").job


def _forward(job, rank: int) -> list:
    plan = lower(job, rank)
    return [t for t in plan.tasks if t.kind not in (TaskKind.SEND, TaskKind.RECV)
            and template_of(t)[1] is Phase.FORWARD]


def test_the_count_of_targets_is_reduced_first_and_waited_in_place():
    job = _job()
    g = job.graph
    tasks = _forward(job, 0)
    order, hooks, kernels = EarlyCollectives(job.view(0), comm=None).order(tasks)
    assert sorted(t.id for t in order) == sorted(t.id for t in tasks)
    (count,) = [t for t in tasks if t.kind is TaskKind.COLLECTIVE
                and g.ops[t.op].kind == ALL_REDUCE and t.op in kernels]
    chain = order[:3]  # the targets' view, the mask of kept targets, their sum
    kinds = [g.ops[t.op].kind for t in chain]
    assert kinds[1:] == ["aten.ne.Scalar", "aten.sum.default"], kinds
    (after,) = hooks  # the all-reduce starts right after the sum
    assert after == chain[-1].op and hooks[after][1] == [g.ops[count.op].args[0].id]
    # the rest, the all-reduce's own task (its wait) with it, keep their order
    assert order[3:] == [t for t in tasks if t not in chain] and count in order[3:]


def test_no_early_collective_without_dp():
    job = _job(dp=1, tp=2)
    order, hooks, kernels = EarlyCollectives(job.view(0), comm=None).order(_forward(job, 0))
    assert not hooks and not kernels


def _verdict() -> bool:
    return local_verdict(_job(), CFG, 16)


def test_a_count_not_reduced_breaks_equality(monkeypatch):
    """Planted: the early all-reduce leaves each rank its own count (threads
    run the ranks, so the patch reaches them)."""
    assert _verdict()

    def local_only(self, op_id, group, kind):
        def start(values):
            out = values[0].clone()
            self.flight[op_id] = (type("Done", (), {"wait": lambda _: True})(), out)
        return start

    monkeypatch.setattr(EarlyCollectives, "_starter", local_only)
    assert not _verdict()


def test_the_loss_is_reduced_in_the_background_and_a_planted_bug_shows(monkeypatch):
    """No op reads the loss, so its all-reduce is deferred to the step's end;
    planted: a deferred all-reduce that reduces nothing (each rank reports
    its own part of the loss)."""
    from meshplan.runtime import rank_executor
    from meshplan.runtime.local import local_ranks

    job = _job()
    _hub, ranks = local_ranks(job, build_model(CFG))
    (loss_reduce,) = {op for ex, _ in ranks for op in ex.deferred}
    assert job.graph.ops[loss_reduce].outputs == (job.graph.loss,)
    monkeypatch.setattr(rank_executor, "deferred_all_reduce",
                        lambda task, ctx, comm, pending: lambda x, **_: x.clone())
    assert not _verdict()
