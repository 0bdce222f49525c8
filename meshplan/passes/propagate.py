"""SBP propagation: choose, op by op, the signature with the least boxing cost.

Invariants:
- Ops are visited in graph (topological) order; for each mesh axis of size
  > 1 the op's rule lists its signatures (`OpRule.sbp`) and the one whose
  inputs cost the fewest bytes to box into is chosen; ties go to the rule's
  order. Axes of size 1 are Replicate throughout.
- Fixed layouts: data inputs Shard(0) on dp (and on ep: the data axes),
  Replicate on tp; parameters as the tensor-parallel plan says (Replicate on
  dp), an expert parameter Shard(0) (its expert dim) on ep, the others
  Replicate there; optimizer state follows
  its parameter; a gradient accumulator takes whatever its first use needs,
  and keeps it: a later use (a weight two stages read) boxes its
  contribution to the accumulator, never the accumulator to itself.
  Sharded data parallel (`zero`, a `ZeroLevel`) changes only these layouts
  at rest, on the data axes a state is Replicate on (`zero_layout`), for the roles its level shards
  (`ZeroLevel.shards`: the optimizer state, then the gradient accumulators,
  then the parameters); boxing then makes the reduce-scatters and
  all-gathers. A parameter the level regathers is
  seen whole over dp by its consumers (gathered before each use, as FSDP
  does), not split into a model-parallel op over the dp axis.
- A hint ({value: {axis: Sbp}}) re-boxes a value right after its producer;
  consumers see the hinted layout, and the cost of reaching it counts in the
  producer's choice. State updates are hinted back to their state's layout
  (a parameter stays in its layout across steps), and the loss and the
  graph's reports to Replicate.
- A value crossing a stage boundary arrives with its Partial axes reduced
  (they are reduced before the transfer), so nothing downstream of a stage
  boundary can need a Partial the transfer cannot carry.
- In the forward, a signature that makes a Partial from inputs that are not
  is charged its reduction (`reduce_cost`), which comes later, where greedy
  cannot see it: a forward's Partial is reduced before the loss (a
  scalar's is not charged: one all-reduce of a number, however reached). (A
  backward's is most often a weight's gradient, reduced once a step however
  many micro-batches there are, and inherent to data parallelism.)
- A gradient's sum (`grad_sum`, `OpRule.sums`) of two Partial contributions
  or more stays Partial, one reduction later: a Replicate contribution (a
  post-LN block's residual, beside its q, k and v projections' Partial
  input gradients) becomes its share where it is (`local_partial`: the
  axis's first rank keeps it, the others add zeros), not each Partial
  reduced to meet it. A Partial is otherwise never made from a value that
  is not one.
- Decisions are cached by (signature of the op, its input layouts), so a
  layer repeated 96 times is decided once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.ir import Graph, Phase, Role, TensorMeta
from meshplan.ir.choices import KernelVariant
from meshplan.ir.kinds import ACCUMULATE_GRAD, GRAD_SQ, VJP
from meshplan.ir.mesh import CP_ATTENTION
from meshplan.ir.sbp import NdSbp, Partial, Replicate, Sbp, Shard
from meshplan.ir.state_name import StateName
from meshplan.ir.zero import ZeroLevel
from meshplan.ops.infer import to_sig
from meshplan.ops.routed_experts import ROUTED
from meshplan.ops.rule import Category
from meshplan.ops.sbp_sig import SbpSig
from meshplan.ops.table import rule_for

R = Replicate()
INF = float("inf")
LATENCY_BYTES = 64 * 1024  # one collective's fixed cost, in bytes moved


@dataclass(frozen=True, slots=True)
class SbpAssignment:
    """Chosen signature per op (one per axis) and every value's layout."""

    sigs: dict            # op id -> tuple[SbpSig, ...] (one per axis)
    produced: dict        # value id -> NdSbp as its producer makes it
    visible: dict         # value id -> NdSbp consumers see (after hints)


