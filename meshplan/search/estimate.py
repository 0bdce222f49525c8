"""A candidate's predicted step: its stages' Work priced on a device model,
run through the schedule simulator, and its per-rank memory.

Invariants:
- One pricing for both paths: `predict` takes each virtual stage's Work
  however it was obtained (summed from a probe, `stage_works`, or read off
  a whole plan, `full.py`), so the search and the full evaluation differ
  only in where the Work comes from.
- Data-parallel collectives are priced by `dp_seconds` with the device
  model's ring/tree costs over the dp group, crossing nodes when a stage's
  dp x tp ranks span more than one node. Those inside an action (ZeRO-3's
  gathers, ZeRO-2/3's per-micro-batch reduce-scatters) overlap its compute
  (a comm stream): the action takes the longer of the two. The STEP's
  reductions (ZeRO 0/1) run in buckets during the last micro-batch's
  backward, so only what outlasts that backward, and at least the last
  bucket, is exposed; the gathers of updated shards (ZeRO 1/2) are not.
- dp collectives are counted as the runtime issues them: ZeRO-3's gathers
  one per layer, the rest in buckets when buckets are on.
- The step is simulated on the schedule's real action lists, every
  micro-batch (`simulate.finish_times`); `Priced.lower_bound` never exceeds
  it (asserted on every simulation).
- Ranks that share a host's CPU cores (`DeviceModel.host_cores` fewer than
  a node's ranks: processes on one machine, as `calibrate` measures it)
  cannot all run at once: the step is then at least, per node, its ranks'
  busy seconds (actions, with the collectives gloo runs on those same
  cores, and the STEP) over its cores (`host_bound`). A pipeline's bubbles
  leave cores to the other ranks; tensor parallel's collectives do not.
  Measured on the 2-core machine (`benchmarks/auto_plan.py`, part 4): this
  bound took the rank correlation of predicted and measured steps over 21
  strategies from 0.24 to 0.96.
- Memory per rank follows the memory layout's rules (`lowering/memory.py`):
  state split by dp as the ZeRO level says, gradients twice with several
  micro-batches (with buckets, the second copy is their flat tensors),
  saved bytes times the
  micro-batches the schedule keeps in flight per chunk, the largest
  transient and workspace, and the transient buckets and ZeRO-3's gathered
  layers. It is an estimate (`test_estimate` holds it within -3%..+60% of
  the full plan on GPT tiny, ZeRO-3 -25%..+60%), so the search drops a
  candidate only on its floor (`memory(part="floor")`, below every full
  plan: `test_search`) and proves its winner by the full plan.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import cache

from meshplan.costmodel import DeviceModel
from meshplan.ir import Phase
from meshplan.ir.choices import Precision
from meshplan.ir.mesh import Mesh
from meshplan.ir.zero import ZeroLevel
from meshplan.lowering.lower import in_flight
from meshplan.passes.balance import balance
from meshplan.schedules import compute_actions, placement_of, spec_of
from meshplan.schedules.simulate import finish_times
from meshplan.search.probe import Probe
from meshplan.search.space import Candidate, schedule_takes
from meshplan.search.work import DpKey, DpKind, Over, Slot, Work

MiB = 1 << 20
STEADY = 2  # micro-batches per pipeline stage after which in-flight counts stop growing
# The floor (`memory(part="floor")`) is what a rank must hold at once, as
# the probes estimate it, less this for their error: its state, workspace
# and every value a micro-batch in flight keeps from its F to its I or W
# (all alive when the rank's last warm-up forward ends). On GPT small over
# 8 devices that estimate reached at most 0.991 of the full plans' peaks
# (`benchmarks/auto_plan.py` part 2 rechecks it on every run).
FLOOR_SLACK = 0.05
_BACKWARD = (Slot.I, Slot.W)  # the slots a gradient's reduction runs in


@dataclass(frozen=True, slots=True)
class Prediction:
    step_s: float
    bubble: float
    peak: tuple[int, ...]          # planned peak bytes per pipeline stage (rank)
    flops_per_device: float        # executed flops per device per step
    stage_layers: tuple[int, ...]  # layers per virtual stage

    def tflops(self) -> float:
        return self.flops_per_device / self.step_s / 1e12 if self.step_s else 0.0


def layout(probe: Probe, cand: Candidate, layers: int) -> tuple[int, ...]:
    """Layers per virtual stage, balanced by each layer's F + B (the extras
    counted on the first and last layer)."""
    per = probe.body.f + probe.body.i + probe.body.w
    weights = [per] * layers
    weights[0] += probe.first.f + probe.first.i + probe.first.w
    weights[-1] += probe.last.f + probe.last.i + probe.last.w
    return balance(weights, cand.pp * cand.vpp)


def stage_works(probe: Probe, counts: tuple[int, ...]) -> list[Work]:
    n, made = len(counts), {}
    for v, k in enumerate(counts):  # equal stages share one Work (priced once: `price`)
        key = (k, v == 0, v == n - 1)
        if key not in made:
            made[key] = probe.stage(*key)
    return [made[(k, v == 0, v == n - 1)] for v, k in enumerate(counts)]


@dataclass(frozen=True, slots=True)
class Setting:
    """What prices a candidate beyond its stages' Work."""

    mesh: Mesh
    global_batch: int
    dev: DeviceModel
    bucket_mb: float = 25.0
    precision: str = "fp32"

    @property
    def buckets(self) -> bool:
        return self.bucket_mb > 0 and self.precision != Precision.FP16


