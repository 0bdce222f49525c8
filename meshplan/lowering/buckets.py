"""Gradient buckets: the step's gradient reductions over dp, coalesced and
started during the backward, as DDP does.

Invariants:
- Bucketed are the STEP's reductions of a gradient accumulator over a grid
  axis (`bucketable`: an all-reduce sum or a reduce-scatter; not the
  all-reduce across the stages holding copies of a tied weight). Each
  reduces the accumulator's final value, which the last micro-batch's
  `accumulate_grad` makes (the Update that writes the accumulator).
- A bucket holds reductions whose final values are made in one task group
  (a chunk's backward, or its weight phase), over one group, of one dtype,
  in the order those values are made; it closes before the reduction that
  would take it past `bucket_bytes` (a reduction larger than that is a bucket
  of its own). Every rank of a dp group builds the same buckets from the
  same plan, so they issue the same collectives in the same order.
- At run time, right after the op that makes a bucket's last value, and only
  in the group's last run of the step (the last micro-batch), the values are
  copied into one flat tensor and all-reduced asynchronously (gloo runs it
  on its own thread, overlapping the rest of the backward); the STEP's
  reduction kernels wait for it and read their slice (a reduce-scatter its
  own part of it).
- Off for fp16 (the STEP unscales the accumulators before reducing them)
  and with `bucket_mb == 0`. The memory plan counts the flat copies, alive
  from their bucket's start to the STEP, as gradient bytes.
- Computed here, from a rank's plan, and used by the runtime
  (`runtime/rank_executor.py`) and the memory plan alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.ir import Op, Phase
from meshplan.ir.choices import Precision
from meshplan.ir.kinds import ALL_REDUCE, REDUCE_SCATTER
from meshplan.lowering.rankplan import RankPlan, TaskKind, template_of


def bucketable(op: Op) -> bool:
    """A STEP reduction over one grid axis that buckets can carry."""
    kw = dict(op.kwargs)
    return (op.phase is Phase.OPTIMIZER and "stages" not in kw and
            (op.kind == REDUCE_SCATTER or op.kind == ALL_REDUCE and kw.get("op") == "sum"))


@dataclass(frozen=True, slots=True)
class Bucket:
    """Reductions (STEP op ids) carried by one flat all-reduce."""

    group: tuple[int, ...]
    ops: tuple[int, ...]          # the STEP reductions, in the order their values are made
    sources: tuple[int, ...]      # per reduction: the value its accumulator's last update is
    after: int                    # the op that makes the last source: the bucket is full
    template: tuple               # the task group that op runs in


def plan_buckets(job, plan: RankPlan) -> tuple[Bucket, ...]:
    """The buckets of `plan` (rank `plan.rank` of `job`); () when off."""
    s = job.strategy
    if s.bucket_mb <= 0 or s.precision == Precision.FP16:
        return ()
    nbytes = {b.value: b.nbytes for b in plan.buffers}
    return grad_buckets(job.graph, plan.tasks, int(s.bucket_mb * 2**20), nbytes.__getitem__)


def bucketed_bytes(op_of, tasks, buffers, strategy) -> int:
    """What the flat copies of a rank's bucketable reductions take (the memory
    plan's share of them): their inputs' local bytes."""
    if strategy.bucket_mb <= 0 or strategy.precision == Precision.FP16:
        return 0
    size = {b.id: b.nbytes for b in buffers}
    return sum(size[t.inputs[0]] for t in tasks if t.kind is TaskKind.GRAD_REDUCE
               and len(t.group) > 1 and bucketable(op_of(t.op)))


def grad_buckets(graph, tasks, bucket_bytes: int, local_bytes) -> tuple[Bucket, ...]:
    """This rank's buckets. `tasks`: its plan's tasks; `local_bytes(vid)` a
    value's bytes on this rank."""
    final = {u.name: u.value for u in graph.updates}
    updated = set(final.values())
    made_by: dict[int, tuple] = {}  # value -> (op id, template)
    for t in tasks:
        for o in graph.ops[t.op].outputs:
            if o >= 0:
                made_by[o] = (t.op, template_of(t))
    order = {t.op: i for i, t in enumerate(tasks)}
    wanted = []
    for t in tasks:
        op = graph.ops[t.op]
        if t.kind is not TaskKind.GRAD_REDUCE or len(t.group) <= 1 or not bucketable(op):
            continue
        arg = op.args[0].id  # the accumulator's last update, or the accumulator itself
        source = arg if arg in updated else final.get(graph.values[arg].name)
        if source is None or source not in made_by:
            continue
        maker, template = made_by[source]
        dtype = graph.values[source].meta.dtype
        wanted.append(((template, t.group, dtype), order[maker], t.op, source, maker))
    buckets: list[Bucket] = []
    open_: dict[tuple, list] = {}
    for key, _, op_id, source, maker in sorted(wanted, key=lambda w: (w[1], w[2])):
        cur = open_.get(key)
        size = local_bytes(source)
        if cur is not None and cur[0] + size > bucket_bytes:
            buckets.append(_close(key, cur))
            cur = None
        if cur is None:
            cur = open_[key] = [0, [], [], -1]
        cur[0] += size
        cur[1].append(op_id)
        cur[2].append(source)
        cur[3] = maker
    buckets += [_close(key, cur) for key, cur in open_.items()]
    return tuple(sorted(buckets, key=lambda b: order[b.after]))


def _close(key: tuple, cur: list) -> Bucket:
    template, group, _ = key
    return Bucket(group, tuple(cur[1]), tuple(cur[2]), cur[3], template)