def box_cost(src: Sbp, dst: Sbp, nbytes: int, n: int, settled: bool = False,
             shares: bool = False) -> float:
    """Bytes-equivalent cost of turning layout `src` into `dst` on an axis of
    n ranks; `settled`: `dst` is where the value is meant to stay (a hint's);
    `shares`: a Replicate may become the Partial its consumer sums (a local
    op, `local_partial`)."""
    if src == dst:
        return 0.0
    frac = (n - 1) / n
    if isinstance(dst, Partial):
        if shares and isinstance(src, Replicate):
            return 1e-3 * nbytes / n
        return INF  # a Partial is never made from a value that is not one
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return LATENCY_BYTES + 2 * frac * nbytes
        # A shard made from a Partial is usually gathered again later (one
        # more collective greedy cannot see yet): charge that latency now,
        # unless the shard is the layout the value is meant to keep.
        return (1 if settled else 2) * LATENCY_BYTES + frac * nbytes
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return LATENCY_BYTES + frac * nbytes
        return LATENCY_BYTES + frac * nbytes / n  # all-to-all
    return 1e-3 * nbytes / n  # Replicate -> Shard: a local slice


def reduce_cost(nbytes: int, n: int) -> float:
    """What a Partial an op makes costs later, at the least: someone reduces
    it (a reduce-scatter's bytes), which greedy would otherwise not see when
    it chooses the op (a combine's partial sums over experts, reduced after,
    against sending the experts' outputs back)."""
    return LATENCY_BYTES + (n - 1) / n * nbytes


DP_AXIS = 0


def zero_layout(layout: NdSbp, shape: tuple[int, ...], grid,
                data_axes: tuple[int, ...] = (DP_AXIS,)) -> NdSbp:
    """`layout` (a parameter's) sharded as ZeRO keeps a state at rest, over
    every data axis (of more than one rank) it is Replicate on: split on the
    first dim no other axis splits that has a row for each of those ranks,
    else the first with more than one (near-equal parts, the last ones a row
    shorter when the ranks do not divide it; over dp and ep, nested: dp's
    part split again by ep); unchanged when there is none (a tp-split bias).
    An expert weight, split over ep already, is sharded over dp alone; one
    not split (E experts, E < dp) is split on a wider dim than its experts,
    or the first dp/E ranks would hold it all."""
    taken = {s.dim for s in layout if isinstance(s, Shard)}
    over = [a for a in data_axes if grid[a] > 1 and layout[a] == R]
    free = [d for d, n in enumerate(shape) if d not in taken and n > 1]
    ranks = math.prod(grid[a] for a in over)
    dim = next((d for d in free if shape[d] >= ranks), free[0] if free else None)
    if dim is None or not over:
        return layout
    return tuple(Shard(dim) if a in over else s for a, s in enumerate(layout))


@dataclass(frozen=True, slots=True)
class ParamAxes:
    """Which grid axes mean what for the fixed layouts (`Strategy.axes`)."""

    tp: int = 1
    data: tuple[int, ...] = (DP_AXIS,)
    ep: int | None = None
    experts: frozenset = frozenset()  # parameter ids split over ep (their dim 0)
    cp: int | None = None  # the inputs' sequence (dim 1) split over it
    # attention on the cp axis: "allgather" (its queries' rows against keys and
    # values gathered), "alltoall" (heads or batch, DeepSpeed Ulysses), "auto": cheaper
    cp_attention: str = "auto"


def _input_layouts(graph: Graph, grid, param_tp: dict, axes: ParamAxes,
                   zero: ZeroLevel) -> tuple[dict[int, NdSbp], dict[int, NdSbp]]:
    """The graph inputs' layouts at rest, and as they would be without ZeRO."""
    layouts: dict[int, NdSbp] = {}
    params = {}
    for vid in graph.inputs:
        v = graph.values[vid]
        if v.role is Role.DATA:
            layouts[vid] = tuple(Shard(0) if a in axes.data and n > 1 and v.meta.shape else
                                 Shard(1) if a == axes.cp and len(v.meta.shape) > 1 else R
                                 for a, n in enumerate(grid))
        elif v.role is Role.PARAM:
            s = param_tp.get(vid, R) if grid[axes.tp] > 1 else R
            layouts[vid] = tuple(s if a == axes.tp else
                                 Shard(0) if a == axes.ep and vid in axes.experts else R
                                 for a in range(len(grid)))
            params[v.name] = (v, layouts[vid])
        elif v.role is Role.BUFFER:
            layouts[vid] = (R,) * len(grid)
    for vid in graph.inputs:
        v = graph.values[vid]
        owner = params.get(StateName.parse(v.name).fqn) if v.role in (Role.OPT_STATE,
                                                                       Role.GRAD) else None
        if v.role is Role.OPT_STATE and owner is None:
            layouts[vid] = (R,) * len(grid)  # a step-level scalar (the loss scale)
        elif v.role is Role.OPT_STATE and owner is not None:
            p, layout = owner
            layouts[vid] = layout if v.meta.shape == p.meta.shape else (R,) * len(grid)
        elif v.role is Role.GRAD and owner is not None and zero.shards(Role.GRAD):
            layouts[vid] = owner[1]  # fixed at rest (else laid out by its first use)
    whole = dict(layouts)
    for vid, layout in whole.items():
        v = graph.values[vid]
        if zero.shards(v.role) and v.meta.shape != ():
            layouts[vid] = zero_layout(layout, v.meta.shape, grid, axes.data)
    return layouts, whole


