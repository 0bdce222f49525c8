"""An append-only builder for `Graph`.

Invariant: ids are handed out densely in creation order, so a graph built
twice from the same inputs is identical, value ids included.
"""

from __future__ import annotations

from meshplan.ir.graph import ABSENT, Arg, Graph, Op, Phase, Role, TensorMeta, Update, Value
from meshplan.ir.graph_facts import GraphFacts


class GraphBuilder:
    """Collects values and ops, then freezes them into a `Graph`."""

    def __init__(self, base: Graph | None = None):
        self.values: list[Value] = list(base.values) if base else []
        self.ops: list[Op] = list(base.ops) if base else []
        self.inputs: list[int] = list(base.inputs) if base else []
        self.updates: list[Update] = list(base.updates) if base else []
        self.grads: list[tuple[int, int]] = list(base.grads) if base else []
        self.reports: list[tuple[str, int]] = list(base.reports) if base else []

    def new_value(self, meta: TensorMeta, role: Role = Role.INTERNAL, name: str = "") -> int:
        vid = len(self.values)
        self.values.append(Value(vid, meta, role, name))
        return vid

    def add_input(self, meta: TensorMeta, role: Role, name: str) -> int:
        vid = self.new_value(meta, role, name)
        self.inputs.append(vid)
        return vid

    def add_op(
        self,
        kind: str,
        args: tuple[Arg, ...],
        out_metas: tuple[TensorMeta | None, ...],
        *,
        kwargs: tuple[tuple[str, Arg], ...] = (),
        phase: Phase = Phase.FORWARD,
        module_path: str = "",
        source: str = "",
        grad_of: int = -1,
    ) -> tuple[int, ...]:
        """Append an op; returns the ids of its fresh output values.

        A `None` meta is an output the kernel leaves undefined (a gradient
        the op was told not to compute); its id is `ABSENT`."""
        outs = tuple(ABSENT if m is None else self.new_value(m) for m in out_metas)
        self.ops.append(
            Op(len(self.ops), kind, args, outs, kwargs, phase, module_path, source, grad_of)
        )
        return outs

    def meta(self, vid: int) -> TensorMeta:
        return self.values[vid].meta

    def build(self, loss: int, facts: GraphFacts | None = None) -> Graph:
        return Graph(
            values=tuple(self.values),
            ops=tuple(self.ops),
            inputs=tuple(self.inputs),
            loss=loss,
            updates=tuple(self.updates),
            facts=GraphFacts() if facts is None else facts,
            grads=tuple(self.grads),
            reports=tuple(self.reports),
        )


def renumber_ops(ops: list[Op]) -> tuple[Op, ...]:
    """Give ops dense ids in list order, remapping `grad_of` links."""
    remap = {op.id: i for i, op in enumerate(ops)}
    return tuple(
        op.renumbered(i, remap.get(op.grad_of, -1)) for i, op in enumerate(ops)
    )
