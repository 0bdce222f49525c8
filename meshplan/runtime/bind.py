"""Bind each task of a RankPlan to the callable that runs it on this rank.

Invariant: a task gets a callable here only when this rank runs it
differently from the logical op (a rank-dependent variant, a collective, a
local slice, the device's own kernel named by `Task.kernel`, a random op
drawing its box of the logical draw); every other
task runs the op's aten kernel, bound by the segment compiler. Everything
rank-dependent (boxes, groups, offsets) is computed here, once, at load time.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch

from meshplan.ir import Op, Phase
from meshplan.ir.choices import KernelVariant
from meshplan.ir.job import Job, StageView, stage_view
from meshplan.ir.kinds import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_PARTIAL,
    REDUCE_SCATTER,
    ROUTED_EXPERTS_BACKWARD,
)
from meshplan.ir.mesh import Placement
from meshplan.ir.sbp import Box, intersect, local_box
from meshplan.ir.sequence_order import runs_at, sequence_order
from meshplan.lowering.rankplan import RankPlan, Task, TaskKind
from meshplan.ops.counter_rng import RandomCounter
from meshplan.ops.device_kernels import adapter
from meshplan.ops.random_ops import KERNELS as RANDOM_KERNELS
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for
from meshplan.runtime import local_kernels as lk
from meshplan.runtime.expert_dispatch import routed_experts_backward_ep, routed_experts_ep
from meshplan.runtime.ring_attention import ring_attention, ring_attention_backward
from meshplan.schedules.trace import Track

if TYPE_CHECKING:  # torch.distributed is loaded only where a rank talks (comm.py)
    from meshplan.runtime.comm import Comm

Group = tuple[int, ...]


class RankContext:
    """Where this rank sits, as its plan says (its stage and grid coordinate;
    the stage's placement), the view of its stage it reads (`view`: given,
    or cut from a whole Job); and where its run stands, for the random ops
    (`random`: seed, step, micro-batch, set by the executor)."""

    def __init__(self, job: Job | StageView, plan: RankPlan):
        self.view = stage_view(job, plan.stage)
        self.rank, self.stage, self.coord = plan.rank, plan.stage, plan.coord
        self.place: Placement = self.view.strategy.placement(self.stage)
        assert self.place.coord(self.rank) == self.coord, "a plan of another Job's layout"
        self.random = RandomCounter()

    def box(self, vid: int, coord: tuple[int, ...] | None = None) -> Box:
        meta = self.view.values[vid].meta
        return local_box(meta.shape, self.view.sbp[vid], self.place.grid,
                         self.coord if coord is None else coord)

    def along(self, axis: int) -> list[tuple[int, ...]]:
        """The grid coordinates of this rank's line along `axis`."""
        out = []
        for k in range(self.place.grid[axis]):
            c = list(self.coord)
            c[axis] = k
            out.append(tuple(c))
        return out


def bind_task(task: Task, ctx: RankContext, comm: Comm) -> Callable | None:
    """The callable for `task`, or None to run the op's own kernel."""
    op = ctx.view.op_of[task.op]
    if op.kind == LOCAL_PARTIAL:
        return _slot_aware(op, ctx, _share_of_sum(ctx, dict(op.kwargs)["axis"]))
    if rule_for(op.kind).category is Category.LOCAL_SLICE:
        return _slot_aware(op, ctx, narrower(ctx, op.args[0].id, op.outputs[0]))
    if task.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE):
        if len(task.group) <= 1:
            return None  # a group of one: the logical kernel (the identity) is exact
        return _slot_aware(op, ctx, _COLLECTIVES[op.kind](op, dict(op.kwargs), task.group,
                                                           ctx, comm))
    if op.kind in RANDOM_KERNELS:
        return _random(op, ctx)
    if KernelVariant.RING in task.variant:
        return _ring(op, task, ctx, comm)
    if KernelVariant.EXPERTS in task.variant:
        return _experts(op, task, ctx, comm)
    if any(task.variant):
        return _variant(op, task, ctx)
    if task.kernel:  # the device's own kernel, with the logical op's signature
        return adapter(task.kernel)
    return None


