"""Gradient rules of pointwise ops (arithmetic with broadcasting, activations).

Each rule returns [(input ref, gradient ref)] for the inputs that need one.
"""

from __future__ import annotations

from typing import Any, Callable

from meshplan.ir import Op, Ref
from meshplan.ops.grad_util import arg, first, is_ref, only, out_ref, sum_to, tensor
from meshplan.ops.rule import Emits, Gouts, Grads, Needs

# fn(e, g, x, out, op) -> the gradient of a one-input op's input x
UnaryFn = Callable[[Emits, Ref, Ref, Ref, Op], Ref]


def _pair(e: Emits, op: Op, needs: Needs, ga_fn: Callable[[], Ref],
          gb_fn: Callable[[], Ref]) -> Grads:
    a, b = op.args[0], op.args[1]
    out = []
    if is_ref(a) and needs(a):
        out.append((a, sum_to(e, ga_fn(), e.meta(a).shape)))
    if is_ref(b) and needs(b):
        out.append((b, sum_to(e, gb_fn(), e.meta(b).shape)))
    return out


def _scaled(e: Emits, g: Ref, alpha: Any) -> Ref:
    return g if alpha == 1 else e.call("aten.mul.Tensor", g, alpha)


def add_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    alpha: Any = dict(op.kwargs).get("alpha", 1)
    return _pair(e, op, needs, lambda: g, lambda: _scaled(e, g, alpha))


def sub_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    alpha: Any = dict(op.kwargs).get("alpha", 1)
    return _pair(e, op, needs, lambda: g, lambda: _scaled(e, g, -alpha))


def rsub_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    # rsub(a, b, alpha) = b - alpha * a; rsub.Scalar takes alpha positionally
    g = only(gouts)
    alpha = arg(op, 2, "alpha", 1)
    return _pair(e, op, needs, lambda: _scaled(e, g, -alpha), lambda: g)


def mul_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    a, b = op.args[0], op.args[1]
    return _pair(
        e, op, needs,
        lambda: e.call("aten.mul.Tensor", g, b),
        lambda: e.call("aten.mul.Tensor", g, a),
    )


def div_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    b = op.args[1]
    ga = e.call("aten.div.Tensor", g, b)
    out = out_ref(op, 0)
    return _pair(
        e, op, needs,
        lambda: ga,
        lambda: e.call("aten.neg.default", e.call("aten.mul.Tensor", ga, out)),
    )


def _unary(fn: UnaryFn) -> Callable[[Emits, Op, Gouts, Needs], Grads]:
    """Rule for a one-input op whose gradient is fn(e, g, x, out)."""

    def rule(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
        x = tensor(op, 0)
        if not needs(x):
            return []
        return [(x, fn(e, first(gouts), x, out_ref(op, 0), op))]

    return rule


def _mul(e: Emits, *xs: Any) -> Ref:
    acc = xs[0]
    for x in xs[1:]:
        acc = e.call("aten.mul.Tensor", acc, x)
    return acc


neg_grad = _unary(lambda e, g, x, y, op: e.call("aten.neg.default", g))
exp_grad = _unary(lambda e, g, x, y, op: _mul(e, g, y))
log_grad = _unary(lambda e, g, x, y, op: e.call("aten.div.Tensor", g, x))
sqrt_grad = _unary(lambda e, g, x, y, op: e.call("aten.div.Tensor", g, _mul(e, y, 2.0)))
rsqrt_grad = _unary(lambda e, g, x, y, op: _mul(e, g, e.call("aten.pow.Tensor_Scalar", y, 3), -0.5))
tanh_grad = _unary(lambda e, g, x, y, op: e.call("aten.tanh_backward.default", g, y))
sigmoid_grad = _unary(lambda e, g, x, y, op: e.call("aten.sigmoid_backward.default", g, y))
relu_grad = _unary(lambda e, g, x, y, op: e.call("aten.threshold_backward.default", g, y, 0))
silu_grad = _unary(lambda e, g, x, y, op: e.call("aten.silu_backward.default", g, x))
identity_grad = _unary(lambda e, g, x, y, op: g)


def _gelu(e: Emits, g: Ref, x: Ref, y: Ref, op: Op) -> Ref:
    approx = arg(op, 1, "approximate", "none")
    return e.call("aten.gelu_backward.default", g, x, approximate=approx)


gelu_grad = _unary(_gelu)


def _pow_scalar(e: Emits, g: Ref, x: Ref, y: Ref, op: Op) -> Ref:
    p = arg(op, 1, "exponent")
    if p == 2:
        return _mul(e, g, x, 2.0)
    return _mul(e, g, e.call("aten.pow.Tensor_Scalar", x, p - 1), float(p))


pow_scalar_grad = _unary(_pow_scalar)


def masked_fill_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """x.masked_fill(mask, value): the gradient passes where not filled (as an
    elementwise op its SBP follows x's; the generic vjp would replicate it)."""
    x, mask = tensor(op, 0), tensor(op, 1)
    if not needs(x):
        return []
    g = e.call("aten.masked_fill.Scalar", only(gouts), mask, 0.0)
    return [(x, sum_to(e, g, e.meta(x).shape))]  # x may broadcast against the mask


def to_copy_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    return [(x, e.call("aten._to_copy.default", g, dtype=e.meta(x).dtype))]