@dataclass(frozen=True, slots=True)
class Priced:
    """A candidate's actions priced, before the simulation."""

    cand: Candidate
    m: int
    cost: dict                     # (virtual stage, "f"|"i"|"w") -> s
    comm: dict                     # (src stage, dst stage) -> s
    step: tuple[float, ...]        # per rank: the STEP's seconds
    peak: tuple[int, ...]
    flops_per_device: float
    stage_layers: tuple[int, ...]
    host: tuple[tuple[int, ...], ...] = ()  # per node (distinct): its ranks of each stage
    host_cores: int = 0
    # per rank: the STEP's seconds however much of its reduction the
    # backward hides (all but the last bucket): what more work cannot undercut
    step_floor: tuple[float, ...] = ()

    def bounding(self, cand: Candidate, works: list[Work] | None = None) -> Priced:
        """A bound below `cand`'s pricing, from this one of its twin without
        recompute (nor, given the twin's `works`, sequence parallelism:
        each action less what it could save, `Work.sp_f/i/w`, and the
        boundary's shard over tp); its STEP at the floor, as more backward
        work hides more of the reduction."""
        cost, comm = self.cost, self.comm
        if works is not None:
            split = spec_of(cand.schedule).splits_backward
            cost = {}
            for (v, k), x in self.cost.items():
                w = works[v]
                save = {"f": w.sp_f, "i": w.sp_i if split else w.sp_i + w.sp_w,
                        "w": w.sp_w if split else 0.0}[k]
                cost[(v, k)] = max(0.0, x - save)
            comm = {k: x / cand.tp for k, x in self.comm.items()}
        return replace(self, cand=cand, cost=cost, comm=comm, step=self.step_floor)

    def lower_bound(self) -> float:
        """A bound on the simulated step: rank r waits for the first forward
        to reach its first stage (fill), runs all its actions (busy) and its
        STEP; without the split its last action is the B of its first
        stage's last micro-batch, whose input gradient must then pass back
        to stage 0 (drain) before rank 0's STEP."""
        c = self.cand
        g = _geometry(c.schedule, c.pp, c.vpp)
        cost, comm = self.cost, self.comm
        drains = not spec_of(c.schedule).splits_backward
        best = 0.0
        for r, mine in enumerate(g.stages):
            first = min(mine)
            fill = sum(cost[(v, "f")] + comm[(v, v + 1)] for v in range(first))
            busy = self.m * sum(cost[(v, k)] for v in mine for k in "fiw")
            best = max(best, fill + busy + self.step[r])
            if drains and first:
                drain = sum(cost[(v, "i")] + comm[(v + 1, v)] for v in range(first))
                best = max(best, fill + busy + drain + self.step[g.stages.index(
                    next(s for s in g.stages if 0 in s))])
        return best

    def predict(self) -> Prediction:
        step_s, bubble = _simulated(self.cand, self.m, self.cost, self.comm, self.step,
                                    self.host, self.host_cores)
        assert step_s >= self.lower_bound() * (1 - 1e-9), (self.cand, step_s)
        return Prediction(step_s, bubble, self.peak, self.flops_per_device, self.stage_layers)