def state_hints(graph: Graph, layouts: dict[int, NdSbp], hints: dict) -> dict:
    """Hints that keep every state in its layout, and make the loss and the
    reports Replicate."""
    out = {k: dict(v) for k, v in hints.items()}
    by_name = {graph.values[v].name: v for v in graph.inputs}
    for u in graph.updates:
        layout = layouts.get(by_name.get(u.name, -1))
        if layout is not None:
            out.setdefault(u.value, {}).update(enumerate(layout))
    naxes = len(next(iter(layouts.values()))) if layouts else 0
    for v in (graph.loss, *(v for _, v in graph.reports)):
        out.setdefault(v, {}).update({a: R for a in range(naxes)})
    return out


def propagate_sbp(graph: Graph, op_stage, grid: tuple[int, ...], param_tp: dict,
                  hints: dict, axes: ParamAxes = ParamAxes(),
                  zero: ZeroLevel = ZeroLevel.NONE) -> SbpAssignment:
    """Choose each op's signatures; returns the layouts of every value
    (`zero`: the ZeRO level, which states rest sharded over the data axes)."""
    produced, whole = _input_layouts(graph, grid, param_tp, axes, zero)
    hints = state_hints(graph, produced, hints)
    visible = dict(produced)
    for v in graph.inputs_by_role(Role.PARAM) if zero.regathers else ():
        # consumers see the parameter as it is without ZeRO, as FSDP gathers
        # it before each use; boxing gathers it from its shard (and again per phase)
        visible[v.id] = whole[v.id]
    value_stage: dict[int, int] = {}
    optimizer_of = {op.args[1]: op for op in graph.ops if op.phase is Phase.OPTIMIZER
                    and rule_for(op.kind).category is Category.OPTIMIZER}
    sigs: dict[int, tuple] = {}
    cache: dict = {}
    op_cache: dict = {}
    all_axes = range(len(grid))
    meta_of = graph.values.__getitem__
    for op in graph.ops:
        stage = op_stage[op.id]
        refs = op.refs()
        have = [_arriving(visible.get(r), value_stage.get(r, stage) != stage) for r in refs]
        outs = tuple(None if o < 0 else meta_of(o).meta for o in op.outputs)
        sig_args = to_sig(op.args, lambda i: meta_of(i).meta)
        sig_kw = to_sig(op.kwargs, lambda i: meta_of(i).meta)
        # The choice is a function of this key: a layer repeated 96 times is chosen once.
        wanted = tuple(None if o not in hints else tuple(hints[o].get(a) for a in all_axes)
                       for o in op.outputs)
        op_key = (op.kind, sig_args, sig_kw, outs, tuple(have),
                  tuple(refs.index(r) for r in refs), wanted, op.phase is Phase.FORWARD)
        known = op_cache.get(op_key)
        if known is not None:
            chosen = known
        elif op.kind == GRAD_SQ:  # the optimizer's layouts, chosen as the optimizer will
            opt = optimizer_of[op.args[1]]
            opt_have = [_arriving(visible.get(r), value_stage.get(r, stage) != stage)
                        for r in opt.refs()]
            opt_sigs = _choose_axes(
                opt, opt.refs(), opt_have,
                tuple(None if o < 0 else meta_of(o).meta for o in opt.outputs),
                to_sig(opt.args, lambda i: meta_of(i).meta),
                to_sig(opt.kwargs, lambda i: meta_of(i).meta), grid, hints, cache, meta_of, axes)
            chosen = op_cache[op_key] = tuple(_squares_like(op, refs, have, outs, sig_args,
                                                            sig_kw, grid, opt_sigs))
        else:
            chosen = op_cache[op_key] = tuple(_choose_axes(
                op, refs, have, outs, sig_args, sig_kw, grid, hints, cache, meta_of, axes))
        sigs[op.id] = chosen
        for r, h, k in zip(refs, have, range(len(refs))):
            if h is None:  # a lazily laid-out input (gradient accumulator)
                produced[r] = visible[r] = tuple(s.ins[k] for s in chosen)
        for i, o in enumerate(op.outputs):
            if o < 0:
                continue
            layout = tuple(s.outs[i] for s in chosen)
            produced[o] = layout
            hint = hints.get(o)
            visible[o] = tuple(hint.get(a, x) for a, x in enumerate(layout)) if hint else layout
            value_stage[o] = stage
    return SbpAssignment(sigs, produced, visible)


