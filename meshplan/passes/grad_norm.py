"""Global-norm clipping across stages: each stage sums its own gradients'
squares, and one all-reduce across the stages makes the total.

Autodiff emits one logical norm (`autodiff/backward.py: _emit_clip`):

    sq_i = grad_sq(p_i, g_i, slots_i)        with p_i, on p_i's stage
    total = sq_sum(sq_1, ..., sq_n)          one op reading every stage
    norm, coef = clip_coef(total)            read by every optimizer op

After this pass (pp = 2; stage s holds parameters P_s):

    stage s: part_s = sq_sum(sq_i for i in P_s)      Partial across the stages
             norm_s, coef_s = clip_coef(part_s)      read by stage s's optimizer ops

Invariants:
- Every stage that runs an optimizer op gets a part (a stage whose
  gradients are all counted elsewhere, a tied copy's, sums nothing: zero)
  and its own factor; every part is Partial across those stages. Boxing
  makes it Replicate as it does a tied weight's per-stage gradient, by one
  all-reduce across the stages (`param` GRAD_NORM), before the Partial
  mesh axes are reduced (`passes/boxing.py`). So every rank ends with the
  same total, and every copy of `clip_coef` computes the same factor.
- Which pieces each rank counts, and over which ranks the total sums, are
  the layouts' (`ops/sbp_nn.py: grad_sq`): `lowering/check_norm.py` proves
  from the rank plans that every parameter is counted exactly once.
- Every copy's norm updates the state GRAD_NORM on its own ranks.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.ir import DEVICE, GRAD_NORM, Graph, GraphBuilder, Op, Ref, Update
from meshplan.ir.builder import renumber_ops
from meshplan.ir.kinds import CLIP_COEF, SQ_SUM
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for

Place = tuple[int, int]


def split_norm(graph: Graph, places: list[Place]) -> tuple[Graph, list[Place], dict]:
    """`graph` with the norm summed per stage and across stages; the new
    places, and the parts Partial across stages ({value: (stages, GRAD_NORM)})."""
    total = next((op for op in graph.ops if op.kind == SQ_SUM), None)
    if total is None:
        return graph, places, {}
    coef_op = next(op for op in graph.ops if op.kind == CLIP_COEF)
    producer = {o: op for op in graph.ops for o in op.outputs if o >= 0}
    optimizers = [op for op in graph.ops if rule_for(op.kind).category is Category.OPTIMIZER]
    optimizer_ids = {op.id for op in optimizers}
    stages = sorted({places[op.id][0] for op in optimizers})
    if len(stages) == 1:
        return graph, places, {}
    b = GraphBuilder(graph)
    by_stage: dict[int, list[Ref]] = {s: [] for s in stages}
    for r in total.args:
        assert isinstance(r, Ref)
        by_stage[places[producer[r.id].id][0]].append(r)
    first_opt: dict[int, Op] = {}
    for op in optimizers:
        first_opt.setdefault(places[op.id][0], op)
    fresh = iter(range(len(graph.ops), 1 << 62))
    made: list[tuple[Op, Place]] = []
    coef_of: dict[int, int] = {}
    copies: dict[int, tuple] = {}
    updates = [u for u in graph.updates if u.name != GRAD_NORM]
    for s in stages:
        at = places[first_opt[s].id]
        part = b.new_value(graph.values[total.outputs[0]].meta)
        kw = () if by_stage[s] else (("device", DEVICE),)
        made.append((replace(total, id=next(fresh), args=tuple(by_stage[s]), outputs=(part,),
                             kwargs=kw), at))
        norm, coef = (b.new_value(graph.values[o].meta) for o in coef_op.outputs)
        made.append((replace(coef_op, id=next(fresh), args=(Ref(part),),
                             outputs=(norm, coef)), at))
        copies[part] = (tuple(stages), GRAD_NORM)
        coef_of[s] = coef
        updates.append(Update(GRAD_NORM, norm))
    old_coef = Ref(coef_op.outputs[1])
    ops: list[Op] = []
    new_places: list[Place] = []
    for op in graph.ops:
        if op.id == total.id:
            for o, p in made:
                ops.append(o)
                new_places.append(p)
            continue
        if op.id == coef_op.id:
            continue
        if op.id in optimizer_ids:
            stage = places[op.id][0]
            op = replace(op, kwargs=tuple((k, Ref(coef_of[stage]) if v == old_coef else v)
                                          for k, v in op.kwargs))
        ops.append(op)
        new_places.append(places[op.id])
    b.ops = list(renumber_ops(ops))
    b.updates = updates
    return b.build(graph.loss, graph.facts), new_places, copies