def price(cand: Candidate, works: list[Work], st: Setting, counts: tuple[int, ...] = (),
          peaks: tuple[int, ...] | None = None) -> Priced:
    """Price `works` (one per virtual stage); the peak per rank is estimated
    unless `peaks` (a memory layout's) is given."""
    m = cand.microbatches(st.global_batch)
    g = _geometry(cand.schedule, cand.pp, cand.vpp)
    split = spec_of(cand.schedule).splits_backward
    once: dict[int, tuple] = {}  # equal stages are one object (`stage_works`): priced once
    for w in works:
        if id(w) not in once:
            once[id(w)] = _in_action(w, cand, st, split)
    priced = [once[id(w)] for w in works]
    cost = {(v, k): x for v, fiw in enumerate(priced) for k, x in zip("fiw", fiw)}
    steps: dict = {}
    for mine in g.stages:
        key = tuple(id(works[v]) for v in mine)
        if key not in steps:
            steps[key] = _step_seconds([works[v] for v in mine], [priced[v] for v in mine],
                                       cand, st)
    step, floor = zip(*(steps[tuple(id(works[v]) for v in mine)] for mine in g.stages))
    comm = {}
    for v in range(len(works) - 1):
        cross = _stages_cross(cand, st.mesh, g.stage_of[v], g.stage_of[v + 1])
        comm[(v, v + 1)] = st.dev.p2p_seconds(works[v].send_f, cross)
        comm[(v + 1, v)] = st.dev.p2p_seconds(works[v + 1].send_b, cross)
    flops = sum(w.flops for w in works) * m / cand.pp
    if peaks is None:
        peaks = memory(cand, works, counts, st)
    return Priced(cand, m, cost, comm, step, peaks, flops, counts, _host_loads(cand, st),
                  st.dev.host_cores, floor)


def _host_loads(cand: Candidate, st: Setting) -> tuple[tuple[int, ...], ...]:
    """Per node whose ranks outnumber its cores, how many ranks of each
    pipeline stage it holds (distinct rows); () when no node is shared."""
    cores, per = st.dev.host_cores, st.mesh.devices_per_node
    if not cores or per <= cores:
        return ()
    n = cand.dp * cand.cp * cand.tp  # a stage's ranks, consecutive (`Strategy.ranks_of_stage`)
    return tuple(sorted({tuple(max(0, min(hi, (r + 1) * n) - max(lo, r * n))
                               for r in range(cand.pp))
                         for lo, hi in ((k * per, (k + 1) * per)
                                        for k in range(st.mesh.nodes))}))


def host_bound(busy: dict, step: tuple[float, ...], host: tuple[tuple[int, ...], ...],
               cores: int) -> float:
    """The step's lower bound on shared cores: the busiest node's ranks'
    busy seconds (actions and STEP, per pipeline rank in `busy`) over its
    cores; 0 when no node is shared."""
    return max((sum(k * (busy[r] + step[r]) for r, k in enumerate(row)) / cores
                for row in host), default=0.0)


