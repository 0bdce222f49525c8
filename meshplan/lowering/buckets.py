"""Gradient buckets: the data-parallel collectives of gradients (and of
updated parameter shards), coalesced and started as soon as their values
are made, as DDP (the STEP's all-reduces) and FSDP2 (each micro-batch's
reduce-scatters, each block's gathers) do.

Invariants:
- Three kinds of collectives are bucketed, never together:
  - the STEP's reductions of a gradient accumulator over a grid axis
    (`bucketable`: an all-reduce sum or a reduce-scatter; not the
    all-reduce across the stages holding copies of a tied weight). Each
    reduces the accumulator's final value, which the last micro-batch's
    `accumulate_grad` makes (the Update that writes the accumulator); its
    bucket starts in the task group's last run of the step only;
  - per micro-batch (ZeRO 2 and 3: the accumulator is sharded), the
    reduce-scatters P -> S of a micro-batch's gradient in the backward or
    weight phase whose result only `accumulate_grad` reads
    (`per_microbatch`); the value reduced is the gradient itself; the
    bucket starts in every run of its group;
  - the STEP's all-gathers of updated parameter shards (ZeRO 1 and 2,
    `gathers_update`), in one flat all-gather (`Comm.all_gather_many_async`).
- A bucket holds collectives whose values are made in one task group (a
  chunk's backward, or its weight phase, or the STEP), over one group, of
  one dtype, of one of the three kinds, in the order those values are
  made; it closes once its values reach `bucket_bytes` (an all-gather's,
  gathered), the first of each kind `min(1 MiB, bucket_bytes)`, as DDP's
  buckets do: the first values made start their collective early, and the
  last (the embedding's gradient, made at the very end of the backward)
  ride in the bucket before them, not alone in one of their own that
  would start last and queue behind it. Every rank of a dp group builds
  the same buckets from the same plan, so they issue the same collectives
  in the same order.
- At run time, right after the op that makes a bucket's last value, the
  values are in one flat tensor (copied there, but for the accumulators
  written into their slots: `writes_slot`), all-reduced (or all-gathered)
  asynchronously (gloo runs it on its own thread, overlapping the rest of
  the backward); the bucketed ops' kernels wait for it and take their
  slice (a reduce-scatter its own part of it). A STEP reduction runs in
  the STEP where it stands. Every other bucketed op runs, with every task
  of its group that reads its result (`run_order`), once the next bucket
  of its group has started, or after the rest of the group: the values it
  reads die at the bucket's start (the flat copy has them), the flat
  tensors when its last slice is taken. gloo's own reduce-scatter is no
  faster than an all-reduce: measured in torch 2.13, 4 processes, 6.9M
  floats: `reduce_scatter_tensor` 81 ms, `reduce_scatter` (a list) 52 ms,
  `all_reduce` 45 ms.
- Off for fp16 (the STEP unscales the accumulators before reducing them)
  and with `bucket_mb == 0`. The memory layout counts the STEP reductions'
  flat tensors, kept from step to step, as gradient bytes (for the
  accumulators written into their slots, as their second copy), and the
  other buckets' as transients, alive from their start until their ops
  run (`flat_intervals`).
- A STEP reduction's accumulator is written into its slot of the flat
  tensor (`writes_slot`: from the second micro-batch on, or the only one)
  when its last `accumulate_grad` makes the value reduced and nothing else
  reads it: the bucket then starts with no copy, reduced in place, as
  DDP's `gradient_as_bucket_view`.
- Computed here when a rank is lowered: `lower` puts a plan's buckets and
  the order they move its tasks into (`RankPlan.buckets`, `run_ids`) in the
  plan, which the runtime runs (`runtime/grad_buckets.py`); the checker
  proves them against `buckets_of` and the memory layout counts them.
"""

from __future__ import annotations

from meshplan.ir import Op, Phase
from meshplan.ir.choices import Precision
from meshplan.ir.kinds import ACCUMULATE_GRAD, ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from meshplan.lowering.rankplan import Bucket, RankPlan, TaskKind, template_of

FIRST_BUCKET_BYTES = 2**20  # DDP's (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)


def bucketable(op: Op) -> bool:
    """A STEP reduction over one grid axis that buckets can carry."""
    kw = dict(op.kwargs)
    return (op.phase is Phase.OPTIMIZER and "stages" not in kw and
            (op.kind == REDUCE_SCATTER or op.kind == ALL_REDUCE and kw.get("op") == "sum"))


def gathers_update(op: Op) -> bool:
    """A STEP all-gather (ZeRO 1 and 2: an updated parameter shard, whole
    again) that buckets can carry."""
    return op.phase is Phase.OPTIMIZER and op.kind == ALL_GATHER and \
        "stages" not in dict(op.kwargs)


def per_microbatch(op: Op, readers) -> bool:
    """A micro-batch's gradient reduce-scatter that buckets can carry:
    in the backward or weight phase, its result read (`readers`: the ops
    reading it) by `accumulate_grad` only."""
    return (op.kind == REDUCE_SCATTER and op.phase in (Phase.BACKWARD, Phase.WEIGHT)
            and bool(readers) and all(r.kind == ACCUMULATE_GRAD for r in readers))


