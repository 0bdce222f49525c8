"""rewrite_ops: replace ops by sub-graphs of primitives, keeping every link.

Invariants: values keep their ids (new ones are appended); outputs of a
replaced op are remapped in every later consumer, state update, gradient
link and the loss; a replacement's ops inherit the op's phase, module path,
source and (remapped) `grad_of`, so stage assignment treats them as the op.
"""

from __future__ import annotations

from typing import Callable

from meshplan.ir import Graph, GraphBuilder, Update, verify
from meshplan.ir.graph import map_refs
from meshplan.ops.emit import Emitter

# rewriter(e, args, op) -> one Ref (or None) per output of `op`, or None to keep `op`
Rewriter = Callable[[Emitter, tuple, object], "tuple | None"]


def rewrite_ops(graph: Graph, rewriters: dict[str, Rewriter]) -> Graph:
    """`graph` with each op whose kind has a rewriter replaced by its result."""
    if not any(op.kind in rewriters for op in graph.ops):
        return graph
    b = GraphBuilder(graph)
    b.ops = []
    vmap: dict[int, int] = {}
    omap: dict[int, int] = {}

    def ref(a):
        return map_refs(a, lambda i: vmap.get(i, i))

    for op in graph.ops:
        fn = rewriters.get(op.kind)
        first = len(b.ops)
        if fn is None and not any(r in vmap for r in op.refs()):  # most ops: unchanged
            grad_of = omap.get(op.grad_of, -1)
            b.ops.append(op if first == op.id and grad_of == op.grad_of
                         else op.renumbered(first, grad_of))
            omap[op.id] = first
            continue
        args = tuple(ref(a) for a in op.args)
        e = Emitter(b, op.phase, op.module_path, op.source, omap.get(op.grad_of, -1))
        outs = fn(e, args, op) if fn is not None else None
        if outs is None:
            b.ops[first:] = []
            kwargs = tuple((k, ref(v)) for k, v in op.kwargs)
            b.ops.append(op.renumbered(first, omap.get(op.grad_of, -1), args, kwargs))
            omap[op.id] = first
            continue
        omap[op.id] = len(b.ops) - 1
        for old, new in zip(op.outputs, outs):
            if old >= 0 and new is not None:
                vmap[old] = new.id
    b.updates = [Update(u.name, vmap.get(u.value, u.value)) for u in graph.updates]
    b.grads = [(vmap.get(v, v), vmap.get(g, g)) for v, g in graph.grads]
    out = b.build(vmap.get(graph.loss, graph.loss), graph.meta)
    verify(out)
    return out
