"""Helpers that gradient rules share: argument access, broadcasting
reductions and zeros.

Invariant: like the rules, these see the emitter as `rule.Emits` only.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from meshplan.ir import Arg, Op, Ref
from meshplan.ops.rule import Emits, Gouts


def sum_to(e: Emits, g: Ref, shape: tuple[int, ...]) -> Ref:
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


def is_ref(a: Arg) -> TypeGuard[Ref]:
    return isinstance(a, Ref)


def zeros_like(e: Emits, like: Ref) -> Ref:
    """A zero tensor shaped like `like` (device follows the tensor at run time)."""
    return e.call("aten.zeros_like.default", like)


def arg(op: Op, i: int, name: str, default: Any = None) -> Any:
    """Argument `i` of `op`, or keyword `name`, or `default` (its type is
    the op signature's: a literal or a Ref)."""
    if i < len(op.args):
        return op.args[i]
    return dict(op.kwargs).get(name, default)


def tensor(op: Op, i: int) -> Ref:
    """Argument `i` of `op`, which its signature makes a tensor."""
    a = op.args[i]
    assert isinstance(a, Ref), f"argument {i} of {op.kind} is {a!r}, not a tensor"
    return a


def only(gouts: Gouts) -> Ref:
    """The gradient of a one-output op's output (autodiff asks a rule only
    when some output has one)."""
    (g,) = gouts
    assert g is not None, "a one-output op's rule asked without a gradient"
    return g


def first(gouts: Gouts) -> Ref:
    """The gradient of output 0, which the rules that call this need."""
    g = gouts[0]
    assert g is not None, "the rule needs the gradient of output 0"
    return g


def out_ref(op: Op, i: int = 0) -> Ref:
    """A Ref to output `i` of `op`."""
    return Ref(op.outputs[i])