def _random(op: Op, ctx: RankContext) -> Callable:
    """A random op drawing this rank's box of its logical output, under the
    key of where the run stands when it runs (`ops/random_ops.py`)."""
    kernel, out, key = RANDOM_KERNELS[op.kind], op.outputs[0], op.args[-1]
    box, shape, counter = ctx.box(out), ctx.view.values[out].meta.shape, ctx.random

    def draw(*args, **kw):
        return kernel(*args, **kw, draw={"box": box, "shape": shape,
                                         "stream": counter.stream(key, shape)})

    return draw


def _slot_aware(op: Op, ctx: RankContext, kernel: Callable) -> Callable:
    """A boxing op of an optimizer slot passes an absent slot on (SGD's
    momentum buffer, which the first step makes): every rank of the group
    holds none alike, so none joins the collective. So does each later step
    of a conversion (a slot sharded over dp and ep is gathered over ep, then
    over dp)."""
    if op.phase is not Phase.OPTIMIZER:
        return kernel
    return lambda x, **kw: None if x is None else kernel(x, **kw)


def _share_of_sum(ctx: RankContext, axis: int) -> Callable:
    """x, whole on every rank -> this rank's share of a sum over `axis` that
    is x: x itself on the axis's first rank, zeros on the others."""
    first = ctx.coord[axis] == 0
    return lambda x, **_layout: x if first else torch.zeros_like(x)


def narrower(ctx: RankContext, src: int, dst: int, have: Box | None = None) -> Callable:
    """x (holding box `have`, default src's box) -> the part that is dst's box,
    in a storage of its own: a dim-0 slice is contiguous already, and as a
    view it would keep all of x alive (a reduce-scatter's full all-reduce,
    adopted by a gradient accumulator, lived until the next micro-batch)."""
    have = have or ctx.box(src)
    want = ctx.box(dst)
    cuts = [(d, w[0] - h[0], w[1] - w[0]) for d, (h, w) in enumerate(zip(have, want))
            if h != w]

    def narrow(x, **_layout):
        for d, start, size in cuts:
            x = x.narrow(d, start, size)
        if not cuts:
            return x
        x = x.contiguous()
        own = x.untyped_storage().nbytes() == x.numel() * x.element_size()
        return x if own else x.clone()

    return narrow


# ------------------------------------------------------------- collectives
# kind -> factory(op, kwargs, group, ctx, comm) -> the rank's callable
def _all_reduce(op: Op, kw: dict, group: Group, ctx: RankContext, comm: Comm) -> Callable:
    return lambda x, **_: comm.all_reduce(x, group, kw["op"])


def deferred_all_reduce(task: Task, ctx: RankContext, comm: Comm, pending: list) -> Callable:
    """An all-reduce whose result no op of the step reads (the loss's): it
    runs in the background, its work appended to `pending`, which the step
    waits for at its end. Its issue order among the group's collectives is
    the plan's, as for any other."""
    op = ctx.view.op_of[task.op]
    kind, group = dict(op.kwargs)["op"], task.group

    def start(x, **_):
        out = x.clone(memory_format=torch.contiguous_format)
        pending.append(comm.all_reduce_async(out, group, kind, name="deferred"))
        return out

    return start


def gathered_parts(op: Op, ctx: RankContext) -> tuple[int, list[tuple[int, ...]]]:
    """An all-gather's dim, and every member's local shape of its input."""
    kw = dict(op.kwargs)
    src, axis = op.ref(0).id, int(kw["axis"])  # type: ignore[arg-type]
    return int(kw["dim"]), [tuple(b - a for a, b in ctx.box(src, c))  # type: ignore[arg-type]
                            for c in ctx.along(axis)]


def _all_gather(op: Op, kw: dict, group: Group, ctx: RankContext, comm: Comm) -> Callable:
    dim, shapes = gathered_parts(op, ctx)
    return lambda x, **_: comm.all_gather(x, group, dim, shapes)


def gather_into(task: Task, ctx: RankContext, comm: Comm, into: Callable) -> Callable:
    """A STEP all-gather of an updated parameter shard, written into the
    parameter's own tensor (`into()`, None: a fresh one)."""
    op = ctx.view.op_of[task.op]
    dim, shapes = gathered_parts(op, ctx)
    return _slot_aware(op, ctx, lambda x, **_: comm.all_gather(x, task.group, dim, shapes,
                                                               out=into()))


def _reduce_scatter(op: Op, kw: dict, group: Group, ctx: RankContext, comm: Comm) -> Callable:
    narrow = narrower(ctx, op.args[0].id, op.outputs[0])
    return lambda x, **_: narrow(comm.all_reduce(x, group, "sum"))


