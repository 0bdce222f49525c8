"""Helpers that gradient rules share: broadcasting reductions and zeros."""

from __future__ import annotations

from meshplan.ir import Ref
from meshplan.ops.emit import Emitter


def sum_to(e: Emitter, g: Ref, shape: tuple[int, ...]) -> Ref:
    """Reduce a broadcast gradient `g` back to `shape` (the input's shape)."""
    gshape = e.meta(g).shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    dims = list(range(lead))
    for i, s in enumerate(shape):
        if s == 1 and gshape[lead + i] != 1:
            dims.append(lead + i)
    if dims:
        g = e.call("aten.sum.dim_IntList", g, tuple(dims), True)
    if e.meta(g).shape != shape:
        g = e.call("aten.reshape.default", g, shape)
    return g


def is_ref(a) -> bool:
    return isinstance(a, Ref)


def zeros_like(e: Emitter, like: Ref) -> Ref:
    """A zero tensor shaped like `like` (device follows the tensor at run time)."""
    return e.call("aten.zeros_like.default", like)


def arg(op, i: int, name: str, default=None):
    """Argument `i` of `op`, or keyword `name`, or `default`."""
    if i < len(op.args):
        return op.args[i]
    return dict(op.kwargs).get(name, default)


def out_ref(op, i: int = 0) -> Ref:
    """A Ref to output `i` of `op`."""
    return Ref(op.outputs[i])