def _choose_axes(op, refs, have, outs, sig_args, sig_kw, grid, hints, cache, meta_of,
                 axes: ParamAxes = ParamAxes()):
    """The op's signature on each mesh axis in turn, each chosen on the
    shapes the earlier axes' splits leave (on the cp axis, an attention's
    among the form `axes.cp_attention` names)."""
    whole = tuple(meta_of(r).meta.nbytes for r in refs)
    chosen: list[SbpSig] = []
    for axis, n in enumerate(grid):
        if n == 1:
            chosen.append(SbpSig((R,) * len(refs), tuple(None if o is None else R
                                                         for o in outs)))
            continue
        avail = tuple(h[axis] if h is not None else None for h in have)
        wanted = tuple(hints[o].get(axis) if o in hints else None for o in op.outputs)
        a_args, a_kw, a_outs, nbytes = sig_args, sig_kw, outs, whole
        if any(isinstance(x, Shard) for c in chosen for x in c.ins + c.outs):
            a_args, a_kw, a_outs, nbytes = _after_split(op, refs, outs, chosen, grid, meta_of)
        forward = op.phase is Phase.FORWARD
        form = _form(op, axis, axes)
        key = (op.kind, a_args, a_kw, a_outs, n, avail, wanted, forward, form)
        best = cache.get(key)
        if best is None:
            keep = FORMS[form]
            if op.kind == ACCUMULATE_GRAD and avail[0] is not None:
                keep = _keeps_accumulator(avail[0])
            best = cache[key] = _choose(op.kind, a_args, a_kw, a_outs, n, avail, nbytes,
                                        wanted, forward, keep)
        chosen.append(best)
    return chosen


def _keeps_accumulator(acc: Sbp):
    """An accumulator already laid out (by its first use, or at rest) is
    never boxed: it is None before a step's first micro-batch, and its
    update must rest where it does. The contribution comes to it instead
    (a parameter two stages read accumulates on each, in one layout)."""
    return lambda sig: sig.ins[0] == acc


def _squares_like(op, refs, have, outs, sig_args, sig_kw, grid, opt_sigs):
    """grad_sq's signature per axis: the one whose inputs are the optimizer's
    (`opt_sigs`), so both read the gradient through one conversion."""
    out = []
    for axis, (n, opt) in enumerate(zip(grid, opt_sigs)):
        if n == 1:
            out.append(SbpSig((R,) * len(refs), (R,)))
            continue
        rule = rule_for(op.kind).sbp
        assert rule is not None, f"{op.kind} has no SBP rule"
        cands = rule(sig_args, dict(sig_kw), outs, n)
        match = [c for c in cands if c.ins == opt.ins[:len(refs)]]
        assert match, f"no grad_sq signature reads {opt.ins} on axis {axis}"
        out.append(match[0])
    return out


def _split(meta: TensorMeta, layouts, grid) -> TensorMeta:
    """`meta` as one shard of the earlier axes sees it: a dim those axes split
    evenly shrinks; one split unevenly counts as 1 (no axis may split it
    again, or a view's local shapes would not line up)."""
    shape = list(meta.shape)
    for sbp, n in zip(layouts, grid):
        if isinstance(sbp, Shard):
            d = sbp.dim % len(shape)
            shape[d] = shape[d] // n if shape[d] % n == 0 else 1
    return TensorMeta(tuple(shape), meta.dtype)