def bound(strategy) -> int:
    """A bucket's bound in bytes; 0: no buckets."""
    if strategy.bucket_mb <= 0 or strategy.precision == Precision.FP16:
        return 0
    return int(strategy.bucket_mb * 2**20)


def buckets_of(job, plan: RankPlan) -> tuple[Bucket, ...]:
    """The buckets of `plan` (rank `plan.rank` of `job`); () when off."""
    if not bound(job.strategy):
        return ()
    nbytes = {b.value: b.nbytes for b in plan.buffers}
    g = job.graph
    return grad_buckets(plan.tasks, g.ops.__getitem__, g.values,
                        {u.name: u.value for u in g.updates},
                        bound(job.strategy), nbytes.__getitem__)


def bucketed_bytes(op_of, tasks, buffers, strategy) -> tuple[int, int]:
    """What the flat copies of a rank's bucketable STEP reductions take (the
    memory layout's share of them): their inputs' local bytes; and of those,
    the bytes of the accumulators written into their slots (`writes_slot`)."""
    if not bound(strategy):
        return 0, 0
    size = {b.id: b.nbytes for b in buffers}
    made_by, readers = _makers_readers(tasks, op_of)
    flat = in_place = 0
    for t in tasks:
        op = op_of(t.op)
        if t.kind is TaskKind.GRAD_REDUCE and len(t.group) > 1 and bucketable(op):
            flat += size[t.inputs[0]]
            if writes_slot(op, made_by, readers) >= 0:
                in_place += size[t.inputs[0]]
    return flat, in_place


def writes_slot(op: Op, made_by: dict, readers: dict) -> int:
    """The `accumulate_grad` op that may write the value STEP reduction `op`
    reduces straight into its bucket's flat tensor, or -1: the value is an
    accumulator's last update, and nothing but `op` reads it (it is reduced
    in place once its bucket starts). `made_by` {value: (task group, op)},
    `readers` {value: [ops]}, over a rank's tasks."""
    arg = op.refs()[0]  # the value reduced: its first argument
    maker = made_by.get(arg)
    if maker is None or maker[1].kind != ACCUMULATE_GRAD:
        return -1
    return maker[1].id if [r.id for r in readers.get(arg, ())] == [op.id] else -1


def _makers_readers(tasks, op_of) -> tuple[dict, dict]:
    """({value: (its op, that op's task group)}, {value: [ops reading it]})
    over `tasks`."""
    made_by: dict[int, tuple] = {}
    readers: dict[int, list] = {}
    for t in tasks:
        op = op_of(t.op)
        for o in op.outputs:
            if o >= 0:
                made_by[o] = (template_of(t), op)
        for r in op.refs():
            readers.setdefault(r, []).append(op)
    return made_by, readers


def grad_buckets(tasks, op_of, values, finals: dict, bucket_bytes: int,
                 local_bytes) -> tuple[Bucket, ...]:
    """This rank's buckets. `tasks`: its plan's tasks; `op_of(id)` the Job's
    op, `values[vid]` its value; `finals` {accumulator name: its last
    update's value} (empty: no STEP buckets); `local_bytes(vid)` a value's
    bytes on this rank."""
    updated = set(finals.values())
    made_by, readers = _makers_readers(tasks, op_of)
    order = {t.op: i for i, t in enumerate(tasks)}
    wanted = []
    for t in tasks:
        op = op_of(t.op)
        if len(t.group) <= 1:
            continue
        arg = op.args[0].id
        kind, size_of, slot = ALL_REDUCE, arg, -1
        if t.kind is TaskKind.GRAD_REDUCE and bucketable(op):
            # the accumulator's last update, or the accumulator itself
            source = arg if arg in updated else finals.get(values[arg].name)
            every = False
            if source == arg:
                slot = writes_slot(op, made_by, readers)
        elif t.kind is TaskKind.COLLECTIVE and per_microbatch(op, readers.get(op.outputs[0])):
            source, every = arg, True
        elif t.kind is TaskKind.GRAD_REDUCE and gathers_update(op) and \
                made_by.get(arg, (None, op))[1].kind != ALL_GATHER:
            # (not the second gather of a shard over dp and ep: its first
            # may be of an optimizer slot the first step has not made)
            source, every, kind, size_of = arg, True, ALL_GATHER, op.outputs[0]
        else:
            continue
        if source is None or source not in made_by:
            continue
        template, maker_op = made_by[source]
        maker = maker_op.id
        if every and template != template_of(t):
            continue  # reduced in another task group than the one that makes it
        dtype = values[source].meta.dtype
        wanted.append(((template, t.group, dtype, every, kind), order[maker], t.op, source,
                       maker, local_bytes(size_of), slot))
    buckets: list[Bucket] = []
    open_: dict[tuple, list] = {}
    closed: set[tuple] = set()  # keys whose first bucket is closed
    for key, _, op_id, source, maker, size, slot in sorted(wanted, key=lambda w: (w[1], w[2])):
        cur = open_.get(key)
        if cur is None:
            cur = open_[key] = [0, [], [], -1, []]
        cur[0] += size
        cur[1].append(op_id)
        cur[2].append(source)
        cur[3] = maker
        cur[4].append(slot)
        if cur[0] >= (bucket_bytes if key in closed else min(FIRST_BUCKET_BYTES, bucket_bytes)):
            buckets.append(_close(key, open_.pop(key)))
            closed.add(key)
    buckets += [_close(key, cur) for key, cur in open_.items()]
    return tuple(sorted(buckets, key=lambda b: order[b.after]))


