"""Proof 5 of `lowering/check.py`: every copy of a parameter takes the same update.

A parameter read on several stages (a tied weight, passes/shared.py) has a
copy on each. Proven on the rank plans, per (parameter, grid coordinate):
- every rank that reads a trained parameter's state runs an optimizer task
  on it (no copy is left stale);
- where copies sit on several stages, their optimizer tasks are one op kind
  with one set of hyper-parameters, and each task's gradient comes (through
  boxing ops only) from one all-reduce across exactly those stages, which
  every copy's rank runs with the same group: the ranks at that coordinate
  on each copy's stage, in stage order. So every copy adds the same reduced
  gradient with the same arithmetic.
"""

from __future__ import annotations

from meshplan.ir import Ref, Role
from meshplan.lowering.rankplan import TaskKind
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for


def shared_copies(job, plans) -> list[str]:
    """Errors of proof 5 (empty when every copy is updated alike)."""
    g = job.graph
    producer = {o: op for op in g.ops for o in op.outputs if o >= 0}
    trained = {op.args[0].id for op in g.ops
               if rule_for(op.kind).category is Category.OPTIMIZER}
    errors: list[str] = []
    copies: dict[tuple[int, tuple], list] = {}  # (param, coord) -> [(stage, rank, task)]
    for r, p in sorted(plans.items()):
        value_of = {b.id: b.value for b in p.buffers}
        read = {value_of[i] for t in p.tasks if t.kind is TaskKind.COMPUTE for i in t.inputs
                if i in value_of and g.values[value_of[i]].role is Role.PARAM}
        updated = {}
        for t in p.tasks:
            if t.kind is TaskKind.OPTIMIZER:
                updated[g.ops[t.op].args[0].id] = t
        for pid in sorted((read & trained) - set(updated)):
            errors.append(f"rank {r} (stage {p.stage}) reads parameter '{g.values[pid].name}' "
                          "but runs no optimizer task on it: its copy would go stale; "
                          "recompile the plan")
        for pid, t in updated.items():
            copies.setdefault((pid, p.coord), []).append((p.stage, r, t))
    tasks = {r: {(t.op, t.group) for t in p.tasks if t.kind is TaskKind.GRAD_REDUCE}
             for r, p in plans.items()}
    for (pid, coord), held in sorted(copies.items()):
        if len({s for s, _, _ in held}) > 1:
            errors += _alike(job, pid, coord, sorted(held), producer, tasks)
    return errors


def _alike(job, pid: int, coord, held, producer, tasks) -> list[str]:
    g = job.graph
    name = g.values[pid].name
    stages = tuple(s for s, _, _ in held)
    group = tuple(r for _, r, _ in held)
    ops = [g.ops[t.op] for _, _, t in held]
    if len({(op.kind, _literals(op)) for op in ops}) > 1:
        return [f"the copies of '{name}' on stages {list(stages)} (grid {coord}) take "
                f"different optimizer ops: {sorted({op.kind for op in ops})}; every copy "
                "must take the same update"]
    errors = []
    for (stage, rank, _), op in zip(held, ops):
        red = _reduction(op.args[1].id, producer)
        if red is None or dict(red.kwargs).get("stages") != stages:
            errors.append(f"rank {rank}: the gradient of the copy of '{name}' on stage {stage} "
                          f"is not all-reduced across the copies' stages {list(stages)}; "
                          "each copy would step on its own stage's part of the gradient")
        elif (red.id, group) not in tasks.get(rank, ()):
            errors.append(f"rank {rank}: the all-reduce of '{name}' (op {red.id}) does not "
                          f"run over the copies' ranks {list(group)}")
    return errors


def _literals(op) -> tuple:
    """An optimizer op's hyper-parameters: its kwargs less the tensors (each
    stage's own clipping factor, proven equal by proof 8's coverage)."""
    return tuple((k, v) for k, v in op.kwargs if not isinstance(v, Ref))


def _reduction(vid: int, producer):
    """The cross-stage all-reduce `vid` comes from through boxing ops, if any."""
    op = producer.get(vid)
    while op is not None and rule_for(op.kind).category.boxing:
        if "stages" in dict(op.kwargs):
            return op
        op = producer.get(op.args[0].id)
    return None
