"""All-reduces of values made from the data alone, started early.

Cross-entropy's mean divides by the count of targets over the whole batch
(`ops/canonical.py`), a sum over dp that the forward's last op waits for.
The count needs only the targets, so its ops and its all-reduce can run
first in their task group, in the background while the group computes,
and be waited where the plan has the all-reduce. DDP has no such
collective (each rank divides by its own count); without this one, every
micro-batch's forward ends in a barrier over dp.

Invariants:
- A value is made from the data alone when its op reads only data inputs
  (`Role.DATA`) or such values; only ops whose outputs are small
  (`SMALL_BYTES` each) are moved, so no large value lives longer.
- An early all-reduce is a collective task over more than one rank whose
  input such an op of the same task group makes. Its ops (those it needs
  of them) run first in the group, in their order; right after the last
  of them, the all-reduce starts (a hook); its own task, where it stands,
  waits for it. Every rank of the group does the same from the same plan,
  so the group's collectives are issued in the same order everywhere.
- The memory layout does not see the move: the moved values are the few
  bytes of a count (`SMALL_BYTES` bounds them).
"""

from __future__ import annotations

from meshplan.ir import Role
from meshplan.ir.kinds import ALL_REDUCE
from meshplan.lowering.rankplan import TaskKind

SMALL_BYTES = 64 * 1024


class EarlyCollectives:
    """This rank's early all-reduces: which, their order, hooks and kernels."""

    def __init__(self, view, comm):
        """`view`: the rank's `StageView`."""
        self.view, self.comm = view, comm
        self.data = {v.id for v in view.inputs_by_role(Role.DATA)}
        self.flight: dict[int, tuple] = {}  # collective op id -> (work, result)

    def order(self, tasks: list) -> tuple[list, dict, dict]:
        """(`tasks` in run order, hooks {op id: (fn, [value id])}, kernels
        {op id: callable}) for one task group."""
        g = self.view
        made: dict[int, object] = {}  # data-made value -> the task making it
        for t in tasks:
            op = g.op_of[t.op]
            if (t.kind is not TaskKind.COLLECTIVE and op.refs()
                    and all(r in self.data or r in made for r in op.refs())
                    and all(o < 0 or g.values[o].meta.nbytes <= SMALL_BYTES
                            for o in op.outputs)):
                made.update((o, t) for o in op.outputs if o >= 0)
        early = [t for t in tasks if t.kind is TaskKind.COLLECTIVE and len(t.group) > 1
                 and g.op_of[t.op].kind == ALL_REDUCE and g.op_of[t.op].args[0].id in made]
        if not early:
            return list(tasks), {}, {}
        need: set[int] = set()  # the tasks the early all-reduces' inputs come from
        stack = [made[g.op_of[t.op].args[0].id] for t in early]
        while stack:
            t = stack.pop()
            if t.id not in need:
                need.add(t.id)
                stack += [made[r] for r in g.op_of[t.op].refs() if r in made]
        first = [t for t in tasks if t.id in need]
        hooks, kernels = {}, {}
        for t in early:
            op = g.op_of[t.op]
            src = op.args[0].id
            assert made[src].op not in hooks, "two early all-reduces of one value"
            hooks[made[src].op] = (self._starter(t.op, t.group, dict(op.kwargs)["op"]), [src])
            kernels[t.op] = self._waiter(t.op)
        return first + [t for t in tasks if t.id not in need], hooks, kernels

    def _starter(self, op_id: int, group, kind: str):
        def start(values):
            out = values[0].clone()
            self.flight[op_id] = (self.comm.all_reduce_async(out, group, kind, name="early"),
                                  out)
        return start

    def _waiter(self, op_id: int):
        def wait(*_, **__):
            work, out = self.flight.pop(op_id)
            work.wait()
            return out
        return wait
