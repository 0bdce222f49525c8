"""Boxing: turn every layout mismatch into explicit communication ops.

Invariants:
- After this pass every op reads each input in exactly the layout its chosen
  signature needs, and on its own stage: mismatches became ops.
- One op per axis and step (`conversion_steps`: nested shards of one dim
  are cut outer axis first and joined inner axis first), the conversions being
    P -> R  all_reduce        P -> S(d)  reduce_scatter
    S(d) -> R  all_gather     S(i) -> S(j)  all_to_all
    R -> S(d)  local_slice (no communication)
    R -> P(sum)  local_partial (no communication: the axis's first rank
               keeps the value, the others hold zeros; exact, where DTensor's
               divides by the axis size)
    S(d) -> P(sum)  all_gather, then local_partial
  Partial axes are reduced first.
- Across placements: a value Partial across the stages holding copies of a
  shared parameter (its per-stage gradient) becomes Replicate by one
  `all_reduce` with `stages=(...)` (and `param`, the name that makes the
  copies' ops one collective for the checker), over the ranks at this rank's (dp, tp)
  coordinate on each of those stages, before its own axes are converted.
- Across stages: Partial axes are reduced on the source stage, then one
  `meshplan.transfer` carries the value to the consumer's stage in the layout
  the consumer needs, but for a Partial the consumer asks of it (a sum's
  share, `OpRule.sums`): that is made where it arrives, by `local_partial`
  (lowering cuts the transfer into send/recv pieces); its
  `src_phase` (the phase that made the value) says which way it flows. A value
  crosses to a stage once, for its first consumer there; a later consumer
  that needs another layout converts the arrived copy on its own stage.
  (A second transfer in a backward consumer's phase would flow forward in
  the backward pass, where no schedule action carries it: found by the
  random-graph fuzz, tests/fuzz/test_graphs.py.)
- A value made from no tensor at all (a factory op: a constant) is made
  again on a consumer's stage instead of crossing to it.
- A conversion is made once per (value, layout, stage) and shared by every
  consumer that needs it; a hinted value is converted right after its
  producer, and all consumers, state updates and the loss read the
  converted value. The step (optimizer phase) makes its own conversions:
  it runs once, after the micro-batches' values are gone, so it never
  shares one made for a forward or backward op (a ZeRO-1 AdamW read the
  parameter shard that Omni-ASR's backward had sliced: a rank crash).
- Boxing ops run in the phase of the op that needs them: a gradient
  accumulator's data-parallel all-reduce therefore runs once per step, in
  the optimizer phase, however many micro-batches there are.
- Logically every boxing op is the identity, so the boxed graph still runs
  single-process and gives the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshplan.ir import Graph, Op, Phase, Ref
from meshplan.ir.kinds import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    LOCAL_PARTIAL,
    LOCAL_SLICE,
    REDUCE_SCATTER,
    TRANSFER,
)
from meshplan.ir.sbp import NdSbp, Partial, Replicate, Sbp, Shard
from meshplan.ops.emit import Emitter
from meshplan.passes.propagate import SbpAssignment
from meshplan.passes.rebuild import Rebuild

# Deterministic factories: made again on another stage rather than sent (not rand*).
_FACTORIES = frozenset({"full", "zeros", "ones", "arange", "empty", "scalar_tensor", "eye"})


@dataclass(frozen=True, slots=True)
class Boxed:
    """The boxed graph and its per-op / per-value annotations."""

    graph: Graph
    stage: tuple[int, ...]
    chunk: tuple[int, ...]
    sbp: tuple[NdSbp, ...]
    variant: tuple[tuple[str, ...], ...]


@dataclass
class _Ctx:
    rb: Rebuild
    plan: SbpAssignment
    naxes: int
    layout: dict = field(default_factory=dict)     # value id -> NdSbp
    where: dict = field(default_factory=dict)      # value id -> (stage, chunk, phase)
    versions: dict = field(default_factory=dict)   # (value, NdSbp, stage) -> value id
    default: dict = field(default_factory=dict)    # value id -> hinted version
    arrived: dict = field(default_factory=dict)    # (value, stage) -> transferred copy
    copies: dict = field(default_factory=dict)     # value -> stages it is Partial across
    factory: dict = field(default_factory=dict)    # value -> its producer, if it reads none
    regather: frozenset = frozenset()              # values converted again in each phase

    def emit(self, kind, src: int, out_layout: NdSbp, at, module_path: str, **kw) -> int:
        stage, chunk, phase = at
        out = Emitter(self.rb.b, phase=phase, module_path=module_path).call(kind, Ref(src), **kw).id
        self.rb.placed((stage, chunk, ("",) * self.naxes))
        self.layout[out] = out_layout
        self.where[out] = at
        return out


def add_boxing(graph: Graph, plan: SbpAssignment, stage, chunk, naxes: int,
               copies: dict | None = None, regather: frozenset = frozenset()) -> Boxed:
    """Insert boxing ops; returns the boxed graph with its annotations.

    `copies` ({value: (stages, parameter name)}) names values that are Partial across the
    placements of several stages (a shared parameter's per-stage gradient,
    passes/shared.py): their consumer reads them summed over those stages.
    `regather` names values converted once per phase that reads them, not
    once per step: ZeRO-3's parameters, gathered for the forward, freed after
    it, and gathered again for the backward (FSDP's reshard after forward);
    and with sequence parallelism a colwise module's input, hinted whole
    after its producer, gathered again for the backward, so that the
    backward keeps the sequence shard, not the gathered copy (Megatron's)."""
    rb = Rebuild(graph, annotate=True)
    ctx = _Ctx(rb, plan, naxes, copies=copies or {}, regather=regather)
    ctx.layout.update(plan.produced)
    for op in graph.ops:
        at = (stage[op.id], chunk[op.id], op.phase)
        refs = op.refs()
        sigs = plan.sigs[op.id]
        mapping = [_ready(ctx, _across(ctx, r, at, op.module_path),
                          tuple(sig.ins[k] for sig in sigs), at, op.module_path)
                   for k, r in enumerate(refs)]
        new_op = rb.keep(op, mapping, (at[0], at[1], tuple(sig.variant for sig in sigs)))
        if not refs and op.kind.split(".")[1] in _FACTORIES and len(op.outputs) == 1:
            ctx.factory[op.outputs[0]] = new_op
        for o in op.outputs:
            if o >= 0:
                ctx.where[o] = at
                _apply_hint(ctx, o, op.module_path)
    updates = tuple(replace(u, value=ctx.default.get(u.value, u.value)) for u in graph.updates)
    loss = ctx.default.get(graph.loss, graph.loss)
    reports = tuple((n, ctx.default.get(v, v)) for n, v in graph.reports)
    boxed = Graph(tuple(rb.b.values), tuple(rb.b.ops), graph.inputs, loss, updates, graph.facts,
                  graph.grads, reports)
    sbp = tuple(ctx.layout.get(v.id, (Replicate(),) * naxes) for v in boxed.values)
    stage, chunk, variant = rb.annotations()
    return Boxed(boxed, stage, chunk, sbp, variant)


def _across(ctx: _Ctx, r: int, at, module_path: str) -> int:
    """`r` summed over the copies' stages, if it is Partial across them: one
    all-reduce over this rank's line through those stages' placements."""
    shared = ctx.copies.get(r)
    if shared is None:
        return r
    stages, param = shared
    key = (r, "copies", at[0])
    if key not in ctx.versions:
        ctx.versions[key] = ctx.emit(ALL_REDUCE, r, ctx.layout[r], at, module_path,
                                     op="sum", stages=stages, param=param)
    return ctx.versions[key]


def _apply_hint(ctx: _Ctx, o: int, module_path: str) -> None:
    want = ctx.plan.visible.get(o)
    have = ctx.plan.produced.get(o)
    if want is None or want == have:
        return
    assert have is not None, f"value {o} is hinted before it is produced"
    at = ctx.where[o]
    ctx.default[o] = _convert_local(ctx, o, have, want, at, module_path)
    ctx.versions[(o, want, at[0], None)] = ctx.default[o]


def _ready(ctx: _Ctx, r: int, need: NdSbp, at, module_path: str) -> int:
    """A value holding `r` in layout `need` on stage `at[0]` (made if missing)."""
    base = ctx.default.get(r, r)  # a hinted value: what the updates name, a state too
    if r in ctx.regather and base != r and ctx.where[base][2] is not at[2]:
        base = r  # hinted, but converted again in this phase rather than kept from the producer's
    have = ctx.layout.get(base)
    src_at = ctx.where.get(r, at)  # graph inputs are local to every stage
    if have is None:  # a lazily laid-out input (gradient accumulator)
        ctx.layout[r] = need
        return r
    if have == need and src_at[0] == at[0]:
        return base
    per_phase = r in ctx.regather or at[2] is Phase.OPTIMIZER
    key = (r, need, at[0], at[2] if per_phase else None)
    if key in ctx.versions:
        return ctx.versions[key]
    arrived = ctx.arrived.get((r, at[0]))
    if arrived is None and src_at[0] != at[0] and r in ctx.factory:
        arrived = ctx.arrived[(r, at[0])] = _remake(ctx, ctx.factory[r], at)
    if arrived is not None:
        out = _convert_local(ctx, arrived, ctx.layout[arrived], need, at, module_path)
    elif src_at[0] != at[0]:
        out = ctx.arrived[(r, at[0])] = _transfer(ctx, base, have, need, src_at, at,
                                                   module_path)
    else:
        out = _convert_local(ctx, base, have, need, at, module_path)
    ctx.versions[key] = out
    return out


def _remake(ctx: _Ctx, op: Op, at) -> int:
    """A copy of factory `op` (no tensor inputs) on stage `at[0]`: its value is
    made again there rather than sent (an empty constant has no pieces to send)."""
    out = ctx.rb.new_value_like(op.outputs[0])
    ctx.rb.append(replace(op, id=len(ctx.rb.b.ops), outputs=(out,), phase=at[2], grad_of=-1),
                  (at[0], at[1], ("",) * ctx.naxes))
    ctx.layout[out] = ctx.layout[op.outputs[0]]
    ctx.where[out] = at
    return out


def _transfer(ctx, vid, have, need, src_at, at, module_path) -> int:
    reduced = tuple(Replicate() if isinstance(s, Partial) else s for s in have)
    if reduced != have:
        vid = _convert_local(ctx, vid, have, reduced, src_at, module_path)
    target = tuple(Replicate() if isinstance(s, Partial) else s for s in need)
    vid = ctx.emit(TRANSFER, vid, target, at, module_path,
                   src_stage=src_at[0], src_chunk=src_at[1], dst_stage=at[0],
                   src_phase=src_at[2].value)
    if target != need:  # a sum's share (`OpRule.sums`) of a value from another stage:
        vid = _convert_local(ctx, vid, target, need, at, module_path)  # made where it arrives
    return vid


def _convert_local(ctx: _Ctx, vid: int, have: NdSbp, need: NdSbp, at, module_path) -> int:
    cur = list(have)
    for a, dst in conversion_steps(have, need):
        kind, kw = _step(cur[a], dst)
        cur[a] = dst
        vid = ctx.emit(kind, vid, tuple(cur), at, module_path, axis=a, **kw)
    return vid


def _dims(src, dst) -> set[int]:
    """The dims a step from `src` to `dst` on one axis cuts or joins."""
    return {s.dim for s in (src, dst) if isinstance(s, Shard)}


def conversion_steps(have: NdSbp, need: NdSbp) -> list[tuple[int, Sbp]]:
    """The (axis, layout) steps from `have` to `need`, one axis at a time:
    Partial axes first, then the axes outermost first, each taken only when
    no inner axis splits a dim it cuts or joins. Shards of one dim on several
    axes nest (the outer axis splits first), so a step on an outer axis of a
    dim an inner axis splits would join or cut the wrong parts: gathering dp
    of a batch split over (dp, ep) must wait for ep's gather; and a step
    that would block a pending outer one waits too. When every pending step
    waits so, the innermost axis that blocks one is gathered first (and
    split again later). A shard that must become a Partial (a gradient
    accumulator's share, whose layout its first contribution chose) is
    gathered first, then made the share (`local_partial`)."""
    cur, n = list(have), len(have)
    order = sorted(range(n), key=lambda a: not isinstance(have[a], Partial))

    def blocks(b: int, layout, a: int) -> bool:  # axis b in `layout` blocks a's step
        return a < b and isinstance(layout, Shard) and layout.dim in _dims(cur[a], need[a])

    def ready(a: int, pending) -> bool:
        return not any(blocks(b, cur[b], a) for b in range(n)) and \
            not any(blocks(a, need[a], b) for b in pending)

    steps: list[tuple[int, Sbp]] = []
    for _ in range(3 * n + 1):
        pending = [a for a in order if cur[a] != need[a]]
        if not pending:
            return steps
        a = next((a for a in pending if ready(a, pending)), None)
        step: tuple[int, Sbp]
        if a is not None and isinstance(need[a], Partial) and isinstance(cur[a], Shard):
            step = (a, Replicate())  # a share of a sum is made from the whole value
        elif a is not None:
            step = (a, need[a])
        else:  # gather the innermost axis that blocks a pending step
            step = (max(b for b in range(n) if any(blocks(b, cur[b], a) for a in pending)),
                    Replicate())
        steps.append(step)
        cur[step[0]] = step[1]
    raise AssertionError(f"no conversion from {have} to {need}")


def _step(src, dst) -> tuple[str, dict]:
    if isinstance(dst, Partial):  # a gradient accumulator's share of a whole contribution
        assert isinstance(src, Replicate) and dst.op == "sum", f"cannot make {dst} from {src}"
        return LOCAL_PARTIAL, {}
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return ALL_REDUCE, {"op": src.op}
        return REDUCE_SCATTER, {"dim": dst.dim}
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return ALL_GATHER, {"dim": src.dim}
        return ALL_TO_ALL, {"src_dim": src.dim, "dst_dim": dst.dim}
    return LOCAL_SLICE, {"dim": dst.dim}
