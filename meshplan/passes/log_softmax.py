"""expand_log_softmax: log-softmax as max, exp and sums, for vocab-parallel loss.

With the head vocab-parallel, logits are split over the classes. A fused
log-softmax needs every class; as primitives, each reduction over the class
dim is a Partial (`max` for the shift, `sum` for the normalizer), boxing
all-reduces only those (N, 1) columns, and the loss picks targets with the
rank's class offset (`class_offset`). This is Megatron's vocab-parallel
cross-entropy, derived by SBP propagation instead of hand-written.

    m = max(x)   z = x - m   out = z - log(sum(exp(z)))
    backward: gx = g - exp(out) * sum(g)

Runs only when the tensor-parallel plan has a vocab style; one process keeps
the fused kernels.
"""

from __future__ import annotations

from meshplan.ir import Graph
from meshplan.ops.emit import Emitter
from meshplan.passes.rewrite import rewrite_ops

FORWARD = "aten._log_softmax.default"
BACKWARD = "aten._log_softmax_backward_data.default"


def expand_log_softmax(graph: Graph) -> Graph:
    """Rewrite every log-softmax (forward and backward) into primitives."""
    return rewrite_ops(graph, {FORWARD: _forward, BACKWARD: _backward})


def _forward(e: Emitter, args, op):
    x, dim, _half = args
    shift = e.call("aten.amax.default", x, (dim,), True)
    z = e.call("aten.sub.Tensor", x, shift)
    total = e.call("aten.sum.dim_IntList", e.call("aten.exp.default", z), (dim,), True)
    return (e.call("aten.sub.Tensor", z, e.call("aten.log.default", total)),)


def _backward(e: Emitter, args, op):
    g, out, dim, _dtype = args
    total = e.call("aten.sum.dim_IntList", g, (dim,), True)
    probs = e.call("aten.exp.default", out)
    return (e.call("aten.sub.Tensor", g, e.call("aten.mul.Tensor", probs, total)),)