def memory(cand: Candidate, works: list[Work], counts: tuple[int, ...],
           st: Setting, part: str = "peak") -> tuple[int, ...]:
    """Per pipeline rank: the estimated planned peak (`part` "peak"); a
    floor under it ("floor": what the rank holds at once, its state,
    workspace and the values its micro-batches in flight keep from F to I
    or W, and from I to W where more than one is in flight (the layout's
    static slots), less `FLOOR_SLACK` for the probes' error; no transients,
    no I-to-W values the layout may pack by liveness); or its parameters,
    gradients and optimizer state alone ("state", which recompute and the
    schedule do not change)."""
    m = cand.microbatches(st.global_batch)
    g = _geometry(cand.schedule, cand.pp, cand.vpp)
    split = spec_of(cand.schedule).splits_backward
    live = ({},) * cand.pp if part == "state" else _live(cand.schedule, cand.pp, cand.vpp, m)
    return tuple(_peak([works[v] for v in mine], [g.chunk[v] for v in mine],
                       [counts[v] for v in mine], live[r], cand, m, st, split, part)
                 for r, mine in enumerate(g.stages))


@dataclass(frozen=True, slots=True)
class _Geometry:
    stages: tuple[tuple[int, ...], ...]   # stage -> its virtual stages
    stage_of: tuple[int, ...]             # virtual stage -> stage
    chunk: tuple[int, ...]                # virtual stage -> chunk on its stage


@cache
def _geometry(schedule: str, pp: int, vpp: int) -> _Geometry:
    where = placement_of(schedule, pp, vpp)
    n = where.num_stages
    return _Geometry(tuple(where.stages_of(r) for r in range(pp)),
                     tuple(where.rank_of(v) for v in range(n)),
                     tuple(where.chunk_of(v) for v in range(n)))


def _serial(key: DpKey) -> bool:
    """On the critical path inside an action: an all-to-all (the experts
    wait for their tokens), a gather over cp (attention for its keys)."""
    return key.kind is DpKind.ALL_TO_ALL or (key.over is Over.CP and key.phase is not Slot.STEP)


def dp_seconds(work: Work, keys, cand: Candidate, st: Setting,
               serial: bool | None = None) -> float:
    """Seconds of `work`'s data-side collectives whose (slot, kind) is in
    `keys`, as the runtime issues them: ZeRO-3's gathers one collective per
    layer (`gather_prefetch.py`), all-to-alls as counted, the rest in
    buckets of `bucket_mb` when buckets are on (`grad_buckets.py`), else one
    per tensor; each over the ranks its `Over` names, crossing nodes when
    they span more than one (`serial`: only those on the critical path, or
    only the others)."""
    total = 0.0
    for key, (count, nbytes) in work.dp:
        if (key.phase, key.kind) not in keys or count <= 0 or \
                (serial is not None and _serial(key) is not serial):
            continue
        if key.kind is DpKind.ALL_GATHER and key.phase is not Slot.STEP:
            count = min(count, max(1, work.layers))
        elif st.buckets and key.kind is not DpKind.ALL_TO_ALL:
            count = max(1, math.ceil(nbytes / (st.bucket_mb * MiB)))
        group = key.over.group_size(cand.dp, cand.ep, cand.cp)
        total += count * st.dev.collective_seconds(key.kind, nbytes // count, group,
                                                   _crosses(cand, st.mesh, key.over))
    return total


