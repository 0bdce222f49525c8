"""Gradient rules of view, layout, slicing and reduction ops."""

from __future__ import annotations

import math

from meshplan.ir import ABSENT, Op, Ref
from meshplan.ops.grad_util import arg, only, sum_to, tensor, zeros_like
from meshplan.ops.rule import Emits, Gouts, Grads, Needs


def _reshape_back(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """For every op whose output is its input re-viewed (view, reshape, ...)."""
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    return [(x, e.call("aten.reshape.default", g, e.meta(x).shape))]


view_grad = _reshape_back


def transpose_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    return [(x, e.call("aten.transpose.int", g, op.args[1], op.args[2]))] if needs(x) else []


def t_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    return [(x, e.call("aten.t.default", g))] if needs(x) else []


def permute_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    n = len(e.meta(x).shape)
    dims = [d % n for d in arg(op, 1, "dims")]
    inverse = tuple(sorted(range(n), key=lambda i: dims[i]))
    return [(x, e.call("aten.permute.default", g, inverse))]


def expand_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    return [(x, sum_to(e, g, e.meta(x).shape))] if needs(x) else []


def split_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """split / split_with_sizes / chunk / unbind: concatenate the pieces."""
    x = tensor(op, 0)
    if not needs(x):
        return []
    dim = arg(op, 2, "dim", 0) if op.kind != "aten.unbind.int" else arg(op, 1, "dim", 0)
    pieces: list[Ref] = []
    for o, g in zip(op.outputs, gouts):
        if o == ABSENT:
            continue
        pieces.append(g if g is not None else zeros_like(e, Ref(o)))
    if op.kind == "aten.unbind.int":
        return [(x, e.call("aten.stack.default", tuple(pieces), dim))]
    return [(x, e.call("aten.cat.default", tuple(pieces), dim))]


def cat_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    tensors: tuple[Ref, ...] = arg(op, 0, "tensors")
    n = len(e.meta(tensors[0]).shape)
    dim = arg(op, 1, "dim", 0) % n
    out, off = [], 0
    for t in tensors:
        size = e.meta(t).shape[dim]
        if needs(t):
            out.append((t, e.call("aten.slice.Tensor", g, dim, off, off + size)))
        off += size
    return out


def slice_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    shape = e.meta(x).shape
    dim = arg(op, 1, "dim", 0) % len(shape)
    start = arg(op, 2, "start", None)
    end = arg(op, 3, "end", None)
    step = arg(op, 4, "step", 1)
    start, end, step = slice(start, end, step).indices(shape[dim])
    return [(x, e.call("aten.slice_backward.default", g, shape, dim, start, end, step))]


def select_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    shape = e.meta(x).shape
    return [(x, e.call("aten.select_backward.default", g, shape, op.args[1], op.args[2]))]


def _expand_reduced(e: Emits, op: Op, g: Ref, keepdim_index: int) -> Ref:
    """Broadcast a reduction's gradient back to its input's shape."""
    x = tensor(op, 0)
    shape = e.meta(x).shape
    dims = arg(op, 1, "dim", None)
    if dims == ():
        dims = None  # an empty dim list reduces every dim, as None does
    keepdim = arg(op, keepdim_index, "keepdim", False) if dims is not None else False
    if dims is not None and not keepdim and shape:
        dims = (dims,) if isinstance(dims, int) else dims
        kept = [1 if i in {d % len(shape) for d in dims} else s for i, s in enumerate(shape)]
        g = e.call("aten.reshape.default", g, tuple(kept))
    if e.meta(g).dtype != e.meta(x).dtype:  # `dtype=` reduced in another dtype
        g = e.call("aten._to_copy.default", g, dtype=e.meta(x).dtype)
    return e.call("aten.expand.default", g, shape)


def _reduced_count(e: Emits, op: Op) -> int:
    shape = e.meta(tensor(op, 0)).shape
    dims = arg(op, 1, "dim", None)
    if dims is None or (isinstance(dims, tuple) and len(dims) == 0):
        return math.prod(shape)
    dims = (dims,) if isinstance(dims, int) else dims
    return math.prod(shape[d % len(shape)] for d in dims)


def sum_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    return [(x, _expand_reduced(e, op, g, 2))] if needs(x) else []


def mean_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    scaled = e.call("aten.div.Tensor", g, float(_reduced_count(e, op)))
    return [(x, _expand_reduced(e, op, scaled, 2))]


# The functional forms of writes into a tensor (torch's functionalization of
# `copy_`, `x[..] = v`, `x[..].add_()`; [Note: mutation] in capture/export.py).
def copy_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """copy(self, src): src broadcast into self's shape and dtype. self is
    overwritten: its gradient is zeros, as autograd's (a parameter written
    over still has a `.grad`, which weight decay reads)."""
    g = only(gouts)
    x, src = tensor(op, 0), tensor(op, 1)
    out = [(x, zeros_like(e, x))] if needs(x) else []
    if needs(src):
        g = sum_to(e, g, e.meta(src).shape)
        if e.meta(g).dtype != e.meta(src).dtype:
            g = e.call("aten._to_copy.default", g, dtype=e.meta(src).dtype)
        out.append((src, g))
    return out


def slice_scatter_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """slice_scatter(x, src, dim, start, end, step): x's gradient is g with
    the written slice zeroed; src's is that slice of g."""
    g = only(gouts)
    x, src = tensor(op, 0), tensor(op, 1)
    where = tuple(arg(op, i, name, d) for i, name, d in
                  ((2, "dim", 0), (3, "start", None), (4, "end", None), (5, "step", 1)))
    out = []
    if needs(x):
        hole = e.call("aten.slice_scatter.default", g, zeros_like(e, src), *where)
        out.append((x, hole))
    if needs(src):
        out.append((src, e.call("aten.slice.Tensor", g, *where)))
    return out


def select_scatter_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """select_scatter(x, src, dim, index): as slice_scatter, for one index."""
    g = only(gouts)
    x, src = tensor(op, 0), tensor(op, 1)
    dim, index = op.args[2], op.args[3]
    out = []
    if needs(x):
        hole = e.call("aten.select_scatter.default", g, zeros_like(e, src), dim, index)
        out.append((x, hole))
    if needs(src):
        out.append((src, e.call("aten.select.int", g, dim, index)))
    return out
