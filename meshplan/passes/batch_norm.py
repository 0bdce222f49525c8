"""expand_batch_norm: BatchNorm as sums, so a batch split is planned as SBP says.

A fused BatchNorm kernel computes its batch statistics inside; split over
data-parallel ranks it would see only its own samples. Rewritten as
primitives, each statistic is a sum over the batch dims: `Shard(0)` in,
`Partial` out, and boxing reduces it across the dp ranks exactly where the
next op needs the whole value. The backward is rewritten the same way.

    mean = sum(x) / n        var = sum((x - mean)^2) / n   (two passes: exact)
    y = (x - mean) * rsqrt(var + eps) * w + b
    running = (1 - m) * running + m * stat     (var unbiased: n / (n - 1))
    gb = sum(g)   gw = sum(g * xhat)   gx = w * rstd * (g - (gb + xhat * gw) / n)

Invariant: the rewritten graph computes the same numbers up to rounding
(`rewrite_ops` keeps every link). Runs only when data parallelism needs it
(the single-process graph keeps the fused kernels).
"""

from __future__ import annotations

import math

from meshplan.ir import Graph, Ref
from meshplan.ops.emit import Emitter
from meshplan.passes.rewrite import rewrite_ops

FORWARD = "aten._native_batch_norm_legit_functional.default"
BACKWARD = "aten.native_batch_norm_backward.default"


def expand_batch_norm(graph: Graph) -> Graph:
    """Rewrite every training BatchNorm (forward and backward) into sums."""
    return rewrite_ops(graph, {FORWARD: _forward, BACKWARD: _backward})


def _bcast(e: Emitter, v: Ref, nd: int) -> Ref:
    """A per-channel vector (C,) as (1, C, 1, ...) to broadcast over x."""
    c = e.meta(v).shape[0]
    return e.call("aten.reshape.default", v, (1, c) + (1,) * (nd - 2))


def _stats(e: Emitter, x: Ref):
    shape = e.meta(x).shape
    dims = (0,) + tuple(range(2, len(shape)))
    n = float(math.prod(shape[d] for d in dims))
    return dims, n, len(shape)


def _forward(e: Emitter, args, op):
    x, w, bias, rm, rv, training, momentum, eps = args
    if not training:
        return None
    dims, n, nd = _stats(e, x)
    mean = e.call("aten.div.Tensor", e.call("aten.sum.dim_IntList", x, dims), n)
    xc = e.call("aten.sub.Tensor", x, _bcast(e, mean, nd))
    var = e.call("aten.div.Tensor",
                 e.call("aten.sum.dim_IntList", e.call("aten.mul.Tensor", xc, xc), dims), n)
    rstd = e.call("aten.rsqrt.default", e.call("aten.add.Tensor", var, eps))
    y = e.call("aten.mul.Tensor", xc, _bcast(e, rstd, nd))
    if isinstance(w, Ref):
        y = e.call("aten.mul.Tensor", y, _bcast(e, w, nd))
    if isinstance(bias, Ref):
        y = e.call("aten.add.Tensor", y, _bcast(e, bias, nd))
    new_rm = _blend(e, rm, mean, momentum)
    unbiased = e.call("aten.mul.Tensor", var, n / max(n - 1.0, 1.0))
    new_rv = _blend(e, rv, unbiased, momentum)
    return (y, mean, rstd, new_rm, new_rv)


def _blend(e: Emitter, running: Ref, stat: Ref, m: float) -> Ref:
    kept = e.call("aten.mul.Tensor", running, 1.0 - m)
    return e.call("aten.add.Tensor", kept, e.call("aten.mul.Tensor", stat, m))


def _backward(e: Emitter, args, op):
    g, x, w, _rm, _rv, mean, rstd, train, _eps, mask = args
    if not train:
        return None
    dims, n, nd = _stats(e, x)
    rstd_b = _bcast(e, rstd, nd)
    xhat = e.call("aten.mul.Tensor", e.call("aten.sub.Tensor", x, _bcast(e, mean, nd)), rstd_b)
    gb = e.call("aten.sum.dim_IntList", g, dims)
    gw = e.call("aten.sum.dim_IntList", e.call("aten.mul.Tensor", g, xhat), dims)
    gx = None
    if mask[0]:
        inner = e.call("aten.add.Tensor", _bcast(e, gb, nd),
                       e.call("aten.mul.Tensor", xhat, _bcast(e, gw, nd)))
        centered = e.call("aten.sub.Tensor", g, e.call("aten.div.Tensor", inner, n))
        scale = rstd_b if not isinstance(w, Ref) else e.call(
            "aten.mul.Tensor", rstd_b, _bcast(e, w, nd))
        gx = e.call("aten.mul.Tensor", centered, scale)
    return (gx, gw if mask[1] else None, gb if mask[2] else None)
