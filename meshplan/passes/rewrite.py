"""rewrite_ops: replace ops by sub-graphs of primitives, keeping every link.

Invariants: values keep their ids (new ones are appended); outputs of a
replaced op are remapped in every later consumer, state update, gradient
link and the loss; a replacement's ops inherit the op's phase, module path,
source and (remapped) `grad_of`, so stage assignment treats them as the op.
"""

from __future__ import annotations

from typing import Callable

from meshplan.ir import Graph
from meshplan.ops.emit import Emitter
from meshplan.passes.rebuild import Rebuild

# rewriter(e, args, op) -> one Ref (or None) per output of `op`, or None to keep `op`
Rewriter = Callable[[Emitter, tuple, object], "tuple | None"]


def rewrite_ops(graph: Graph, rewriters: dict[str, Rewriter]) -> Graph:
    """`graph` with each op whose kind has a rewriter replaced by its result."""
    if not any(op.kind in rewriters for op in graph.ops):
        return graph
    rb = Rebuild(graph)
    vmap = rb.vmap
    for op in graph.ops:
        fn = rewriters.get(op.kind)
        if fn is None and not any(r in vmap for r in op.refs()):  # most ops: unchanged
            rb.keep(op)
            continue
        first = len(rb.b.ops)
        outs = fn(rb.emitter(op), tuple(rb.ref(a) for a in op.args), op) \
            if fn is not None else None
        if outs is None:
            rb.b.ops[first:] = []
            rb.keep(op, [vmap.get(r, r) for r in op.refs()])
            continue
        rb.replaced(op)
        for old, new in zip(op.outputs, outs):
            if old >= 0 and new is not None:
                vmap[old] = new.id
    return rb.build(graph)
