"""Rebuild: the one way a pass copies a graph op by op while changing it.

A pass walks the old graph's ops in order and, for each, keeps it (reading
other values, maybe), replaces it by ops it emits, or adds ops before it.
`Rebuild` hands out the new op ids and keeps the links and annotations:

Invariants:
- New op ids are dense, in append order (`keep`, `append`, or an `Emitter`
  from `emitter`).
- An old op's new id is recorded when it is kept (`keep`) or replaced
  (`replaced`: its last emitted op stands for it), and every later
  `grad_of` (of a kept op, or of an `emitter` for an op) follows it; a
  `grad_of` to an op not (yet) rebuilt becomes -1.
- Values keep their ids (new ones are appended), unless `fresh`: then every
  value is made again, the graph inputs first, and `vmap` maps all old ids.
- With `annotate`, the per-op annotations (stage, chunk, kernel variant per
  mesh axis) cover exactly the new ops: a kept op carries the place it is
  given, else its place in `source`; ops emitted through an `Emitter` take
  the place given to `placed`. With a `source`, its per-value SBP is carried
  too: a value made by `new_value_like` takes its original's layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshplan.ir import Graph, GraphBuilder, Op, Ref, Update
from meshplan.ir.graph_facts import GraphFacts
from meshplan.ops.emit import Emitter

Place = tuple[int, int, tuple[str, ...]]  # stage, chunk, kernel variant per mesh axis


class Rebuild:
    """A graph being rebuilt from `graph`, op by op (see the module's invariants)."""

    def __init__(self, graph: Graph, annotate: bool = False, source=None, fresh: bool = False):
        self.vmap: dict[int, int]
        if fresh:
            self.b = GraphBuilder()
            self.vmap = {vid: self.b.add_input(graph.values[vid].meta, graph.values[vid].role,
                                               graph.values[vid].name) for vid in graph.inputs}
        else:
            self.b = GraphBuilder(graph)
            self.b.ops = []
            self.vmap = {}
        self.omap: dict[int, int] = {}
        self.source = source  # a Boxed (or anything with stage, chunk, variant, sbp)
        self.annotate = annotate or source is not None
        self.stage: list[int] = []
        self.chunk: list[int] = []
        self.variant: list[tuple[str, ...]] = []
        self.sbp = list(source.sbp) if source is not None else None

    def emitter(self, op: Op) -> Emitter:
        """An Emitter with `op`'s provenance and its `grad_of` followed."""
        return Emitter(self.b, op.phase, op.module_path, op.source, self.omap.get(op.grad_of, -1))

    def keep(self, op: Op, refs: Sequence[int] | None = None, place: Place | None = None) -> Op:
        """Append old op `op` renumbered, its k-th reference (in `refs()`
        order) replaced by `refs[k]` when given; returns the new op."""
        oid = len(self.b.ops)
        grad_of = self.omap.get(op.grad_of, -1)
        if refs is None or tuple(refs) == op.refs():
            new = op if oid == op.id and grad_of == op.grad_of else op.renumbered(oid, grad_of)
        else:
            it = iter(refs)
            args, kwargs = op.remap(lambda _: next(it))
            new = op.renumbered(oid, grad_of, args, kwargs)
        self.omap[op.id] = oid
        self.b.ops.append(new)
        if self.annotate:  # inline of `placed`: boxing keeps every op of a large graph
            if place is None:
                s = self.source
                place = (s.stage[op.id], s.chunk[op.id], s.variant[op.id])
            self.stage.append(place[0])
            self.chunk.append(place[1])
            self.variant.append(place[2])
        return new

    def replaced(self, op: Op) -> None:
        """Old op `op` was replaced by the ops just emitted: the last stands for it."""
        self.omap[op.id] = len(self.b.ops) - 1

    def append(self, op: Op, place: Place | None = None) -> None:
        """Append a new op (its id the next one) at `place`."""
        assert op.id == len(self.b.ops), f"op {op.id} appended at {len(self.b.ops)}"
        self.b.ops.append(op)
        if self.annotate:
            self.placed(place)

    def placed(self, place: Place | None) -> None:
        """Annotate the ops appended since the last annotation with `place`."""
        assert place is not None, "an annotated rebuild needs each new op's place"
        for _ in range(len(self.stage), len(self.b.ops)):
            self.stage.append(place[0])
            self.chunk.append(place[1])
            self.variant.append(place[2])

    def new_value_like(self, vid: int) -> int:
        """A new value with old value `vid`'s meta (and layout, if carried)."""
        out = self.b.new_value(self.b.values[vid].meta)
        if self.sbp is not None:
            self.sbp.append(self.sbp[vid])
        return out

    def ref(self, a):
        """Argument `a` with each Ref through `vmap`."""
        if isinstance(a, Ref):
            return Ref(self.vmap.get(a.id, a.id))
        if isinstance(a, tuple):
            return tuple(self.ref(x) for x in a)
        return a

    def build(self, graph: Graph, loss: int | None = None,
              facts: GraphFacts | None = None) -> Graph:
        """The rebuilt graph: `graph`'s updates, gradient links and loss
        through `vmap` (the loss: `loss` if given), its facts unless `facts`."""
        vm = self.vmap
        self.b.updates = [Update(u.name, vm.get(u.value, u.value)) for u in graph.updates]
        self.b.grads = [(vm.get(v, v), vm.get(g, g)) for v, g in graph.grads]
        self.b.reports = [(n, vm.get(v, v)) for n, v in graph.reports]
        return self.b.build(vm.get(graph.loss, graph.loss) if loss is None else loss,
                            graph.facts if facts is None else facts)

    def annotations(self) -> tuple[tuple, tuple, tuple]:
        """The new ops' stages, chunks and kernel variants."""
        return tuple(self.stage), tuple(self.chunk), tuple(self.variant)
