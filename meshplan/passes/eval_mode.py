"""The forward of evaluation: the module in `eval()` mode.

Capture records the forward in training mode; evaluation (`plan_forward`)
computes it as `module.eval()` does, where dropout is the identity: every
`meshplan.dropout` is removed, its readers reading its input. (A captured
BatchNorm keeps the batch statistics it was captured with.)
"""

from __future__ import annotations

from meshplan.ir import Graph
from meshplan.ir.kinds import DROPOUT
from meshplan.passes.rebuild import Rebuild


def eval_mode(g: Graph) -> Graph:
    """`g` with each dropout the identity (`g` itself when it has none)."""
    if not any(op.kind == DROPOUT for op in g.ops):
        return g
    rb = Rebuild(g)
    for op in g.ops:
        if op.kind == DROPOUT:  # its mask is read by its backward only: none here
            x = op.ref(0).id
            rb.vmap[op.outputs[0]] = rb.vmap.get(x, x)
            continue
        rb.keep(op, [rb.vmap.get(r, r) for r in op.refs()])
    return rb.build(g)