def with_dp(work: Work, cand: Candidate, split: bool, pattern: Work | None) -> Work:
    """`work` (a probe's, dp = 1, or dp = ep with its experts split, at the
    candidate's cp) with its data-parallel collectives and its state at
    rest as the ZeRO level makes them at `cand.dp` (the probe's all-to-alls
    and its collectives over cp kept: `_kept_from_probe`).

    `pattern` is the same stage planned at dp = 2, ZeRO 3, ep = 1 (`probe`):
    which parameters shard (its reduce-scatters and forward all-gathers; the
    rest, too small to split, stay all-reduced) and, at ZeRO 3, which the
    backward gathers again. Levels 0-2 rearrange those same tensors (table
    in `docs/concepts/sharded_dp.md`). With ep > 1 the experts' share of the
    sharded bytes (`Work.expert`, split over ep already) runs over the dp/ep
    ranks beside their ep group, as their state shards there, and a dense
    all-reduce is two, over dp/ep and over ep, as the boxing issues it.
    With cp > 1 at ZeRO 0, the gradients the boxing reduce-scatters over cp
    first (and gathers after) are all-reduced over dp on 1/cp of their bytes."""
    if cand.dp == 1 or pattern is None:
        return work
    z, d, e = cand.zero, cand.dp, cand.ep
    got: dict = {}
    for k, (n, size) in pattern.dp:
        key = "loss" if (k.phase, k.kind) == (Slot.F, DpKind.ALL_REDUCE) else \
            "gather" if (k.phase, k.kind) == (Slot.F, DpKind.ALL_GATHER) else \
            k.kind if k.phase in _BACKWARD and k.kind is not DpKind.ALL_GATHER else None
        if key is not None:
            c, b = got.get(key, (0, 0))
            got[key] = (c + n, b + size)
    loss, gather = got.get("loss", (0, 0)), got.get("gather", (0, 0))
    shard = got.get(DpKind.REDUCE_SCATTER, (0, 0))
    rest = got.get(DpKind.ALL_REDUCE, (0, 0))
    grads = Slot.W if split else Slot.I
    step = Slot.STEP
    # (key, (count, bytes), whether it moves the sharded tensors, experts among them)
    if z.regathers:
        ops = [(k, v, k.kind is not DpKind.ALL_REDUCE) for k, v in pattern.dp]
    else:
        ops = [(DpKey(Slot.F, DpKind.ALL_REDUCE), loss, False)] if loss[0] else []
        if not z.shards_optimizer:
            ops += [(DpKey(step, DpKind.ALL_REDUCE), shard, True),
                    (DpKey(step, DpKind.ALL_REDUCE), rest, False)]
        else:
            where = grads if z.reduce_scatters else step
            ops += [(DpKey(where, DpKind.REDUCE_SCATTER), shard, True),
                    (DpKey(step, DpKind.ALL_GATHER), gather, True)]
            if rest[0]:
                ops.append((DpKey(where, DpKind.ALL_REDUCE), rest, False))
    # the experts' share of the model's bytes, whole (0 without ep)
    dense = work.param - work.expert
    share = work.expert * e / (dense + work.expert * e) if work.expert and e > 1 else 0.0
    if cand.cp > 1 and not z.shards_optimizer:  # reduced over cp first (a reduce-scatter),
        # the gradients a gather over cp makes whole reduce over dp on 1/cp of their bytes
        over_cp = sum(b for k, (_, b) in work.dp if k.over is Over.CP
                      and (k.phase, k.kind) == (Slot.STEP, DpKind.ALL_GATHER))
        whole = sum(b for _, (_, b), sharded in ops if sharded)
        cut = 1 - min(1.0, over_cp / whole) * (1 - 1 / cand.cp) if whole else 1.0
        ops = [(k, (n, int(b * cut)) if sharded else (n, b), sharded)
               for k, (n, b), sharded in ops]
    merged: dict = {}
    for k, (n, b) in [*_over_ep(ops, share, d, e), *_kept_from_probe(work)]:
        n0, b0 = merged.get(k, (0, 0))
        merged[k] = (n0 + n, b0 + b)
    keep, keep_x = 1 - 1 / d, 1 - e / d  # the part of a shard a rank does not hold
    x = work.expert / work.param if share else 0.0  # the experts' part of a rank's state

    def frac(sharded: int, total: int) -> float:
        """The part of a rank's dense `total` that shards (`sharded` bytes of the model's)."""
        dense = total * (1 - x)
        return min(1.0, sharded * (1 - share) / dense) if dense else 0.0

    def rest_of(total, f: float):
        """A rank's part of `total` once ZeRO shards the part `f` of its
        dense state over dp, and its experts over dp/ep."""
        return total * (1 - x) * (1 - f * keep) + total * x * (1 - keep_x)
    p_frac, g_frac = frac(gather[1], work.param), frac(shard[1], work.grad)
    return replace(
        work, dp=tuple(sorted((k, (n, int(b))) for k, (n, b) in merged.items() if n)),
        param=int(rest_of(work.param, p_frac)) if z.regathers else work.param,
        grad=int(rest_of(work.grad, g_frac)) if z.reduce_scatters else work.grad,
        optimizer=int(rest_of(work.optimizer, p_frac)) if z.shards_optimizer
        else work.optimizer,
        step=rest_of(work.step, g_frac) if z.shards_optimizer else work.step)


