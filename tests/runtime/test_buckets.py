"""Gradient buckets: the step's reductions over dp coalesced, started in the
last micro-batch's backward, and (ZeRO 2 and 3) each micro-batch's gradient
reduce-scatters coalesced, started in its backward, equal to eager; the
check sees them where they start; a bucket started before the gradients are
final fails the run's equality, and a misplaced one the check (planted)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.verify import verify
from meshplan.ir.mesh import Mesh
from meshplan.lowering.buckets import buckets_of
from meshplan.lowering.check import check_plans, expand_collectives
from meshplan.lowering.lower import lower
from meshplan.models import model_config
from meshplan.schedules import stage_placement
from tests.runtime._util import local_verdict

TINY_BUCKETS = 0.2  # MiB: GPT tiny's 53 gradients in 4 buckets at dp=4


def _job(bucket_mb: float, **fields):
    fields = {"dp": 4, "global_batch_size": 8, "micro_batch_size": 1} | fields
    s = zoo_strategy("gpt", model_config("gpt", "tiny"), bucket_mb=bucket_mb, **fields)
    return plan_model("gpt", "tiny", Mesh(1, s.dp * s.tp * s.pp), s, optimizer="adamw").job


def test_buckets_are_bounded_and_in_backward_order():
    job = _job(TINY_BUCKETS)
    plan = lower(job, 0)
    buckets = buckets_of(job, plan)
    assert len(buckets) == 4 and sum(len(b.ops) for b in buckets) == 53
    size = {b.value: b.nbytes for b in plan.buffers}
    assert _close_at_the_bound(buckets, size)
    order = [t.op for t in plan.tasks]
    afters = [order.index(b.after) for b in buckets]
    assert afters == sorted(afters)  # each starts as soon as the backward completes it
    assert buckets_of(_job(0), lower(_job(0), 0)) == ()
    assert buckets_of(_job(25, precision="fp16"), lower(_job(25, precision="fp16"), 0)) == ()


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_rank_plans_carry_their_buckets_run_order_and_gathers(zero):
    """What the runtime runs is lowered into the plan and read back from its
    file: the buckets the Job implies, the order buckets move tasks into, and
    (ZeRO 3) the gathers a layer ahead; no rank works them out again."""
    from meshplan.lowering.buckets import run_order
    from meshplan.lowering.files import through_files
    from meshplan.lowering.prefetch import gather_groups

    job = _job(TINY_BUCKETS, zero=zero)
    for rank in range(4):
        plan = lower(job, rank)
        ops = job.graph.ops.__getitem__
        assert plan.buckets and plan.buckets == buckets_of(job, plan)
        moved = [t.id for t in run_order(plan.tasks, plan.buckets, ops)]
        assert (plan.run_ids or tuple(t.id for t in plan.tasks)) == tuple(moved)
        assert bool(plan.run_ids) == (zero >= 2)  # per-micro-batch buckets move tasks
        groups = gather_groups(plan.tasks, ops, job.graph.values, job.strategy.layer_pattern)
        assert dict(plan.gathers) == ({k: tuple(tuple(t.op for t in g) for g in v)
                                       for k, v in groups.items()} if zero == 3 else {})
        assert through_files(plan, job) == plan


def _close_at_the_bound(buckets, size) -> bool:
    """Each bucket closes once its values reach the bound, as DDP's: it is
    under the bound without its last value, and at or over it (but the last)."""
    cap = TINY_BUCKETS * 2**20
    sums = [sum(size[s] for s in b.sources) for b in buckets]
    return all(n - size[b.sources[-1]] < cap for n, b in zip(sums, buckets)) and \
        all(n >= cap for n in sums[:-1])


@pytest.mark.parametrize("zero", [0, 3])
def test_the_first_bucket_is_bounded_by_ddp_s_1_mib(zero):
    """GPT small's gradients (26 MiB) at the default 25 MiB: the first bucket
    closes at 1 MiB (its head's gradient alone), the rest reach 25 MiB: two
    buckets, as DDP's, the embedding's gradient (made last) in the second."""
    s = zoo_strategy("gpt", model_config("gpt", "small"), dp=4, global_batch_size=16,
                     micro_batch_size=2, zero=zero)
    job = plan_model("gpt", "small", Mesh(1, 4), s, optimizer="adamw").job
    plan = lower(job, 0)
    size = {b.value: b.nbytes for b in plan.buffers}
    buckets = buckets_of(job, plan)
    sizes = [sum(size[v] for v in b.sources) for b in buckets]
    assert len(buckets) == 2 and sizes[0] == 2**20 == size[buckets[0].sources[0]]
    assert sizes[1] >= 25 * 2**20 > sizes[1] - size[buckets[1].sources[-1]]
    made = job.graph.ops[buckets[1].after]  # the embedding's gradient: made last
    assert (made.kind == "aten.embedding_dense_backward.default" if zero else
            {u.value: u.name for u in job.graph.updates}[made.outputs[0]] == "wte.weight@grad")
    assert sum(len(b.ops) for b in buckets) == 101


def test_the_check_orders_buckets_where_they_start():
    job = _job(TINY_BUCKETS)
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    where = stage_placement(job.strategy)
    seq = expand_collectives(plans[0], where, job.graph.ops, buckets_of(job, plans[0]))
    (group,) = seq
    buckets = [(k, item) for k, item in enumerate(seq[group]) if isinstance(item[0], tuple)]
    assert [item[0][0] for _, item in buckets] == ["bucket"] * 4
    assert all(mb == job.strategy.num_microbatches - 1 for _, (_, mb) in buckets)
    # bucketed reductions are no longer in the STEP: 53 fewer single collectives
    assert len(seq[group]) == len(expand_collectives(plans[0], where, job.graph.ops)[group]) \
        - 53 + 4


@pytest.mark.parametrize("fields", [dict(), dict(zero=1), dict(zero=2), dict(zero=3),
                                    dict(dp=2, pp=2, vpp=2, schedule="zb1p"),
                                    dict(dp=2, pp=2, vpp=2, schedule="zb1p", zero=2)])
def test_equal_to_eager_with_buckets(fields):
    job = _job(TINY_BUCKETS, **fields)
    s = job.strategy
    r = verify("gpt", "tiny", steps=3, mesh=job.mesh, strategy=s, optimizer="adamw")
    assert r["ok"], r["problems"]
    assert r["max_abs_diff"] <= 1e-5


def _local_verdict() -> bool:
    """GPT tiny at dp=4, 4 micro-batches, ranks on threads, against eager."""
    job = _job(TINY_BUCKETS, global_batch_size=16, micro_batch_size=2)
    return local_verdict(job, model_config("gpt", "tiny"), 16)


def test_a_bucket_started_early_breaks_equality(monkeypatch):
    """Planted: start every bucket in the first micro-batch's backward, before
    the gradients are final (threads run the ranks, so the patch reaches them)."""
    from meshplan.runtime.grad_buckets import GradBuckets

    assert _local_verdict()
    monkeypatch.setattr(GradBuckets, "start_step", lambda self, m, into=None: (
        setattr(self, "microbatches", 1), self.runs.clear()))
    assert not _local_verdict()


def test_a_step_bucket_keeps_its_flat_tensor(monkeypatch):
    """A STEP bucket copies into the same flat tensor every step (a fresh one
    cost a rank first-touch page faults on every byte), and the run still
    equals eager; per-micro-batch buckets (ZeRO 2, 3) take a fresh one."""
    from meshplan.runtime.grad_buckets import GradBuckets

    real, seen = GradBuckets._flat, {}

    def spy(self, i, grads, keep):
        flat = real(self, i, grads, keep)
        seen.setdefault((id(self), i, keep), []).append(flat)  # held: no address reuse
        return flat
    monkeypatch.setattr(GradBuckets, "_flat", spy)
    assert _local_verdict()  # two steps
    kept = [flats for (_, _, keep), flats in seen.items() if keep]
    assert len(kept) == 4 * 4 and all(len(f) == 2 and f[0] is f[1] for f in kept)


@pytest.mark.parametrize("microbatches", [1, 2, 3])
@pytest.mark.parametrize("planted", [False, True])
def test_accumulators_are_written_into_their_bucket(monkeypatch, microbatches, planted):
    """From the second micro-batch on (or with one, the only one) a STEP
    bucket's accumulators add into their slots of its flat tensor: the
    bucket starts with every value in place, nothing to copy, and the run
    equals eager. Planted: accumulating as without buckets (the values are
    then copied at the start) is seen, and still equals eager."""
    from meshplan.ops.kernels import accumulate_grad
    from meshplan.runtime.grad_buckets import GradBuckets

    real, placed = GradBuckets._flat, []

    def spy(self, i, grads, keep):
        if keep:
            flat, off = self.flats.get(i), self.offsets[i]
            placed.append(flat is not None and all(
                g.data_ptr() == flat.data_ptr() + off[k] * flat.element_size()
                for k, g in enumerate(grads)))
        return real(self, i, grads, keep)
    monkeypatch.setattr(GradBuckets, "_flat", spy)
    if planted:
        monkeypatch.setattr(GradBuckets, "_accumulate",
                            lambda self, i, k, acc, g, **_: accumulate_grad(acc, g))
    job = _job(TINY_BUCKETS, global_batch_size=4 * microbatches)
    assert job.strategy.num_microbatches == microbatches
    assert local_verdict(job, model_config("gpt", "tiny"), 4 * microbatches)
    assert len(placed) == 2 * 4 * 4  # two steps, four ranks, four buckets
    assert all(placed) if not planted else not any(placed)


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("planted", [False, True])
def test_the_memory_plan_counts_a_bucket_as_its_accumulators_second_copy(
        monkeypatch, microbatches, planted):
    """Every accumulator of GPT tiny at zero 0 is written into its STEP
    bucket's slot, so the plan's gradient bytes are the accumulators once
    per copy a step holds: two with several micro-batches (the adopted
    first gradient, the flat tensor), one with a single micro-batch (the
    flat tensor). Planted: no accumulator writes its slot; the flat
    tensors then count on top, and the figures are off by one copy."""
    import meshplan.lowering.buckets as bk
    from meshplan.lowering.rankplan import BufferCategory

    if planted:
        monkeypatch.setattr(bk, "writes_slot", lambda *_: -1)
    job = _job(TINY_BUCKETS, global_batch_size=4 * microbatches)
    plan = lower(job, 0)
    accumulators = sum(b.nbytes for b in plan.buffers if b.category == BufferCategory.GRAD)
    copies = 2 if microbatches > 1 else 1
    assert (dict(plan.memory.peak)["grad"] == copies * accumulators) != planted
    assert all(op >= 0 for b in buckets_of(job, plan) for op in b.slots) != planted


@pytest.mark.parametrize("zero", [0, 2])
def test_the_check_fails_when_members_bucket_differently(monkeypatch, zero):
    """Planted: rank 1's plan carries buckets formed with another bound than
    the others'."""
    from meshplan.lowering.buckets import grad_buckets

    def uneven(job, plan):
        size = {b.value: b.nbytes for b in plan.buffers}
        bound = 2**16 if plan.rank == 1 else int(TINY_BUCKETS * 2**20)
        g = job.graph
        return grad_buckets(plan.tasks, g.ops.__getitem__, g.values,
                            {u.name: u.value for u in g.updates}, bound, size.__getitem__)

    job = _job(TINY_BUCKETS, zero=zero)
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    plans[1] = replace(plans[1], buckets=uneven(job, plans[1]))
    res = check_plans(job, plans)
    assert any("collective order differs" in e for e in res.errors), res.errors
    assert any("rank 1: its plan's gradient buckets" in e for e in res.errors), res.errors


# ---------------------------------------------- per micro-batch (ZeRO 2 and 3)
def test_zero2_buckets_each_microbatch_reduce_scatters():
    from meshplan.ir.kinds import REDUCE_SCATTER

    job = _job(TINY_BUCKETS, zero=2)
    plan = lower(job, 0)
    buckets = _microbatch(buckets_of(job, plan))
    ops = job.graph.ops
    scatters = [t.op for t in plan.tasks if ops[t.op].kind == REDUCE_SCATTER]
    assert len(scatters) == 53  # one a gradient, in the backward
    assert len(buckets) == 4 and all(b.every_run for b in buckets)
    assert sorted(op for b in buckets for op in b.ops) == sorted(scatters)
    # each carries the gradients its reduce-scatters read, within the bound
    size = {b.value: b.nbytes for b in plan.buffers}
    assert all([ops[o].args[0].id for o in b.ops] == list(b.sources) for b in buckets)
    assert _close_at_the_bound(buckets, size)
    assert not _microbatch(buckets_of(_job(TINY_BUCKETS, zero=1),
                                        lower(_job(TINY_BUCKETS, zero=1), 0)))


def _microbatch(buckets) -> list:
    """The buckets of a micro-batch's reduce-scatters."""
    from meshplan.ir.kinds import ALL_REDUCE

    return [b for b in buckets if b.every_run and b.kind == ALL_REDUCE]


def test_a_bucket_s_reductions_run_after_the_next_bucket_starts():
    """run_order: bucket k's reduce-scatters, and the accumulations reading
    them, run after bucket k+1's last gradient is made (the last bucket's at
    the end of the backward), so at most two flat copies are alive."""
    from meshplan.ir.kinds import ACCUMULATE_GRAD
    from meshplan.lowering.buckets import run_order

    job = _job(TINY_BUCKETS, zero=2)
    plan = lower(job, 0)
    everything = buckets_of(job, plan)
    buckets = _microbatch(everything)
    ops = job.graph.ops
    order = [t.op for t in run_order(plan.tasks, everything, ops.__getitem__)]
    assert sorted(order) == sorted(t.op for t in plan.tasks)
    at = order.index
    backward = [t.op for t in plan.tasks if t.phase.value == "backward"]
    ends = [at(b.after) for b in buckets[1:]] + [max(at(op) for op in backward
                                                     if ops[op].kind != ACCUMULATE_GRAD
                                                     and op not in buckets[-1].ops)]
    for b, end in zip(buckets, ends):
        for op in b.ops:
            (acc,) = [o for o in backward if ops[op].outputs[0] in ops[o].refs()]
            assert end < at(op) < at(acc), (b.ops, op)


def test_the_check_orders_microbatch_buckets_in_every_microbatch():
    job = _job(TINY_BUCKETS, zero=2)
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    where = stage_placement(job.strategy)
    seq = expand_collectives(plans[0], where, job.graph.ops, buckets_of(job, plans[0]))
    (group,) = seq
    m = job.strategy.num_microbatches
    scatters = len(_microbatch(buckets_of(job, plans[0])))
    gathers = len(buckets_of(job, plans[0])) - scatters  # the STEP's (`test_step_gathers_...`)
    buckets = [item for item in seq[group] if isinstance(item[0], tuple)]
    assert sorted(mb for _, mb in buckets) == sorted(list(range(m)) * scatters + [-1] * gathers)
    # 53 fewer reduce-scatters a micro-batch, a bucket each more; the STEP's 53 gathers in buckets
    assert len(seq[group]) == len(expand_collectives(plans[0], where, job.graph.ops)[group]) \
        - (53 - scatters) * m - (53 - gathers)


@pytest.mark.parametrize("zero", [1, 2])
def test_step_gathers_of_updated_shards_travel_in_buckets(zero):
    """ZeRO 1 and 2: the STEP's all-gathers of updated parameter shards in
    buckets bounded by their gathered bytes, each gather run after the next
    bucket starts (the last bucket's at the STEP's end)."""
    from dataclasses import replace

    from meshplan.ir.kinds import ALL_GATHER
    from meshplan.lowering.buckets import run_order

    job = _job(TINY_BUCKETS, zero=zero)
    plan = lower(job, 0)
    ops = job.graph.ops
    everything = buckets_of(job, plan)
    buckets = [b for b in everything if b.kind == ALL_GATHER]
    gathers = [t.op for t in plan.tasks if ops[t.op].kind == ALL_GATHER]
    assert len(gathers) == 53 and sorted(o for b in buckets for o in b.ops) == sorted(gathers)
    assert all(b.every_run and b.template[1].value == "optimizer" for b in buckets)
    size = {b.value: b.nbytes for b in plan.buffers}
    gathered = [replace(b, sources=tuple(ops[o].outputs[0] for o in b.ops)) for b in buckets]
    assert _close_at_the_bound(gathered, size)
    order = [t.op for t in run_order(plan.tasks, everything, ops.__getitem__)]
    at = order.index
    for b, nxt in zip(buckets, buckets[1:] + [None]):
        end = at(nxt.after) if nxt else max(at(t.op) for t in plan.tasks
                                            if t.phase.value == "optimizer"
                                            and ops[t.op].kind != ALL_GATHER)
        assert all(end < at(o) for o in b.ops)


@pytest.mark.parametrize("plant", ["start early", "reduce early"])
def test_the_check_fails_on_a_misplaced_microbatch_bucket(monkeypatch, plant):
    """Planted: a bucket starts after its first gradient is made, not its
    last; or its reductions run where they were, before the bucket starts."""
    import meshplan.lowering.buckets as bk

    job = _job(TINY_BUCKETS, zero=2)
    plans = {r: lower(job, r) for r in range(4)}
    assert check_plans(job, plans).ok
    if plant == "start early":
        made = {o: t.op for t in plans[0].tasks for o in job.graph.ops[t.op].outputs}
        plans[0] = replace(plans[0], buckets=tuple(
            replace(b, after=made[b.sources[0]]) for b in plans[0].buckets))
        want = "starts after op"
    else:
        monkeypatch.setattr(bk, "run_order", lambda tasks, buckets, op_of: list(tasks))
        want = "runs before that"
    res = check_plans(job, plans)
    assert any(want in e for e in res.errors), res.errors