def _all_to_all(op: Op, kw: dict, group: Group, ctx: RankContext, comm: Comm) -> Callable:
    """S(i) -> S(j) over the group: each member is sent the part of this
    rank's box that lies in its output box (a cut along j), and this rank's
    output is the members' parts of it, joined along i in group order (the
    boxes say every cut, so uneven shards need nothing more). Where the
    parts are consecutive runs of memory (no dim before the cut has more
    than one row), the tensor is sent as it is and the output is the
    receive buffer itself: no copy either side."""
    src, dst, line = op.args[0].id, op.outputs[0], ctx.along(kw["axis"])
    have, want = ctx.box(src), ctx.box(dst)
    sends = [_cut(have, intersect(have, ctx.box(dst, c))) for c in line]
    recv_shapes = []
    for c in line:
        part = intersect(ctx.box(src, c), want)
        recv_shapes.append(tuple(0 for _ in want) if part is None else
                           tuple(b - a for a, b in part))
    sizes = [0 if cut is None else math.prod(s.stop - s.start for s in cut) for cut in sends]
    counts = [math.prod(s) for s in recv_shapes]
    whole_in = _leading_ones(have, kw["dst_dim"])
    whole_out = _leading_ones(want, kw["src_dim"])
    want_shape = tuple(b - a for a, b in want)

    def exchange(x, **_):
        if whole_in:  # a view when contiguous, else one copy
            flat = x.contiguous().reshape(-1)
        else:  # each part copied once, into its run
            flat = x.new_empty(sum(sizes))
            for cut, run in zip(sends, flat.split(sizes)):
                if cut is not None:
                    run.view(x[cut].shape).copy_(x[cut])
        got = comm.all_to_all(flat, sizes, counts, group)
        parts = [g.view(s) for g, s in zip(got.split(counts), recv_shapes) if g.numel()]
        if whole_out or not parts:  # (no parts: this rank's shard is empty, uneven)
            return got.view(want_shape)
        return torch.cat(parts, dim=kw["src_dim"])

    return exchange


def _leading_ones(box: Box, dim: int) -> bool:
    """No dim before `dim` holds more than one row: cuts along `dim` are
    consecutive runs of a contiguous tensor."""
    return all(b - a == 1 for a, b in box[:dim])


def _cut(have: Box, part: Box | None):
    """The index of box `part` within a tensor holding box `have` (None: empty)."""
    if part is None:
        return None
    return tuple(slice(p0 - h0, p1 - h0) for (h0, _), (p0, p1) in zip(have, part))


_COLLECTIVES = {ALL_REDUCE: _all_reduce, ALL_GATHER: _all_gather,
                REDUCE_SCATTER: _reduce_scatter, ALL_TO_ALL: _all_to_all}


