"""Proof 8 of `lowering/check.py`: the gradient norm counts every parameter
exactly once, on every rank.

Global-norm clipping (`autodiff/backward.py: _emit_clip`) sums squared norms
of local gradient pieces, then all-reduces the sums. Proven on the rank
plans, as the runtime will run them:
- a rank counts the piece of a gradient that its `grad_sq` task reads (the
  box its layout gives the rank), unless the task's variant on some axis is
  REPLICA_FIRST and the rank is not that axis's first, or the op is a tied
  weight's copy counted on another stage (`counted=False`): it gives zero;
- a rank's total is its `sq_sum` of those squares, then each all-reduce
  (boxing's, across stages or along a mesh axis) between that sum and its
  `clip_coef`, in order: after all-reduce k over group G, a rank holds the
  sum over G of what each member held after all-reduce k-1;
- so each rank's factor comes from a multiset of ranks' counted pieces,
  and for every trained parameter those pieces must tile it exactly: every
  element counted once, none twice, none left out.
The multisets are interned group by group (an all-reduce's is the sum of
its members', named once per group) and expanded once per distinct final
one; pieces overlap when they share an elementary cell of all pieces'
bounds. So the proof is linear in the ranks and their pieces for a job's
usual groups, not quadratic.
"""

from __future__ import annotations

import itertools
from collections import Counter

from meshplan.ir import Op, Ref
from meshplan.ir.job import Job
from meshplan.ir.kinds import ALL_REDUCE, CLIP_COEF, GRAD_SQ, SQ_SUM
from meshplan.ir.sbp import box_numel, local_box
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for

FIRST = "replica_first"  # KernelVariant.REPLICA_FIRST


def norm_coverage(job, plans) -> list[str]:
    """Errors of proof 8 (empty when the norm counts each parameter once)."""
    g = job.graph
    if not clips(job):
        return []
    producer, trained = producers(g), trained_shapes(g)
    errors: list[str] = []
    counted: dict[int, list] = {}
    chains: dict[int, list[tuple[int, ...]]] = {}
    for r, p in sorted(plans.items()):
        got = norm_terms(g, producer, p.tasks)
        if got is None:
            continue
        if isinstance(got, str):
            errors.append(f"rank {r}: {got}")
            continue
        chain, terms = got
        chains[r] = [t.group for t in chain]
        counted[r] = [(name, _local_box(job, r, vid)) for name, vid, variant in terms
                      if not any(tag == FIRST and c != 0 for tag, c in zip(variant, p.coord))]
    if errors or not chains:
        return errors
    finals = _sources(chains)
    if finals is None:
        return ["the ranks' norms are reduced by different numbers of all-reduces; "
                "recompile the plan"]
    final, expand = finals
    by_id: dict[int, list[str]] = {}
    by_sources: dict[frozenset, list[str]] = {}  # distinct ids may bring the same ranks
    for r in sorted(final):
        if final[r] not in by_id:
            src = expand(final[r])
            key = frozenset(src.items())
            if key not in by_sources:
                by_sources[key] = _tiles(src, counted, trained)
            by_id[final[r]] = by_sources[key]
        errors += [f"rank {r}: the gradient norm {e}" for e in by_id[final[r]][:3]]
    return errors


def clips(job: Job) -> bool:
    return any(op.kind == CLIP_COEF for op in job.graph.ops)


def producers(g) -> dict[int, Op]:
    return {o: op for op in g.ops for o in op.outputs if o >= 0}


def trained_shapes(g) -> dict[str, tuple[int, ...]]:
    """Each trained parameter's name and logical shape."""
    producer = producers(g)
    return {g.values[_root(op.args[0].id, producer)].name: g.values[op.args[0].id].meta.shape
            for op in g.ops if rule_for(op.kind).category is Category.OPTIMIZER}


def norm_terms(g, producer, tasks):
    """What a plan's clipping factor sums: (the all-reduce tasks from its
    sum of squares to the factor, first applied first; per grad_sq task it
    counts, (parameter name, the squared value's id, the task's variant));
    None without a factor; a reason (one line) when it is not such a sum.
    A tied weight's copy that another stage counts (`counted=False`) is left
    out; a replica's (REPLICA_FIRST) is the caller's to leave out."""
    by_op = {t.op: t for t in tasks}
    coef = next((t for t in tasks if g.ops[t.op].kind == CLIP_COEF), None)
    if coef is None:
        return None
    chain, total = _chain(g.ops[coef.op].args[0].id, producer, by_op)
    if total is None:
        return ("its clipping factor does not come from a sum of squared gradient norms; "
                "recompile the plan")
    terms = []
    for a in total.args:
        assert isinstance(a, Ref)
        sq = producer.get(a.id)
        task = by_op.get(sq.id) if sq is not None else None
        if sq is None or sq.kind != GRAD_SQ or task is None:
            return "its norm sums a value no grad_sq task of its own makes; recompile the plan"
        if dict(sq.kwargs).get("counted") is False:
            continue  # a tied weight's copy another stage counts
        terms.append((g.values[_root(sq.args[0].id, producer)].name, sq.args[1].id,
                      task.variant))
    return chain, terms


