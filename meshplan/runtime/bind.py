"""Bind each task of a RankPlan to the callable that runs it on this rank.

Invariant: a task gets a callable here only when this rank runs it
differently from the logical op (a rank-dependent variant, a collective, a
local slice, the device's own kernel named by `Task.kernel`); every other
task runs the op's aten kernel, bound by the segment compiler. Everything
rank-dependent (boxes, groups, offsets) is computed here, once, at load time.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.ir.job import Job
from meshplan.ir.mesh import Placement
from meshplan.ir.sbp import local_box
from meshplan.ops.device_kernels import adapter
from meshplan.ops.table import rule_for
from meshplan.plan.rankplan import Task, TaskKind
from meshplan.runtime import local_kernels as lk


class RankContext:
    """Where this rank sits: its placement and grid coordinate."""

    def __init__(self, job: Job, rank: int):
        s = job.strategy
        self.job = job
        self.rank = rank
        self.stage = s.stage_of_rank(rank)
        self.place: Placement = s.placement(self.stage)
        self.coord = self.place.coord(rank)

    def box(self, vid: int, coord=None):
        meta = self.job.graph.values[vid].meta
        return local_box(meta.shape, self.job.sbp[vid], self.place.grid,
                         self.coord if coord is None else coord)

    def along(self, axis: int) -> list[tuple[int, ...]]:
        """The grid coordinates of this rank's line along `axis`."""
        out = []
        for k in range(self.place.grid[axis]):
            c = list(self.coord)
            c[axis] = k
            out.append(tuple(c))
        return out


def bind_task(task: Task, ctx: RankContext, comm):
    """The callable for `task`, or None to run the op's own kernel."""
    op = ctx.job.graph.ops[task.op]
    kw = dict(op.kwargs)
    if op.kind == "meshplan.local_slice":
        return _narrower(ctx, op.args[0].id, op.outputs[0])
    if task.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE):
        if len(task.group) <= 1:
            return None  # a group of one: the logical kernel (the identity) is exact
        return _collective(op, kw, task, ctx, comm)
    if any(task.local):
        return _variant(op, task, ctx)
    if task.kernel:  # the device's own kernel, with the logical op's signature
        return adapter(task.kernel)
    return None


def _narrower(ctx: RankContext, src: int, dst: int, have=None):
    """x (holding box `have`, default src's box) -> the part that is dst's box."""
    have = have or ctx.box(src)
    want = ctx.box(dst)
    cuts = [(d, w[0] - h[0], w[1] - w[0]) for d, (h, w) in enumerate(zip(have, want))
            if h != w]

    def narrow(x, **_layout):
        for d, start, size in cuts:
            x = x.narrow(d, start, size)
        return x.contiguous() if cuts else x

    return narrow


def _collective(op, kw, task, ctx: RankContext, comm):
    src, dst = op.args[0].id, op.outputs[0]
    group = task.group
    kind = op.kind.removeprefix("meshplan.")
    if kind == "all_reduce":
        return lambda x, **_: comm.all_reduce(x, group, kw["op"])
    line = ctx.along(kw["axis"])
    if kind == "all_gather":
        shapes = [tuple(b - a for a, b in ctx.box(src, c)) for c in line]
        return lambda x, **_: comm.all_gather(x, group, kw["dim"], shapes)
    if kind == "reduce_scatter":
        narrow = _narrower(ctx, src, dst)
        return lambda x, **_: narrow(comm.all_reduce(x, group, "sum"))
    if kind == "all_to_all":
        shapes = [tuple(b - a for a, b in ctx.box(src, c)) for c in line]
        gathered = list(ctx.box(src))
        lo = ctx.box(src, line[0])[kw["src_dim"]][0]
        hi = ctx.box(src, line[-1])[kw["src_dim"]][1]
        gathered[kw["src_dim"]] = (lo, hi)
        narrow = _narrower(ctx, src, dst, tuple(gathered))
        return lambda x, **_: narrow(comm.all_gather(x, group, kw["src_dim"], shapes))
    raise AssertionError(f"no runtime collective for {op.kind}")


def _variant(op, task, ctx: RankContext):
    """Compose the rank-dependent variants named per axis in `task.local`."""
    kernel = adapter(task.kernel) if task.kernel else rule_for(op.kind).kernel
    seen = set()
    for axis, tag in enumerate(task.local):
        if not tag or (tag == "mean_rescale" and tag in seen):
            continue  # one rescale covers every axis: it uses the full local shape
        seen.add(tag)
        if tag == "bias_first":
            kernel = lk.bias_first(kernel, ctx.coord[axis] == 0)
        elif tag == "vocab_offset" and op.kind == "aten.embedding.default":
            kernel = lk.vocab_embedding(*ctx.box(op.args[0].id)[0])
        elif tag == "vocab_offset":
            kernel = lk.vocab_embedding_backward(*ctx.box(op.outputs[0])[0])
        elif tag == "class_offset" and op.kind == "aten.nll_loss_forward.default":
            kernel = lk.class_nll(*ctx.box(op.args[0].id)[1])
        elif tag == "class_offset":
            kernel = lk.class_nll_backward(*ctx.box(op.args[1].id)[1])
        elif tag == "mean_rescale":
            x = op.args[0].id
            local = tuple(b - a for a, b in ctx.box(x))
            dims = op.args[1] if len(op.args) > 1 else dict(op.kwargs).get("dim")
            kernel = lk.mean_rescale(kernel, local, ctx.job.graph.values[x].meta.shape, dims)
        else:
            raise AssertionError(f"unknown local variant {tag!r} of {op.kind}")
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