# ---------------------------------------------------------- kernel variants
# tag -> factory(kernel, op, axis, ctx) -> the rank's kernel (see local_kernels.py)
def _bias_first(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    return lk.bias_first(kernel, ctx.coord[axis] == 0)


def _vocab_offset(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    if op.kind == "aten.embedding.default":
        return lk.vocab_embedding(*ctx.box(op.args[0].id)[0])
    return lk.vocab_embedding_backward(*ctx.box(op.outputs[0])[0])


def _class_offset(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    if op.kind == "aten.nll_loss_forward.default":
        return lk.class_nll(*ctx.box(op.args[0].id)[1])
    return lk.class_nll_backward(*ctx.box(op.args[1].id)[1])


def _mean_rescale(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    x = op.args[0].id
    local = tuple(b - a for a, b in ctx.box(x))
    dims = op.args[1] if len(op.args) > 1 else dict(op.kwargs).get("dim")
    return lk.mean_rescale(kernel, local, ctx.view.values[x].meta.shape, dims)


def _causal_offset(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    backward = len(op.outputs) == 3  # (grad_out, q, k, v, out, lse, ...)
    q, k = (op.args[1], op.args[2]) if backward else (op.args[0], op.args[1])
    order = sequence_order(ctx.view.strategy, ctx.view.values[q.id].meta.shape[2])
    (q_lo, q_hi), (k_lo, k_hi) = ctx.box(q.id)[2], ctx.box(k.id)[2]
    wrap = lk.causal_attention_backward if backward else lk.causal_attention
    return wrap(kernel, order[q_lo:q_hi], order[k_lo:k_hi])


def _ring(op: Op, task: Task, ctx: RankContext, comm: Comm) -> Callable:
    """Attention of this rank's rows, keys and values passed around its line
    along the ring's axis (`runtime/ring_attention.py`): the runs of tokens
    this rank's queries and each member's keys hold."""
    axis = task.variant.index(KernelVariant.RING)
    assert task.variant.count(KernelVariant.RING) == 1 and task.group == tuple(
        ctx.place.rank_at(c) for c in ctx.along(axis)), "a ring over its own axis's line"
    backward = len(op.outputs) == 3  # (grad_out, q, k, v, out, lse, ...)
    q, k = (op.args[1], op.args[2]) if backward else (op.args[0], op.args[1])
    seq = ctx.view.values[q.id].meta.shape[2]
    rows = runs_at(ctx.view.strategy, seq, *ctx.box(q.id)[2])
    keys = [runs_at(ctx.view.strategy, seq, *ctx.box(k.id, c)[2]) for c in ctx.along(axis)]
    kernel = adapter(task.kernel) if task.kernel else rule_for(op.kind).kernel
    wrap = ring_attention_backward if backward else ring_attention
    return wrap(kernel, rows, keys, ctx.coord[axis],
                lambda x, step: comm.shift(x, task.group, op.id, step),
                lambda name, t0: comm.record(name, t0, Track.COMPUTE))


def _experts(op: Op, task: Task, ctx: RankContext, comm: Comm) -> Callable:
    """Routed experts of this rank's tokens, its rows sent to the members of
    its line along the experts' axis that hold their experts
    (`runtime/expert_dispatch.py`); member k holds the k-th E/n of them."""
    axis = task.variant.index(KernelVariant.EXPERTS)
    line = ctx.along(axis)
    assert task.variant.count(KernelVariant.EXPERTS) == 1 and task.group == tuple(
        ctx.place.rank_at(c) for c in line), "routed over its own axis's line"
    w_in, n = op.args[3].id, len(line)
    experts = ctx.view.values[w_in].meta.shape[0]
    assert [ctx.box(w_in, c)[0] for c in line] == [
        (k * experts // n, (k + 1) * experts // n) for k in range(n)], "experts split evenly"
    make = routed_experts_backward_ep if op.kind == ROUTED_EXPERTS_BACKWARD else routed_experts_ep
    return make(lambda flat, sizes, counts: comm.all_to_all(flat, sizes, counts, task.group), n)


def _replica_first(kernel: Callable, op: Op, axis: int, ctx: RankContext) -> Callable:
    return kernel if ctx.coord[axis] == 0 else lk.counted_elsewhere


_VARIANTS = {KernelVariant.REPLICA_FIRST: _replica_first,
             KernelVariant.BIAS_FIRST: _bias_first, KernelVariant.VOCAB_OFFSET: _vocab_offset,
             KernelVariant.CLASS_OFFSET: _class_offset,
             KernelVariant.MEAN_RESCALE: _mean_rescale,
             KernelVariant.CAUSAL_OFFSET: _causal_offset}
# Applied once however many axes name them: they read the whole local boxes.
_ONCE = {KernelVariant.MEAN_RESCALE, KernelVariant.CAUSAL_OFFSET}


def _variant(op: Op, task: Task, ctx: RankContext) -> Callable:
    """Compose the rank-dependent variants named per axis in `task.variant`."""
    kernel = adapter(task.kernel) if task.kernel else rule_for(op.kind).kernel
    seen = set()
    for axis, tag in enumerate(task.variant):
        if not tag or (tag in _ONCE and tag in seen):
            continue
        seen.add(tag)
        factory = _VARIANTS.get(tag)
        assert factory is not None, f"unknown kernel variant {tag!r} of {op.kind}"
        kernel = factory(kernel, op, axis, ctx)
    return kernel


def localize(op, ctx: RankContext):
    """`op` with its shape-carrying arguments set to this rank's local shapes."""
    spec = rule_for(op.kind).shape_args
    if not spec:
        return op
    args = list(op.args)
    for pos, out in spec:
        if pos < len(args) and op.outputs[out] >= 0:
            args[pos] = tuple(b - a for a, b in ctx.box(op.outputs[out]))
    return replace(op, args=tuple(args))