def _kept_from_probe(work: Work) -> list:
    """The collectives of a probe that `with_dp` keeps: over ep (planned at
    dp = ep) the model's own (its all-to-alls, what its backward gathers or
    scatters), not the gradients' reductions or the loss's, which it makes;
    over cp all of them (attention's gathers, the weights' reduction over
    the sequence's ranks)."""
    return [(k, v) for k, v in work.dp if k.over is Over.CP or (
        k.over is Over.EP and k.phase is not Slot.STEP
        and (k.phase, k.kind) != (Slot.F, DpKind.ALL_REDUCE))]


def _over_ep(ops: list, share: float, d: int, e: int) -> list:
    """`ops` (over dp, the model's whole sharded bytes) as they run beside
    an ep axis: the experts' `share` of each gather and reduce-scatter
    (and of a reduction at ZeRO 0) over the dp/ep ranks, 1/ep of it per
    rank; the rest dense, an all-reduce as two (over dp/ep, then ep)."""
    if e == 1:
        return [(k, v) for k, v, _ in ops]
    out = []
    for k, (n, b), sharded in ops:
        x = share * b if sharded else 0.0
        if x and d > e:
            out.append((replace(k, over=Over.DP_PER_EP), (n, x / e)))
        if k.kind is DpKind.ALL_REDUCE:
            if d > e:
                out.append((replace(k, over=Over.DP_PER_EP), (n, b - x)))
            out.append((replace(k, over=Over.EP), (n, b - x)))
        else:
            out.append((k, (n, b - x)))
    return out


def _in_action(w: Work, cand: Candidate, st: Setting, split: bool) -> tuple[float, float, float]:
    """Seconds of F, I and W with their dp collectives overlapped; without
    the split, I and W are one B (priced as I, W = 0). An all-to-all is not
    overlapped: the expert compute waits for its tokens."""
    if not w.dp:
        return (w.f, w.i, w.w) if split else (w.f, w.i + w.w, 0.0)

    def comm(*phases):
        return dp_seconds(w, {k for ph in phases for k in _keys(ph)}, cand, st, serial=False)

    def a2a(*phases):  # and cp's gathers: what the compute waits for
        return dp_seconds(w, {k for ph in phases for k in _keys(ph)} |
                          {(ph, DpKind.ALL_TO_ALL) for ph in phases}, cand, st, serial=True)
    f = max(w.f, comm(Slot.F)) + a2a(Slot.F)
    if split:
        return f, max(w.i, comm(Slot.I)) + a2a(Slot.I), max(w.w, comm(Slot.W)) + a2a(Slot.W)
    return f, max(w.i + w.w, comm(Slot.I, Slot.W)) + a2a(Slot.I, Slot.W), 0.0


def _keys(phase: Slot) -> set[tuple[Slot, DpKind]]:
    return {(phase, kind) for kind in (DpKind.ALL_GATHER, DpKind.REDUCE_SCATTER,
                                       DpKind.ALL_REDUCE)}


def _step_seconds(works: list[Work], priced: list[tuple], cand: Candidate,
                  st: Setting) -> tuple[float, float]:
    """The STEP's seconds, and its floor (`Priced.step_floor`)."""
    own = sum(w.step for w in works)
    reduce = sum(dp_seconds(w, {(Slot.STEP, DpKind.ALL_REDUCE),
                                (Slot.STEP, DpKind.REDUCE_SCATTER)}, cand, st)
                 for w in works)
    floor = reduce
    if st.buckets and reduce:  # overlapped with the last backward, but for the last bucket
        grads = sum(w.grad for w in works)
        floor = last = reduce / max(1, math.ceil(grads / (st.bucket_mb * MiB)))
        reduce = max(reduce - sum(p[1] + p[2] for p in priced), last)
    gather = sum(dp_seconds(w, {(Slot.STEP, DpKind.ALL_GATHER)}, cand, st) for w in works)
    return own + reduce + gather, own + floor + gather


