"""The backward split in two: input gradients (I) and weight gradients (W).

Invariants (of `split_backward`'s result, for a staged, boxed train step):
- A backward op stays BACKWARD (the I part of its (stage, chunk)) when a
  value it makes is read by an op on another (stage, chunk) (a transfer to
  the previous stage, or a chunk on the same rank) or by an I op of its
  own; every other backward op becomes Phase.WEIGHT (W). Transfers stay I:
  they bring the gradient a backward waits for.
- So I is closed under producers within its (stage, chunk): nothing in I
  reads W, and running every I op then every W op, each in graph order, is
  a topological order. What W reads of the forward and of I stays alive
  until W runs (the runtime keeps a value while a later action reads it).
- Optimizer ops read gradients through the accumulators once per step, so
  they never pull an op into I. The graph's ops, ids and values are
  unchanged but for those phases.

Why here: meshplan owns the backward, so the split is a fact of the graph,
made once at compile time, not two `autograd.grad` calls at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from meshplan.ir import Graph, Phase
from meshplan.ir.kinds import TRANSFER


def input_grad_ops(graph: Graph, place: Sequence[tuple[int, int]]) -> set[int]:
    """The backward ops each (stage, chunk)'s input gradients need; `place[op]`
    is the (stage, chunk) of op `op`."""
    consumers = graph.consumers()
    needed: set[int] = set()
    for op in reversed(graph.ops):
        if op.phase is not Phase.BACKWARD:
            continue
        here = place[op.id]
        if op.kind == TRANSFER or any(
                c.phase is not Phase.OPTIMIZER and (place[c.id] != here or c.id in needed)
                for o in op.outputs if o >= 0 for c in consumers.get(o, ())):
            needed.add(op.id)
    return needed


def split_backward(graph: Graph, place: Sequence[tuple[int, int]]) -> Graph:
    """`graph` with the weight-gradient part of every backward in Phase.WEIGHT."""
    keep = input_grad_ops(graph, place)
    ops = tuple(replace(op, phase=Phase.WEIGHT)
                if op.phase is Phase.BACKWARD and op.id not in keep else op
                for op in graph.ops)
    return replace(graph, ops=ops)
