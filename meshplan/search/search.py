"""The search: every candidate strategy priced from probes, those over the
memory limit dropped, the rest ranked by simulated step time.

Invariants:
- Exact branch and bound: a candidate is simulated only while its lower
  bound (`Priced.lower_bound`: the busiest rank's own work) is below the
  `top`-th best simulated step so far; candidates are visited in bound
  order, so the first `top` by simulated step are the same as simulating
  every candidate (`exhaustive=True` does, for the soundness check).
- Ties are broken by peak memory, then by the candidate's fields, so the
  ranking is deterministic.
- A candidate the planner refuses (a probe's ConfigError) is counted with
  its reason, never ranked. If none is left, or none fits the memory
  limit, `search` raises one ConfigError line saying why and what would fit.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field

from meshplan.costmodel import DeviceModel
from meshplan.errors import ConfigError
from meshplan.ir.choices import Schedule
from meshplan.ir.mesh import Mesh
from meshplan.search.estimate import Prediction, Priced, Setting, layout, price, stage_works, \
    with_dp
from meshplan.search.probe import ModelSpec, probe
from meshplan.search.space import Candidate, Space, candidates

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Ranked:
    cand: Candidate
    pred: Prediction


@dataclass(slots=True)
class SearchResult:
    ranked: list[Ranked]
    considered: int = 0
    over_memory: int = 0
    refused: Counter = field(default_factory=Counter)   # planner's reason -> candidates
    simulated: int = 0
    probes: int = 0
    seconds: float = 0.0

    @property
    def winner(self) -> Ranked:
        return self.ranked[0]


def search(spec: ModelSpec, mesh: Mesh, global_batch: int, dev: DeviceModel,
           memory_limit: int | None = None, space: Space = Space(), top: int = 10,
           bucket_mb: float = 25.0, exhaustive: bool = False) -> SearchResult:
    """The `top` fastest candidates within `memory_limit` bytes per device
    (the device model's memory when None), by simulated step time."""
    t0 = time.perf_counter()
    layers = spec.config().layers
    limit = memory_limit if memory_limit is not None else dev.memory_bytes
    st = Setting(mesh, global_batch, dev, bucket_mb, spec.precision)
    out = SearchResult([])
    fits: list[Priced] = []
    smallest: Priced | None = None
    probes: dict = {}
    for cand in candidates(mesh, layers, global_batch, space):
        out.considered += 1
        priced = _priced(spec, cand, layers, st, probes, out)
        if priced is None:
            continue
        if max(priced.peak) > limit:
            out.over_memory += 1
            if smallest is None or max(priced.peak) < max(smallest.peak):
                smallest = priced
            continue
        fits.append(priced)
    out.probes = len(probes)
    if not fits:
        raise _nothing_fits(out, smallest, limit, mesh)
    out.ranked = _rank(fits, top, exhaustive, out)
    out.seconds = time.perf_counter() - t0
    return out


def _priced(spec, cand, layers, st, probes, out) -> Priced | None:
    key = (cand.tp, cand.micro_batch_size, cand.recompute)
    if key not in probes:
        try:
            probes[key] = probe(spec, *key, st.dev)
        except ConfigError as err:
            probes[key] = err
    p = probes[key]
    if isinstance(p, ConfigError):
        out.refused[str(p)] += 1
        return None
    counts = layout(p, cand, layers)
    split = Schedule(cand.schedule).splits_backward
    works = [with_dp(w, cand, split) for w in stage_works(p, counts)]
    return price(cand, works, st, counts)


def _rank(fits: list[Priced], top: int, exhaustive: bool, out: SearchResult) -> list[Ranked]:
    fits.sort(key=lambda p: (p.lower_bound(), p.cand))
    best: list[tuple] = []  # max-heap of the top by (-step, -peak, ...)
    for p in fits:
        if not exhaustive and len(best) >= top and p.lower_bound() >= -best[0][0]:
            break
        pred = p.predict()
        out.simulated += 1
        item = (-pred.step_s, -max(pred.peak), _neg(p.cand), p.cand, pred)
        if len(best) < top:
            heapq.heappush(best, item)
        elif item > best[0]:
            heapq.heapreplace(best, item)
    order = sorted(best, key=lambda x: (-x[0], -x[1], x[3]))
    return [Ranked(x[3], x[4]) for x in order]


def _neg(c: Candidate) -> tuple:
    """A key that orders candidates backwards (the heap keeps the worst on top)."""
    return tuple(-x if isinstance(x, int) else tuple(-ord(ch) for ch in x) for x in (
        c.dp, c.tp, c.pp, c.vpp, c.schedule, c.micro_batch_size, c.recompute, c.zero))


def _nothing_fits(out: SearchResult, smallest: Priced | None, limit: int,
                  mesh: Mesh) -> ConfigError:
    if smallest is None:
        reason = out.refused.most_common(1)[0][0] if out.refused else "no candidate"
        return ConfigError(f"no strategy for this model on {mesh.nodes} node(s) x "
                           f"{mesh.devices_per_node} devices: every candidate was refused "
                           f"({reason})")
    peak = max(smallest.peak)
    return ConfigError(
        f"no strategy fits --memory-per-device {limit / GiB:.2f} GiB: the smallest planned "
        f"peak found is {peak / GiB:.2f} GiB ({smallest.cand.label()}); allow at least "
        f"{peak / GiB:.2f} GiB, or add devices")