def _crosses(cand: Candidate, mesh: Mesh, over: Over = Over.DP) -> bool:
    """Whether a data-side group leaves a node: the ep (or cp) ranks are
    ep (cp) x tp consecutive ones (`Strategy.axes`), the others span a
    stage's dp x cp x tp."""
    n = {Over.EP: cand.ep, Over.CP: cand.cp}.get(over, cand.dp)
    span = n * cand.tp * (cand.cp if over in (Over.DP, Over.DP_PER_EP) else 1)
    return n > 1 and span > mesh.devices_per_node


def _stages_cross(cand: Candidate, mesh: Mesh, a: int, b: int) -> bool:
    n = cand.dp * cand.cp * cand.tp
    return mesh.node_of(a * n) != mesh.node_of(b * n)


def _peak(works: list[Work], chunks: list[int], layers: list[int], live: dict,
          cand: Candidate, m: int, st: Setting, split: bool, part: str) -> int:
    d, z = cand.dp, cand.zero
    state = saved = iw = slots = scratch = 0
    for w, c in zip(works, chunks):
        # sharded already (`with_dp`); with buckets (ZeRO 0 and 1) the second
        # copy is the buckets' flat tensors, which a single micro-batch's
        # gradient is copied into (`lowering/buckets.py`)
        grad = w.grad * (2 if m > 1 else 1)
        if cand.cp > 1 and d > 1 and z is ZeroLevel.NONE and st.buckets:
            grad += w.grad  # the cp all-reduce's buckets copy the dp one's results
        state += w.param + grad + w.optimizer
        if not live:
            continue
        to_i, to_w = live.get((c, Phase.BACKWARD), 1), live.get((c, Phase.WEIGHT), 1)
        saved += w.saved_i * to_i + w.saved_w * to_w
        # values an I leaves for its W: with the split, a slot per micro-batch
        # in flight from I to W (counted as from F to W: at most that many);
        # in one B, the backward's scratch (counted whole: the plan packs
        # them with the transients)
        if split:
            iw += w.saved_iw * to_w
            if to_w > 1:  # static slots then (`lowering/memory.py`): in every plan's peak
                slots += w.saved_iw * to_w
        else:
            scratch += w.saved_iw
    if not live:
        return state
    kept = state + saved + max(w.temp for w in works)
    if part == "floor":
        return int((kept + slots) * (1 - FLOOR_SLACK))
    transient = iw + scratch + max(w.transient for w in works)
    if z.regathers and d > 1:  # gathered layers: in use, prefetched, and the one behind (backward)
        transient += 3 * max(_dp_bytes(w, (Slot.F,), DpKind.ALL_GATHER) // k
                             for w, k in zip(works, layers))
    if d > 1 and st.buckets:  # the transient buckets (`lowering/memory.py`)
        cap = int(st.bucket_mb * MiB)
        reduced = sum(_dp_bytes(w, _BACKWARD, DpKind.REDUCE_SCATTER) +
                      _dp_bytes(w, _BACKWARD, DpKind.ALL_REDUCE) for w in works)
        # a micro-batch's reduce-scatter buckets: up to two flat copies live
        transient += _live_buckets(reduced, cap) * min(cap, reduced)
        gathered = sum(_dp_bytes(w, (Slot.STEP,), DpKind.ALL_GATHER) for w in works)
        # the STEP's gather buckets: a flat copy of shards, what it gathers, and
        # the parameters' slices as they are copied out (d + 2 shards, as the
        # memory layout counts on GPT tiny; test_estimate holds it near)
        shards = gathered // d
        transient += _live_buckets(shards, cap) * (min(cap, shards) * (d + 2))
    return kept + transient + _collective_bytes(works, layers, cand, st)


