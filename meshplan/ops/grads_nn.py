"""Gradient rules of the neural-network ops: matmuls, norms, softmax,
attention, embedding, losses, dropout, convolution and pooling.

Where torch has a dedicated backward aten op (`native_layer_norm_backward`,
`convolution_backward`, ...) the rule emits it, so meshplan runs the same
kernels as eager autograd.
"""

from __future__ import annotations

from typing import Any

from meshplan.ir import Op, Ref
from meshplan.ops.generic import vjp_grad
from meshplan.ops.grad_util import arg, is_ref, only, out_ref, sum_to, tensor
from meshplan.ops.rule import Emits, Gouts, Grads, Needs


def _t(e: Emits, x: Ref) -> Ref:
    return e.call("aten.transpose.int", x, -1, -2)


def linear_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x, w = tensor(op, 0), tensor(op, 1)
    b = arg(op, 2, "bias")
    out = []
    if needs(x):
        out.append((x, e.call("aten.matmul.default", g, w)))
    n_out, n_in = e.meta(w).shape
    if needs(w) or (is_ref(b) and needs(b)):
        g2 = e.call("aten.reshape.default", g, (-1, n_out))
        if needs(w):
            x2 = e.call("aten.reshape.default", x, (-1, n_in))
            out.append((w, e.call("aten.mm.default", e.call("aten.t.default", g2), x2)))
        if is_ref(b) and needs(b):
            out.append((b, e.call("aten.sum.dim_IntList", g2, (0,))))
    return out


GROUPED_MM = "transformers.grouped_mm_fallback.default"  # transformers' MoE experts
GROUPED_MM_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def grouped_mm_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    """transformers' grouped matmul, through its own backward op (as its
    autograd formula does): both gradients at once, none for the offsets."""
    x, w, offs = tensor(op, 0), tensor(op, 1), tensor(op, 2)
    gx, gw = e.call_multi(GROUPED_MM_BACKWARD, x, w, offs, only(gouts))
    return [(r, g) for r, g in ((x, gx), (w, gw)) if needs(r)]


def mm_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    a, b = tensor(op, 0), tensor(op, 1)
    kind = "aten.bmm.default" if op.kind == "aten.bmm.default" else "aten.mm.default"
    out = []
    if needs(a):
        out.append((a, e.call(kind, g, _t(e, b))))
    if needs(b):
        out.append((b, e.call(kind, _t(e, a), g)))
    return out


def matmul_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    a, b = tensor(op, 0), tensor(op, 1)
    if len(e.meta(a).shape) < 2 or len(e.meta(b).shape) < 2:
        return vjp_grad(e, op, gouts, needs)
    g = only(gouts)
    out = []
    if needs(a):
        out.append((a, sum_to(e, e.call("aten.matmul.default", g, _t(e, b)), e.meta(a).shape)))
    if needs(b):
        out.append((b, sum_to(e, e.call("aten.matmul.default", _t(e, a), g), e.meta(b).shape)))
    return out


def addmm_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    bias, a, b = op.args[0], tensor(op, 1), tensor(op, 2)
    beta, alpha = dict(op.kwargs).get("beta", 1), dict(op.kwargs).get("alpha", 1)
    out = []
    if is_ref(bias) and needs(bias):
        gb = g if beta == 1 else e.call("aten.mul.Tensor", g, beta)
        out.append((bias, sum_to(e, gb, e.meta(bias).shape)))
    ga = g if alpha == 1 else e.call("aten.mul.Tensor", g, alpha)
    if needs(a):
        out.append((a, e.call("aten.mm.default", ga, e.call("aten.t.default", b))))
    if needs(b):
        out.append((b, e.call("aten.mm.default", e.call("aten.t.default", a), ga)))
    return out


def _masked(pairs: list[tuple[Any, Ref | None]], needs: Needs) -> Grads:
    """Keep (input, grad) pairs whose input wants a gradient."""
    return [(x, g) for x, g in pairs if is_ref(x) and needs(x) and g is not None]


def layer_norm_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    _x, shape, w, b, _eps = op.args
    x = tensor(op, 0)
    mean, rstd = out_ref(op, 1), out_ref(op, 2)
    mask = (True, is_ref(w), is_ref(b))
    gx, gw, gb = e.call_multi(
        "aten.native_layer_norm_backward.default", g, x, shape, mean, rstd, w, b, mask
    )
    return _masked([(x, gx), (w, gw), (b, gb)], needs)