def _close(key: tuple, cur: list) -> Bucket:
    template, group, _, every, kind = key
    return Bucket(group, tuple(cur[1]), tuple(cur[2]), cur[3], template, every, kind,
                  tuple(cur[4]))


def run_order(tasks, buckets, op_of) -> list:
    """`tasks` in the order the runtime runs them: the ops of a bucket that
    starts in every run (a micro-batch's reduce-scatters, the STEP's
    all-gathers), and every task of their group that reads what they (or a
    task so moved) make, run right after the next such bucket of their
    task group starts (after the op that completes it), the last bucket's
    after the rest of the group, in their own order: at most two buckets'
    flat tensors are alive, and a bucket's collective overlaps the group's
    work up to the next one's start. The STEP reductions' buckets change
    no order."""
    own = {op: i for i, b in enumerate(buckets) if b.every_run for op in b.ops}
    if not own:
        return list(tasks)
    pos = {t.op: i for i, t in enumerate(tasks)}
    bucket_of: dict[int, int] = {}   # moved task id -> the latest bucket it waits for
    made: dict[int, int] = {}        # value a moved task makes -> that bucket
    for t in tasks:
        op = op_of(t.op)
        key = template_of(t)
        waits = [own[t.op]] if t.op in own else \
            [made[r] for r in op.refs() if r in made and buckets[made[r]].template == key]
        if waits:
            bucket_of[t.id] = k = max(waits, key=lambda k: pos[buckets[k].after])
            made.update((o, k) for o in op.outputs if o >= 0)
    last = {template_of(t): t.op for t in tasks if t.id not in bucket_of}
    anchor: dict[int, int] = {}      # bucket -> the op its moved tasks run after
    per_group: dict[tuple, list[int]] = {}
    for k, b in enumerate(buckets):
        if b.every_run and b.template in last:  # a group `tasks` holds
            per_group.setdefault(b.template, []).append(k)
    for group, ks in per_group.items():
        for k, nxt in zip(ks, ks[1:] + [None]):
            anchor[k] = buckets[nxt].after if nxt is not None else last[group]
    late: dict[int, list] = {}       # anchor op -> the tasks moved after it
    for t in tasks:
        if t.id in bucket_of:
            late.setdefault(anchor[bucket_of[t.id]], []).append(t)
    out = []
    for t in tasks:
        if t.id not in bucket_of:
            out.append(t)
            out += late.pop(t.op, ())
    assert not late, f"moved tasks lost their place: {late}"
    return out


def flat_intervals(tasks, buckets, index) -> list[tuple[int, int, Bucket]]:
    """Per bucket `run_order` moves (every one but the STEP reductions'):
    (its `after` task's index, the index after its last op, the bucket) in
    `index` ({task id: position}, of `run_order`): its flat tensors' life,
    which its sources' lives end at (the bucket's start copies them)."""
    at = {t.op: index[t.id] for t in tasks if t.id in index}
    return [(at[b.after], max(at[o] for o in b.ops) + 1, b) for b in buckets if b.every_run]


def misplaced(tasks, buckets, op_of) -> list[str]:
    """What is wrong with where `buckets` start (empty: nothing): each must
    start in its task group after every value it carries is made there, and
    (one that starts in every run) before its ops run in `run_order`."""
    made = {o: (i, template_of(t), t.op) for i, t in enumerate(tasks)
            for o in op_of(t.op).outputs if o >= 0}
    ran = {t.op: i for i, t in enumerate(run_order(tasks, buckets, op_of))}
    group = {t.op: template_of(t) for t in tasks}
    errors = []
    for b in buckets:
        name = f"the gradient bucket of ops {list(b.ops)}"
        start = ran[b.after]
        late = [(v, m) for v in b.sources for m in [made.get(v)]
                if m is None or m[1] != b.template or ran[m[2]] > start]
        if group[b.after] != b.template:
            late.append((b.sources[-1], None))
        if late:
            v, m = late[0]
            errors.append(f"{name} starts after op {b.after}, but value {v} it carries is made "
                          f"{'nowhere' if m is None else f'by op {m[2]}'} after that in task "
                          f"group {b.template}; a bucket starts after its last value is made")
        early = [op for op in b.ops if b.every_run and ran[op] < start]
        if early:
            errors.append(f"{name} starts after op {b.after}, but its op {early[0]} runs "
                          "before that; a bucketed op waits for its bucket")
    return errors
