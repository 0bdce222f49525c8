"""Shared parameters across stages: one copy per stage that reads it, one
reduced gradient, the same update on every copy (Megatron's embedding group).

A tied parameter (`wte.weight` used by the embedding on the first stage and
by the LM head on the last) is one graph input. Graph inputs are local to
every stage, so each stage that reads it already holds a copy; what this
pass fixes is the gradient and the update:

    before (autodiff)                       after (pp = 2, W read on stages 0, 1)
    g = grad_sum(g_head, g_emb)             stage 1: acc1 = accumulate(W@grad, g_head)
    acc = accumulate(W@grad, g)             stage 0: acc0 = accumulate(W@grad, g_emb)
    W' = opt(W, acc, slots)                 stage s: W's = opt(W, acc_s, slots)   (s = 0, 1)

Invariants:
- Each stage's accumulator holds the sum of that stage's uses only: a
  Partial across the placements of the copies. The pass records it in
  `copies` ({acc_s value id: (stages, name)}), and boxing makes it Replicate the
  way it makes any Partial Replicate: one all-reduce, here over the group
  of ranks at the same (dp, tp) coordinate on each copy's stage, once per
  step in the optimizer phase (passes/boxing.py). So the gradient crosses
  stages once per step, not once per micro-batch.
- Every copy's optimizer op is the original op (same kind, same
  hyper-parameters) on the reduced gradient and its own slots, so copies
  that start equal stay equal; `lowering/check.py` proves both facts on the
  rank plans (proof 5).
- A stage's accumulation runs right after the last op on that stage that
  makes one of its contributions, in that op's chunk; the copy's optimizer
  op sits with its first forward reader on that stage.
- With clipping, every copy takes the squared norm (`meshplan.grad_sq`) of
  its reduced gradient, so every stage's cross-stage reductions come in one
  order, the tied weight's before the norm's; the copies hold the same sum,
  which only the first copy counts (the others: `counted=False`, zero).
- Names: every copy updates the same state names (`W`, `W@grad`, `W@<slot>`)
  on its own ranks, so checkpoints and weights see one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.errors import ConfigError
from meshplan.ir import Graph, GraphBuilder, Op, Phase, Ref, Role, Update
from meshplan.ir.builder import renumber_ops
from meshplan.ir.kinds import ACCUMULATE_GRAD, GRAD_SQ, GRAD_SUM, SQ_SUM
from meshplan.ir.state_name import StateName

Place = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Shared:
    """The rewritten graph, each op's (stage, chunk), and the per-stage
    partial gradients boxing must sum across the copies."""

    graph: Graph
    places: tuple[Place, ...]
    copies: dict  # acc value id -> (stages holding a copy, sorted; parameter name)


def share_params(graph: Graph, places: list[Place], readers: dict[int, dict[int, int]]) -> Shared:
    """Give each stage in `readers[pid]` ({stage: first forward op reading
    it}) its own accumulation and optimizer op for parameter `pid`."""
    shared = {pid: st for pid, st in readers.items() if len(st) > 1}
    if not shared:
        return Shared(graph, tuple(places), {})
    rw = _Rewrite(graph, places)
    for pid, stages in sorted(shared.items()):
        rw.split(pid, stages)
    return rw.build()


class _Rewrite:
    """The edits of one `share_params`: ops dropped, replaced, inserted."""

    def __init__(self, graph: Graph, places: list[Place]):
        self.graph, self.places = graph, places
        self.b = GraphBuilder(graph)
        self.producer = {o: op for op in graph.ops for o in op.outputs if o >= 0}
        self.drop: set[int] = set()
        self.after: dict[int, list[tuple[Op, Place]]] = {}    # op id -> ops inserted after
        self.instead: dict[int, list[tuple[Op, Place]]] = {}  # op id -> ops replacing it
        self.updates = list(graph.updates)
        self.copies: dict[int, tuple[tuple[int, ...], str]] = {}
        self.extra_squares: list[Ref] = []  # the copies' uncounted squares, for the norm's sum
        self.fresh = iter(range(len(graph.ops), 1 << 62))   # provisional ids of new ops

    def split(self, pid: int, stages: dict[int, int]) -> None:
        g, name = self.graph, self.graph.values[pid].name
        acc_op = next((op for op in g.ops if op.kind == ACCUMULATE_GRAD
                       and g.values[op.ref(0).id].name == str(StateName.grad(name))), None)
        if acc_op is None:
            return  # not trained: each copy stays as loaded
        opt_op = next(op for op in g.ops if op.phase is Phase.OPTIMIZER and op.args
                      and op.args[0] == Ref(pid) and op.kind != GRAD_SQ)
        total = self.producer[acc_op.ref(1).id]
        contribs = [total.ref(i) for i in range(len(total.args))] if total.kind == GRAD_SUM \
            else [acc_op.ref(1)]
        self.drop |= {acc_op.id} | ({total.id} if total.kind == GRAD_SUM else set())
        by_stage: dict[int, list[Ref]] = {}
        for c in contribs:
            by_stage.setdefault(self.places[self.producer[c.id].id][0], []).append(c)
        if set(by_stage) != set(stages):
            raise ConfigError(
                f"parameter '{name}' is read on stages {sorted(stages)} but its gradient "
                f"comes from stages {sorted(by_stage)}; a shared parameter needs a gradient "
                "on every stage that reads it (make every use differentiable, or untie it)")
        order = tuple(sorted(stages))
        replaced = []
        for s in order:
            acc = self._accumulate(by_stage[s], total, acc_op)
            self.copies[acc] = (order, name)
            outs = _new_values(self.b, opt_op.outputs)
            args = (opt_op.args[0], Ref(acc), *opt_op.args[2:])
            replaced.append((replace(opt_op, id=next(self.fresh), args=args, outputs=outs),
                             (s, self.places[stages[s]][1])))
            old = {u.value: u.name for u in g.updates}
            self.updates += [Update(old[o], n) for o, n in zip(opt_op.outputs, outs) if o in old]
        self.instead[opt_op.id] = replaced
        square = next((op for op in g.ops if op.kind == GRAD_SQ and op.args[0] == Ref(pid)), None)
        if square is not None:
            self._squares(square, replaced)

    def _squares(self, square: Op, replaced: list[tuple[Op, Place]]) -> None:
        """Clipping: every copy takes its reduced gradient's squared norm (so
        every stage reduces it before its norm), the first copy's counted,
        the others' zero (`counted=False`)."""
        out = []
        for i, (opt, at) in enumerate(replaced):
            outputs = square.outputs if i == 0 else _new_values(self.b, square.outputs)
            kwargs = square.kwargs if i == 0 else square.kwargs + (("counted", False),)
            out.append((replace(square, id=next(self.fresh), args=opt.args[:len(square.args)],
                                outputs=outputs, kwargs=kwargs), at))
            if i:
                self.extra_squares.append(Ref(outputs[0]))
        self.instead[square.id] = out

    def _accumulate(self, grads: list[Ref], total: Op, acc_op: Op) -> int:
        """One stage's sum of `grads` into its accumulator, right after the
        last of them is made; returns the accumulated value."""
        last = max((self.producer[x.id] for x in grads), key=lambda o: o.id)
        at = self.places[last.id]
        new: list[tuple[Op, Place]] = []
        grad = grads[0]
        if len(grads) > 1:
            (out,) = _new_values(self.b, [grads[0].id])
            new.append((replace(total, id=next(self.fresh), args=tuple(grads), outputs=(out,)),
                        at))
            grad = Ref(out)
        (acc,) = _new_values(self.b, acc_op.outputs)
        new.append((replace(acc_op, id=next(self.fresh), args=(acc_op.args[0], grad),
                            outputs=(acc,)), at))
        self.after.setdefault(last.id, []).extend(new)
        self.updates.append(Update(self.graph.values[acc_op.ref(0).id].name, acc))
        return acc

    def build(self) -> Shared:
        ops: list[Op] = []
        places: list[Place] = []
        for op in self.graph.ops:
            if op.kind == SQ_SUM and self.extra_squares:
                op = replace(op, args=op.args + tuple(self.extra_squares))
            if op.id in self.instead:
                for o, p in self.instead[op.id]:
                    ops.append(o)
                    places.append(p)
            elif op.id not in self.drop:
                ops.append(op)
                places.append(self.places[op.id])
            for o, p in self.after.get(op.id, ()):
                ops.append(o)
                places.append(p)
        gone = {o for i in self.drop | set(self.instead) for o in self.graph.ops[i].outputs}
        b = self.b
        b.ops = list(renumber_ops(ops))
        b.updates = [u for u in self.updates if u.value not in gone]
        b.grads = [(v, x) for v, x in b.grads if x not in gone]
        return Shared(b.build(self.graph.loss, self.graph.facts), tuple(places), self.copies)


def _new_values(b: GraphBuilder, like) -> tuple[int, ...]:
    return tuple(-1 if v < 0 else b.new_value(b.values[v].meta) for v in like)


def param_readers(graph: Graph, places: list[Place]) -> dict[int, dict[int, int]]:
    """{param id: {stage: first forward op on that stage reading it}}."""
    params = {v.id for v in graph.inputs_by_role(Role.PARAM)}
    out: dict[int, dict[int, int]] = {}
    for op in graph.ops:
        if op.phase is not Phase.FORWARD:
            continue
        for r in op.refs():
            if r in params:
                out.setdefault(r, {}).setdefault(places[op.id][0], op.id)
    return out