def softmax_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x, dim = tensor(op, 0), op.args[1]
    kind = {
        "aten._softmax.default": "aten._softmax_backward_data.default",
        "aten._log_softmax.default": "aten._log_softmax_backward_data.default",
    }[op.kind]
    return [(x, e.call(kind, g, out_ref(op), dim, e.meta(x).dtype))] if needs(x) else []


def embedding_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    w, idx = tensor(op, 0), op.args[1]
    if not needs(w):
        return []
    padding_idx = arg(op, 2, "padding_idx", -1)
    scale = arg(op, 3, "scale_grad_by_freq", False)
    num = e.meta(w).shape[0]
    return [(w, e.call("aten.embedding_dense_backward.default", g, idx, num, padding_idx, scale))]


def nll_loss_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    _x, target, weight, reduction, ignore = op.args
    x = tensor(op, 0)
    if not needs(x):
        return []
    gx = e.call(
        "aten.nll_loss_backward.default", g, x, target, weight, reduction, ignore, out_ref(op, 1)
    )
    return [(x, gx)]


def dropout_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    x, p = tensor(op, 0), arg(op, 1, "p")
    if not needs(x):
        return []
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    return [(x, e.call("aten.native_dropout_backward.default", g, out_ref(op, 1), scale))]


def sdpa_cpu_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    q, k, v = tensor(op, 0), tensor(op, 1), tensor(op, 2)
    dropout_p = arg(op, 3, "dropout_p", 0.0)
    causal = arg(op, 4, "is_causal", False)
    kw = dict(op.kwargs)
    gq, gk, gv = e.call_multi(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        g, q, k, v, out_ref(op, 0), out_ref(op, 1), dropout_p, causal,
        attn_mask=kw.get("attn_mask"), scale=kw.get("scale"),
    )
    return _masked([(q, gq), (k, gk), (v, gv)], needs)


def _pair2(v: Any) -> tuple[int, ...]:
    return (v, v) if isinstance(v, int) else tuple(v) * (2 if len(v) == 1 else 1)


def conv2d_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x, w = tensor(op, 0), tensor(op, 1)
    b = arg(op, 2, "bias")
    stride = _pair2(arg(op, 3, "stride", 1))
    padding = _pair2(arg(op, 4, "padding", 0))
    dilation = _pair2(arg(op, 5, "dilation", 1))
    groups = arg(op, 6, "groups", 1)
    bias_sizes = (e.meta(w).shape[0],) if is_ref(b) else None
    mask = (needs(x), needs(w), is_ref(b) and needs(b))
    gx, gw, gb = e.call_multi(
        "aten.convolution_backward.default", g, x, w, bias_sizes, stride, padding,
        dilation, False, (0, 0), groups, mask,
    )
    return _masked([(x, gx), (w, gw), (b, gb)], needs)


def batch_norm_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    _x, w, b, rm, rv, training, _momentum, eps = op.args
    x = tensor(op, 0)
    mask = (needs(x), is_ref(w) and needs(w), is_ref(b) and needs(b))
    gx, gw, gb = e.call_multi(
        "aten.native_batch_norm_backward.default", g, x, w, rm, rv,
        out_ref(op, 1), out_ref(op, 2), training, eps, mask,
    )
    return _masked([(x, gx), (w, gw), (b, gb)], needs)


def max_pool2d_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = gouts[0]
    x = tensor(op, 0)
    if not needs(x):
        return []
    ks = arg(op, 1, "kernel_size")
    stride = arg(op, 2, "stride", ())
    padding = arg(op, 3, "padding", 0)
    dilation = arg(op, 4, "dilation", 1)
    ceil = arg(op, 5, "ceil_mode", False)
    gx = e.call(
        "aten.max_pool2d_with_indices_backward.default", g, x, ks, stride, padding,
        dilation, ceil, out_ref(op, 1),
    )
    return [(x, gx)]


def avg_pool2d_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    gx = e.call(
        "aten.avg_pool2d_backward.default", g, x, arg(op, 1, "kernel_size"),
        arg(op, 2, "stride", ()), arg(op, 3, "padding", 0), arg(op, 4, "ceil_mode", False),
        arg(op, 5, "count_include_pad", True), arg(op, 6, "divisor_override", None),
    )
    return [(x, gx)]


def adaptive_avg_pool2d_grad(e: Emits, op: Op, gouts: Gouts, needs: Needs) -> Grads:
    g = only(gouts)
    x = tensor(op, 0)
    if not needs(x):
        return []
    return [(x, e.call("aten._adaptive_avg_pool2d_backward.default", g, x))]


__all__ = [n for n in dir() if n.endswith("_grad")] + ["Ref"]
