"""The search: every candidate strategy priced from probes, those that
cannot fit the memory limit dropped, the rest ranked by simulated step
time, and the winner proven by its full plan.

Invariants:
- Exact best-first branch and bound: candidates come out in simulated-step
  order (`_in_order`), a candidate simulated only once its lower bound
  (`Priced.lower_bound`: the busiest rank's own work) is at most the best
  step not yet taken; the order is the same as simulating every candidate
  (`exhaustive=True` does, for the soundness checks).
- Memory is sound: a candidate is dropped unplanned only when its floor
  (`estimate.memory(part="floor")`, below every full plan measured) is over
  the limit. Those whose estimated peak is over the limit but whose floor
  is not *may* fit: the proof plans them in full, in step order, and the
  first candidate whose full plan fits is the winner (`ranked[0]`, its full
  Prediction `proven`). What follows it in `ranked` are the next fastest
  whose estimates fit, unproven. At most `MAX_PROOFS` full plans are made;
  past that, only candidates estimated to fit are proven (and `unproven`
  counts those skipped).
- Ties are broken by peak memory, then by the candidate's fields, so the
  ranking is deterministic.
- A candidate the planner refuses (a probe's ConfigError) is counted with
  its reason, never ranked. If none is left, or none fits the memory
  limit, `search` raises one ConfigError line saying why and what would fit.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from meshplan.costmodel import DeviceModel
from meshplan.errors import ConfigError
from meshplan.ir.choices import Recompute
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.schedules import spec_of
from meshplan.search.estimate import (
    Prediction,
    Priced,
    Setting,
    layout,
    memory,
    price,
    stage_works,
    with_dp,
)
from meshplan.search.full import fits
from meshplan.search.probe import (
    Probe,
    Spec,
    probe_key,
    probe_many,
    probe_or_error,
    probe_pool,
)
from meshplan.search.space import Candidate, Space, candidates
from meshplan.search.work import Work

GiB = 1 << 30
# Full plans a proof may make: a count, so the winner does not depend on the
# machine's speed. GPT small over 8 devices at its first-quartile limit needs
# 71 (`benchmarks/auto_plan.py`, soundness); a GPT-3 175B full plan takes
# about a second, so 128 bound a proof near two minutes there.
MAX_PROOFS = 128
# Sequences from this length on are searched with context parallelism from the start
# (activations dominate there); shorter ones only when nothing fits without it.
LONG_SEQ = 8192


@dataclass(frozen=True, slots=True)
class Ranked:
    cand: Candidate
    pred: Prediction


@dataclass(slots=True)
class SearchResult:
    ranked: list[Ranked]             # the winner first when proven, then by step
    considered: int = 0
    over_memory: int = 0             # dropped unplanned: their floor is over the limit
    refused: Counter = field(default_factory=Counter)   # planner's reason -> candidates
    simulated: int = 0
    probes: int = 0
    seconds: float = 0.0             # the whole search, its proofs included
    proven: Prediction | None = None  # the winner's full plan, priced
    proofs: int = 0                  # full plans made
    over_when_planned: int = 0       # faster candidates whose full plan did not fit
    unproven: int = 0                # candidates that may fit, skipped past MAX_PROOFS
    proof_s: float = 0.0

    @property
    def winner(self) -> Ranked:
        return self.ranked[0]

    def strategy(self, i: int = 0, layer_pattern: str = "", **fields) -> Strategy:
        """Ranked candidate `i` as a Strategy (its uneven layout included)."""
        c, pred = self.ranked[i].cand, self.ranked[i].pred
        return Strategy(dp=c.dp, tp=c.tp, pp=c.pp, vpp=c.vpp, schedule=c.schedule,
                        micro_batch_size=c.micro_batch_size, recompute=Recompute(c.recompute),
                        zero=c.zero, ep=c.ep, cp=c.cp, sequence_parallel=c.sp,
                        stage_layers=pred.stage_layers if c.pp > 1 else (),
                        layer_pattern=layer_pattern, **fields)


def search(spec: Spec, mesh: Mesh, global_batch: int, dev: DeviceModel,
           memory_limit: int | None = None, space: Space | None = None, top: int = 10,
           bucket_mb: float = 25.0, exhaustive: bool = False,
           prove: bool = True) -> SearchResult:
    """The `top` fastest candidates within `memory_limit` bytes per device
    (the device model's memory when None), by simulated step time; with
    `prove`, the first is the fastest whose full plan fits. Context
    parallelism, and sequence parallelism beside candidates without it
    (unless `space.sps` says), are searched for a sequence of `LONG_SEQ`
    tokens or more (where activations weigh), for a shorter one when
    nothing fits without them, or (cp) when `space` has a sequence."""
    t0 = time.perf_counter()
    space = space or Space()
    long = spec.seq >= LONG_SEQ
    if long and not space.seq and space.cps != (1,):
        space = replace(space, seq=spec.seq)
    auto_sp = not space.sps
    if auto_sp:
        space = replace(space, sps=(False, True) if long else (False,))
    try:
        return _search(spec, mesh, global_batch, dev, memory_limit, space, top, bucket_mb,
                       exhaustive, prove, t0)
    except ConfigError:
        wider: dict = {}
        if spec.seq and not space.seq and space.cps != (1,):
            wider["seq"] = spec.seq
        if spec.seq and auto_sp and space.sps == (False,):
            wider["sps"] = (False, True)
        if not wider:
            raise
    return _search(spec, mesh, global_batch, dev, memory_limit, replace(space, **wider),
                   top, bucket_mb, exhaustive, prove, t0)


def _search(spec: Spec, mesh: Mesh, global_batch: int, dev: DeviceModel,
            memory_limit: int | None, space: Space, top: int, bucket_mb: float,
            exhaustive: bool, prove: bool, t0: float) -> SearchResult:
    layers = spec.layers
    limit = memory_limit if memory_limit is not None else dev.memory_bytes
    st = Setting(mesh, global_batch, dev, bucket_mb, spec.precision)
    if spec.samples:
        space = replace(space, samples=spec.samples)
    if spec.experts and not space.experts:
        space = replace(space, experts=spec.experts)
    if not spec.seq:  # nothing to split by sequence (a ResNet, a captured graph)
        space = replace(space, sps=tuple(x for x in space.sps if not x))
    pricer = _Pricer(spec, layers, st, limit, lazy_sp=set(space.sps) == {False, True})
    try:
        cands = list(candidates(mesh, layers, global_batch, space))
        pricer.prefetch(cands, exhaustive)
        queue: list = []
        for n, cand in enumerate(cands):
            pricer.considered += 1
            lazy = pricer.lazy(cand) and not exhaustive
            entry = pricer.optimistic(cand) if lazy else pricer.exact(cand)
            if entry is not None:
                queue.append((*entry, n, cand))
        heapq.heapify(queue)
        res = SearchResult([])
        proof = _Proof(spec, st, limit) if prove else None
        for r in _in_order(pricer, queue, exhaustive):
            fits = max(r.pred.peak) <= limit
            if proof is not None and res.proven is None:
                if proof.made >= MAX_PROOFS and not fits:
                    res.unproven += 1
                    continue
                res.proven = proof.planned(r)
                if res.proven is None:
                    continue
            elif not fits:  # may fit, but is slower than the winner: not listed
                continue
            res.ranked.append(r)
            if len(res.ranked) >= top:
                break
    finally:
        pricer.close()  # the probes' workers
    if proof is not None:
        res.proofs, res.over_when_planned, res.proof_s = proof.made, proof.over, proof.seconds
        if res.proven is None:
            raise _nothing_fits(pricer, limit, mesh, global_batch, proof.smallest)
    elif not res.ranked:
        raise _nothing_fits(pricer, limit, mesh, global_batch, None)
    res.considered, res.over_memory, res.refused = (pricer.considered, pricer.over_memory,
                                                    pricer.refused)
    res.simulated, res.probes = pricer.simulated, len(pricer.probes)
    res.seconds = time.perf_counter() - t0
    return res


def _in_order(pricer: _Pricer, queue: list, exhaustive: bool) -> Iterator[Ranked]:
    """The queued candidates in simulated-step order (ties: peak, then
    fields): one is simulated when its bound is at most the best simulated
    step not yet yielded, so what is yielded is final."""
    ready: list = []
    while queue or ready:
        if queue and (exhaustive or not ready or queue[0][0] <= ready[0][0]):
            bound, exact, n, cand = heapq.heappop(queue)
            if not exact:  # probe it now, and queue it by its own bound
                pricer.fetch_sure(cand, queue, ready)
                entry = pricer.exact(cand)
                if entry is not None:
                    assert entry[0] >= bound * (1 - 1e-9), (cand, bound, entry[0])
                    heapq.heappush(queue, (*entry, n, cand))
                continue
            pred = pricer.priced.pop(cand).predict()
            pricer.simulated += 1
            heapq.heappush(ready, (pred.step_s, max(pred.peak), cand, pred))
            continue
        _, _, cand, pred = heapq.heappop(ready)
        yield Ranked(cand, pred)


class _Proof:
    """Candidates planned in full (`full.evaluate`) until one fits."""

    def __init__(self, spec: Spec, st: Setting, limit: int):
        self.spec, self.st, self.limit = spec, st, limit
        self.made = self.over = 0
        self.seconds = 0.0
        self.smallest: tuple[int, Candidate] | None = None

    def planned(self, r: Ranked) -> Prediction | None:
        """`r`'s full Prediction if its full plan fits, else None."""
        t = time.perf_counter()
        self.made += 1
        worst = tuple(sorted(range(len(r.pred.peak)), key=lambda i: -r.pred.peak[i]))
        try:
            full = fits(self.spec, r.cand, self.st, r.pred.stage_layers, self.limit, worst)
        finally:
            self.seconds += time.perf_counter() - t
        if isinstance(full, Prediction):
            return full
        self.over += 1
        if self.smallest is None or full < self.smallest[0]:
            self.smallest = (full, r.cand)
        return None


class _Pricer:
    """Candidates priced from cached probes, layouts and stage works."""

    def __init__(self, spec: Spec, layers: int, st: Setting, limit: int,
                 lazy_sp: bool = False):
        """`lazy_sp`: candidates with sequence parallelism are first bounded
        by their twins without (`optimistic`), as those are searched too."""
        self.spec, self.layers, self.st, self.limit = spec, layers, st, limit
        self.lazy_sp = lazy_sp
        self.probes: dict = {}
        self.pool: ProcessPoolExecutor | None = None  # probe_many's workers, once needed
        self.works: dict = {}
        self.layouts: dict = {}
        self.stages: dict = {}
        self.priced: dict[Candidate, Priced] = {}
        self.bounds: dict[Candidate, tuple[int, Priced]] = {}  # optimistic: twins' state, price
        self.considered = self.over_memory = self.simulated = 0
        self.refused: Counter = Counter()
        self.smallest: tuple[int, Candidate] | None = None
        self.least_state: tuple[int, Candidate] | None = None  # of those not probed

    def probe(self, key) -> Probe | None:
        if key not in self.probes:
            self.probes[key] = probe_or_error(self.spec, key, self.st.dev)
        p = self.probes[key]
        if isinstance(p, ConfigError):
            self.refused[str(p)] += 1
            return None
        return p

    def _works(self, cand: Candidate, recompute: str):
        """(layers per virtual stage, Work per virtual stage) of `cand` at
        `recompute`. The layout is balanced on the costs without recompute,
        for every recompute mode: recompute then only adds work to the same
        stages, so a candidate priced without it bounds it (`optimistic`);
        and, where its twin without sequence parallelism is searched too,
        without it (`_layout_key`)."""
        lbase = self._layout_key(cand)
        pl = self.probe(lbase)
        key = probe_key(cand.tp, cand.micro_batch_size, recompute, cand.ep, cand.cp, cand.sp)
        p = self.probe(key) if pl is not None and key != lbase else pl
        if p is None or pl is None:
            return None
        split = spec_of(cand.schedule).splits_backward
        n = cand.pp * cand.vpp
        if (lbase, n) not in self.layouts:
            self.layouts[(lbase, n)] = layout(pl, cand, self.layers)
        counts = self.layouts[(lbase, n)]
        wkey = (key, n, cand.dp, cand.zero, split)
        if wkey not in self.works:
            patterns: list = [None] * n
            if cand.dp > 1:  # the dp collectives' pattern: this stage at dp 2, ZeRO 3
                pkey = _pattern_key(cand, recompute)
                if self.probe(pkey) is None:
                    return None
                patterns = self._stages(pkey, counts)
            made: dict[tuple[int, int], Work] = {}  # equal stages stay one object
            for w, pw in zip(self._stages(key, counts), patterns):
                if (id(w), id(pw)) not in made:
                    made[(id(w), id(pw))] = with_dp(w, cand, split, pw)
            self.works[wkey] = [made[(id(w), id(pw))]
                                for w, pw in zip(self._stages(key, counts), patterns)]
        return counts, self.works[wkey]

    def _layout_key(self, cand: Candidate) -> tuple:
        """The probe `cand`'s layout is balanced on: its layers' without
        recompute (nor sequence parallelism, where its twin is searched too)."""
        return probe_key(cand.tp, cand.micro_batch_size, Recompute.NONE, cand.ep, cand.cp,
                         cand.sp and not self.lazy_sp)

    def own_keys(self, c: Candidate) -> set[tuple]:
        """The probes `c` is priced exactly with: its layers' at its
        recompute, and its layout's (`_layout_key`); at dp > 1 its dp
        collectives' pattern."""
        return set(_keys(c, c.recompute)) | {self._layout_key(c)}

    def lazy(self, cand: Candidate) -> bool:
        """Whether `cand` is first bounded by a twin (`optimistic`): one
        with recompute by its twin without, one with sequence parallelism
        (where both are searched) by its twin without."""
        return cand.recompute != Recompute.NONE or (self.lazy_sp and cand.sp)

    def _twin(self, cand: Candidate) -> Candidate:
        """The candidate `optimistic` prices `cand` by (recompute aside)."""
        return replace(cand, sp=False) if self.lazy_sp and cand.sp else cand

    def prefetch(self, cands: list[Candidate], exhaustive: bool = False) -> None:
        """Plan the probes every candidate is first priced with, on all cores
        at once (`probe.probe_many`): its twin's without recompute (nor
        sequence parallelism, where its twin is searched too), as it is
        first bounded by it (`optimistic`). Its own probes are planned when
        the search reaches it (`fetch_sure`), unless `exhaustive` (all at
        once here)."""
        if exhaustive:
            self._fetch({k for c in cands for r in {c.recompute, Recompute.NONE}
                         for k in _keys(c, r)})
            return
        self._fetch({k for c in cands for k in _keys(self._twin(c), Recompute.NONE)})

    def fetch_sure(self, cand: Candidate, queue: list, ready: list) -> None:
        """Before `cand`'s own probes are planned: with them, those of every
        queued candidate still priced without its recompute that the search
        surely reaches before it yields again, on all cores at once: those
        bounded by no more than any simulated step to come (the ready ones',
        and the queued exact bounds, which their steps cannot undercut)."""
        if all(k in self.probes for k in self.own_keys(cand)):
            return
        limit = min([e[0] for e in queue if e[1]] + [r[0] for r in ready[:1]],
                    default=-math.inf)  # nothing bounds the steps to come yet: `cand` alone
        self._fetch({k for c in [cand] + [e[3] for e in queue if not e[1] and e[0] <= limit]
                     for k in self.own_keys(c)})

    def _fetch(self, keys: set) -> None:
        todo = sorted(keys - self.probes.keys(), key=str)
        if len(todo) >= 4 and self.pool is None:  # one pool for the whole search: its
            self.pool = probe_pool()              # workers keep what they captured
        self.probes.update(probe_many(self.spec, todo, self.st.dev, self.pool))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def _stages(self, key, counts):
        if (key, counts) not in self.stages:
            self.stages[(key, counts)] = stage_works(self.probes[key], counts)
        return self.stages[(key, counts)]

    def exact(self, cand: Candidate):
        """(bound, True) of a candidate that may fit; None when refused, or
        when even its floor is over the limit."""
        got = self._works(cand, cand.recompute)
        if got is None:
            return None
        counts, works = got
        peaks = memory(cand, works, counts, self.st)
        if max(memory(cand, works, counts, self.st, part="floor")) > self.limit:
            self._too_big(max(peaks), cand)
            return None
        priced = price(cand, works, self.st, counts, peaks)
        self.priced[cand] = priced
        return priced.lower_bound(), True

    def optimistic(self, cand: Candidate):
        """(bound, False): recompute only adds work to the same layout, so
        the candidate priced without it bounds it; sequence parallelism
        saves at most its twin's tp collectives and a share of its
        replicated compute, on the same layout (`Priced.bounding`)."""
        twin = replace(self._twin(cand), recompute=Recompute.NONE)
        got = self._works(twin, Recompute.NONE)
        if got is None:
            return None
        counts, works = got
        if twin not in self.bounds:  # shared by its recompute modes, with and without sp
            state = max(memory(twin, works, counts, self.st, part="state"))
            self.bounds[twin] = (state, price(twin, works, self.st, counts, (0,)))
        state, priced = self.bounds[twin]
        if state > self.limit:  # its state alone is too big, with or without recompute
            self.over_memory += 1
            if self.least_state is None or state < self.least_state[0]:
                self.least_state = (state, cand)
            return None
        sp = works if cand.sp != twin.sp else None
        return priced.bounding(cand, sp).lower_bound(), False

    def _too_big(self, peak: int, cand: Candidate) -> None:
        self.over_memory += 1
        if self.smallest is None or peak < self.smallest[0]:
            self.smallest = (peak, cand)


def _pattern_key(c: Candidate, recompute: str) -> tuple:
    """The probe of `c`'s dp collectives' pattern: its stage at dp 2, ZeRO 3."""
    return (c.tp, 1, recompute, 2, 3)


def _keys(c: Candidate, recompute: str) -> list[tuple]:
    """The probes `c` is priced with at `recompute`: its layers', and at dp > 1
    its dp collectives' pattern (`_Pricer._works`)."""
    keys = [probe_key(c.tp, c.micro_batch_size, recompute, c.ep, c.cp, c.sp)]
    return keys + [_pattern_key(c, recompute)] if c.dp > 1 else keys


def _nothing_fits(pricer: _Pricer, limit: int, mesh: Mesh, gbs: int,
                  planned: tuple[int, Candidate] | None) -> ConfigError:
    if planned is not None and (pricer.smallest is None or planned[0] <= pricer.smallest[0]):
        peak, cand = planned
        return ConfigError(
            f"no strategy fits --memory-per-device {limit / GiB:.2f} GiB: the smallest planned "
            f"peak found is {peak / GiB:.2f} GiB or more, planned in full ({cand.label()}); "
            f"allow at least {peak / GiB:.2f} GiB, or add devices")
    if pricer.smallest is None and pricer.least_state is not None:
        state, cand = pricer.least_state
        return ConfigError(
            f"no strategy fits --memory-per-device {limit / GiB:.2f} GiB: even the parameters, "
            f"gradients and optimizer state alone need {state / GiB:.2f} GiB per device "
            f"({cand.label()}); allow more than that, or add devices")
    if pricer.smallest is None:
        why = (f"; the planner refused the rest: {pricer.refused.most_common(1)[0][0]}"
               if pricer.refused else "")
        batch = (f"dp dividing the graph's batch {pricer.spec.samples} (one micro-batch over "
                 f"dp) and" if pricer.spec.samples else "dp")
        return ConfigError(
            f"no strategy for {pricer.spec.name} on {mesh.nodes} node(s) x "
            f"{mesh.devices_per_node} devices: dp x tp x pp must make {mesh.world} with "
            f"{batch} dividing the global batch {gbs}, tp the {mesh.devices_per_node} devices "
            f"of a node and the heads, and pp at most the layers{why}; use another device "
            "count or global batch")
    peak, cand = pricer.smallest
    return ConfigError(
        f"no strategy fits --memory-per-device {limit / GiB:.2f} GiB: the smallest planned "
        f"peak found is {peak / GiB:.2f} GiB, estimated ({cand.label()}); allow at least "
        f"{peak / GiB:.2f} GiB, or add devices")