def _collective_bytes(works: list[Work], layers: list[int], cand: Candidate,
                      st: Setting) -> int:
    """The dp collectives' own buffers (`lowering/memory.collective_temp`):
    the two largest calls' — a STEP gather bucket's backend output, a
    per-micro-batch reduce-scatter bucket's flat tensor, a ZeRO-3 layer's
    gather, an all-to-all's flat tensors; without buckets a layer's worth
    of one parameter's gather or reduction (an upper estimate of the
    largest parameter's)."""
    d = cand.dp
    if d <= 1:
        return 0
    cap = int(st.bucket_mb * MiB) if st.buckets else 0
    sizes = []
    for w, k in zip(works, layers):
        k = max(k, 1)
        # an all-to-all (ep): the flat tensors sent and received, one op's
        moved = [b // max(1, n) for key, (n, b) in w.dp if key.kind is DpKind.ALL_TO_ALL]
        sizes += [2 * b for b in moved]
        gathered = _dp_bytes(w, (Slot.STEP,), DpKind.ALL_GATHER)
        scattered = _dp_bytes(w, _BACKWARD, DpKind.REDUCE_SCATTER)
        if cap:
            sizes += [min(cap, gathered), min(cap, scattered)]
        else:
            reduced = scattered + _dp_bytes(w, _BACKWARD, DpKind.ALL_REDUCE)
            sizes += [gathered // k * 2 + gathered // k // d, reduced // k]
        if cand.zero.regathers:
            layer = _dp_bytes(w, (Slot.F,), DpKind.ALL_GATHER) // k
            sizes.append(layer + layer // d)
    return sum(heapq.nlargest(2, sizes))


def _live_buckets(nbytes: int, cap: int) -> int:
    """Buckets alive at once: the one filling and the one before (`buckets.run_order`)."""
    return min(2, -(-nbytes // cap)) if nbytes else 0


def _dp_bytes(w: Work, phases: tuple[Slot, ...], kind: DpKind) -> int:
    return sum(b for key, (_, b) in w.dp if key.phase in phases and key.kind is kind)


@cache
def _live(schedule: str, pp: int, vpp: int, m: int) -> tuple[dict, ...]:
    """Per rank: micro-batches in flight per (chunk, phase) (`lower.in_flight`);
    past `STEADY * pp` micro-batches the counts stop growing, so they are
    taken there (a test holds this conservative for pp <= 16). A schedule
    with a closed form (`ScheduleSpec.live`, one chunk) is not simulated."""
    closed = spec_of(schedule).live
    if closed is not None:  # closed forms (tested)
        return tuple({(0, ph): closed(pp, m, r) for ph in (Phase.BACKWARD, Phase.WEIGHT)}
                     for r in range(pp))
    return _live_at(schedule, pp, vpp, min(m, _steady_m(schedule, pp, vpp, m)))


@cache
def _steady_m(schedule: str, pp: int, vpp: int, m: int) -> int:
    """A micro-batch count past the warm-up, congruent to m mod pp."""
    base = STEADY * pp + (m % pp)
    return next((x for x in range(base, base + 8 * pp, pp)
                 if schedule_takes(schedule, pp, vpp, x)), m)


@cache
def _live_at(schedule: str, pp: int, vpp: int, m: int) -> tuple[dict, ...]:
    where = placement_of(schedule, pp, vpp)
    orders = _orders(schedule, pp, vpp, m)
    return tuple(in_flight(orders[r], where) for r in range(pp))


def _simulated(cand: Candidate, m: int, cost: dict, comm: dict, step: tuple[float, ...],
               host: tuple[tuple[int, ...], ...] = (), cores: int = 0):
    """(step seconds, bubble ratio): every rank's finish plus its STEP, or
    the shared cores' bound (`host_bound`) when that is longer."""
    finish, busy = finish_times(_orders(cand.schedule, cand.pp, cand.vpp, m),
                                placement_of(cand.schedule, cand.pp, cand.vpp), cost, comm)
    t = max(max(finish[r] + step[r] for r in finish), host_bound(busy, step, host, cores))
    return t, max((t - busy[r] - step[r]) / (busy[r] + step[r]) for r in busy)


@cache
def _orders(schedule: str, pp: int, vpp: int, m: int) -> dict:
    return {r: compute_actions(schedule, pp, vpp, m, r) for r in range(pp)}