def _after_split(op, refs, outs, chosen, grid, meta_of):
    """The signature arguments an op's later mesh axis is chosen from: the
    shapes left after the earlier axes' splits (each rule's divisibility
    checks then hold for the combined split, e.g. S(0) on dp and on tp),
    and the bytes of each input's part (what boxing on this axis moves)."""
    local: dict[int, TensorMeta] = {}
    nbytes = []
    for k, r in enumerate(refs):
        part = _split(meta_of(r).meta, [c.ins[k] for c in chosen], grid)
        local.setdefault(r, part)
        nbytes.append(part.nbytes)
    a_outs = tuple(None if m is None else _split(m, [c.outs[i] for c in chosen], grid)
                   for i, m in enumerate(outs))
    return (to_sig(op.args, local.__getitem__), to_sig(op.kwargs, local.__getitem__), a_outs,
            tuple(nbytes))


def _arriving(layout: NdSbp | None, crosses: bool) -> NdSbp | None:
    """The layout a consumer can get: Partial axes are reduced before a transfer."""
    if layout is None or not crosses:
        return layout
    return tuple(R if isinstance(s, Partial) else s for s in layout)


# kernels that communicate inside, along one axis: the ring's on the cp axis
# only, the routed experts' on the ep axis only (`_form`)
_INSIDE = (KernelVariant.RING, KernelVariant.EXPERTS)
# an attention's signatures each context-parallel form keeps (its first input:
# the queries, or the output's gradient, laid out as the queries); the ring
# only when named (its communication is inside the kernel, which boxing
# costs do not see)
CP_FORMS = {"auto": lambda sig: sig.variant not in _INSIDE,
            "allgather": lambda sig: sig.ins[0] == Shard(2) and sig.variant != KernelVariant.RING,
            "alltoall": lambda sig: sig.ins[0] in (Shard(0), Shard(1)),
            "ring": lambda sig: sig.variant == KernelVariant.RING}
assert tuple(CP_FORMS) == CP_ATTENTION, "each named form keeps its signatures"
FORMS = {**CP_FORMS, "experts": lambda sig: sig.variant != KernelVariant.RING}


def _form(op, axis: int, axes: ParamAxes) -> str:
    """The signatures `op` may take on `axis` (a key of `FORMS`)."""
    if axis == axes.cp and _is_attention(op):
        return axes.cp_attention
    return "experts" if axis == axes.ep and op.kind in ROUTED else "auto"


def _is_attention(op) -> bool:
    kind = op.args[0] if op.kind == VJP else op.kind
    return "scaled_dot_product" in kind


def _choose(kind, sig_args, sig_kw, outs, n, avail, nbytes, wanted,
            forward: bool = False, keep=None) -> SbpSig:
    """The cheapest signature (of those `keep` keeps, when given): boxing
    its inputs in, and its hinted outputs out; in the forward, a Partial it
    makes is charged its reduction."""
    rule = rule_for(kind).sbp
    assert rule is not None, f"{kind} has no SBP rule"
    candidates = rule(sig_args, dict(sig_kw), outs, n)
    if keep is not None and any(keep(c) for c in candidates):
        candidates = [c for c in candidates if keep(c)]
    best, best_cost = candidates[-1], INF
    # a sum of two Partials or more keeps them so (one reduction later, not
    # one each); with one, either way reduces once
    shares = rule_for(kind).sums and sum(isinstance(h, Partial) for h in avail) > 1
    for cand in candidates:
        cost = 0.0
        for need, h, b in zip(cand.ins, avail, nbytes):
            if h is not None:
                cost += box_cost(h, need, b, n, shares=shares)
            if cost >= best_cost:
                break
        made_partial = forward and not any(isinstance(s, Partial) for s in cand.ins)
        for got, want, meta in zip(cand.outs, wanted, outs):
            if want is not None and got is not None:
                cost += box_cost(got, want, meta.nbytes, n, settled=True)
            elif made_partial and isinstance(got, Partial) and meta.shape:
                cost += reduce_cost(meta.nbytes, n)
        if cost < best_cost:
            best, best_cost = cand, cost
    return best