def _root(vid: int, producer) -> int:
    """The state `vid` is made from through boxing ops (a parameter sliced or
    gathered for its optimizer): its graph input."""
    op = producer.get(vid)
    while op is not None and rule_for(op.kind).category.boxing:
        vid = op.args[0].id
        op = producer.get(vid)
    return vid


def _chain(vid: int, producer, by_op) -> tuple[list, Op | None]:
    """The tasks of the all-reduces (over more than one rank) from the norm's
    sum to `vid`, first applied first, and that `sq_sum` op (None if the
    chain meets another op)."""
    groups: list = []
    op = producer.get(vid)
    while op is not None and op.kind == ALL_REDUCE:
        task = by_op.get(op.id)
        if task is not None and len(task.group) > 1:
            groups.append(task)
        op = producer.get(op.args[0].id)
    if op is None or op.kind != SQ_SUM:
        return groups, None
    return groups[::-1], op


def _sources(chains: dict[int, list[tuple[int, ...]]]):
    """Per rank, which ranks' counted pieces reach its total, and how often:
    (rank -> the id of that multiset, id -> the multiset as a Counter of
    ranks); None when the chains differ in length. A multiset is interned:
    the one an all-reduce over a group leaves is the sum of its members',
    named once per distinct group, so the work is the groups' sizes, not
    ranks x ranks; a multiset is expanded only when asked (once per distinct
    final one, usually one for the whole job)."""
    if len({len(c) for c in chains.values()}) > 1:
        return None
    parts: dict[int, Counter] = {}  # id -> Counter of earlier ids (ranks are ids < 0)
    held = {r: -1 - r for r in chains}
    for k in range(len(next(iter(chains.values())))):
        memo: dict[tuple[int, ...], int] = {}
        new = {}
        for r, chain in chains.items():
            group = chain[k]
            if group not in memo:
                memo[group] = len(parts)
                parts[len(parts)] = Counter(held[m] for m in group if m in held)
            new[r] = memo[group]
        held = new
    expanded: dict[int, Counter] = {}

    def expand(i: int) -> Counter:
        if i < 0:
            return Counter({-1 - i: 1})
        if i not in expanded:
            total: Counter = Counter()
            for j, times in parts[i].items():
                for rank, n in expand(j).items():
                    total[rank] += n * times
            expanded[i] = total
        return expanded[i]

    return held, expand


def _tiles(src: Counter, counted: dict, trained: dict) -> list[str]:
    """What is wrong with the pieces `src` brings together, per parameter."""
    pieces: dict[str, list] = {name: [] for name in trained}
    for rank, times in src.items():
        for name, box in counted.get(rank, ()):
            pieces.setdefault(name, []).extend([box] * times)
    return tiling_errors(pieces, trained)


def tiling_errors(pieces: dict[str, list], trained: dict) -> list[str]:
    """What is wrong with each parameter's `pieces` (boxes, one per count):
    left out, in part or whole, or counted more than once."""
    out = []
    for name, boxes in sorted(pieces.items()):
        whole = 1
        for n in trained.get(name, ()):
            whole *= n
        got = sum(box_numel(b) for b in boxes)
        if not boxes:
            out.append(f"leaves out '{name}': no rank whose squares reach it counts it")
        elif _overlap(boxes):
            out.append(f"counts '{name}' more than once ({len(boxes)} pieces cover "
                       f"{got / whole:g}x its {whole} elements)")
        elif got != whole:
            out.append(f"leaves out part of '{name}' ({got} of its {whole} elements)")
    return out


def _overlap(boxes: list) -> bool:
    """Whether any two boxes share an element: each box is cut into the
    elementary cells that all boxes' bounds make, and a cell met twice is
    shared. The work is the cells the boxes cover (a tiling of n shards: n),
    not n x n pairs."""
    cuts = [sorted({b for box in boxes for b in box[d]}) for d in range(len(boxes[0]))]
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    seen: set[tuple[int, ...]] = set()
    for box in boxes:
        ranges = [range(index[d][a], index[d][b]) for d, (a, b) in enumerate(box)]
        for cell in itertools.product(*ranges):
            if cell in seen:
                return True
            seen.add(cell)
    return False


def _local_box(job: Job, rank: int, vid: int):
    """The logical slice of value `vid` that `rank` holds."""
    place = job.strategy.placement(job.strategy.stage_of_rank(rank))
    return local_box(job.graph.values[vid].meta.shape, job.sbp[vid], place.grid,
                     place.coord(rank))
