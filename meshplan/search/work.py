"""What one pipeline stage's rank does per micro-batch and per step, read off
its RankPlan and priced on a device model: the quantities the search adds
up layer by layer and the full evaluation reads off a whole plan.

Invariants:
- `Work` is additive: a stage of k identical layers is the first and last
  layers' extras plus k times one layer (`plus`, `times`).
- Compute tasks and tensor-parallel collectives are priced here, with the
  simulator's own per-task costs (`lowering/action_times.py`) (seconds
  per micro-batch of F, I and W, and per step of the optimizer); the tp
  group never leaves a node (the search keeps tp <= devices per node).
- Data-side collectives (over the data axes: dp, and with ep > 1 the ep
  axis and the one before it, all-to-alls included) are *not* priced here:
  they are kept as `DpKey` (the `Slot` it runs in, its `DpKind`, the ranks
  it spans as `Over` names them) -> (count, bytes of the full tensors),
  because their price depends on the degrees and on whether the group
  crosses nodes, which the search varies (`estimate.dp_seconds`). A probe
  planned at dp = 1 has none; `estimate` makes them from the parameter and
  gradient bytes.
- Memory: state bytes per category (one gradient copy), the bytes one
  micro-batch keeps from its F to its I (`saved_i`) or W (`saved_w`), or
  from its I to its W (`saved_iw`: within one B without the split), and
  per stage the transient extent and kernel workspace (not additive: the
  largest is taken).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any

from meshplan.costmodel import DeviceModel
from meshplan.ir import Phase, TensorMeta
from meshplan.ir.kinds import short
from meshplan.ir.sbp import Replicate
from meshplan.lowering.action_times import compute_cost, full_bytes, send_bytes
from meshplan.lowering.memory import collective_temp
from meshplan.lowering.rankplan import BufferCategory, RankPlan, TaskKind
from meshplan.passes.expert_parallel import is_expert_param
from meshplan.schedules import stage_placement


class Slot(enum.StrEnum):
    """Where work runs: a micro-batch's F, I or W, or the step's optimizer
    (each value names the `Work` field of its seconds)."""

    F = "f"
    I = "i"  # noqa: E741 (the schedules' letter)
    W = "w"
    STEP = "step"


class DpKind(enum.StrEnum):
    """A data-parallel collective (its op kind's short name, which the device model prices)."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"


class Over(enum.StrEnum):
    """The ranks a data-side collective runs over, as a candidate's degrees
    say (`group_size`): every data-parallel rank; with ep > 1, the ep ranks
    (an all-to-all, a dense gradient's second reduction), or the dp/ep ranks
    beside them (an expert gradient's only one, a dense one's first)."""

    DP = "dp"
    EP = "ep"
    DP_PER_EP = "dp/ep"
    CP = "cp"  # the sequence's ranks: attention's gathers, the weights' second reduction

    def group_size(self, dp: int, ep: int, cp: int = 1) -> int:
        return {Over.DP: dp, Over.EP: ep, Over.DP_PER_EP: dp // ep, Over.CP: cp}[self]


@dataclass(frozen=True, slots=True, order=True)
class DpKey:
    """A `Work.dp` key: which collective, in which slot, over which ranks."""

    phase: Slot
    kind: DpKind
    over: Over = Over.DP


_PHASE = {Phase.FORWARD: Slot.F, Phase.BACKWARD: Slot.I, Phase.WEIGHT: Slot.W,
          Phase.OPTIMIZER: Slot.STEP}
_STATE = {BufferCategory.PARAM: "param", BufferCategory.BUFFER: "param",
          BufferCategory.GRAD: "grad", BufferCategory.OPTIMIZER: "optimizer"}


@dataclass(frozen=True, slots=True)
class Work:
    f: float = 0.0            # seconds per micro-batch: forward
    i: float = 0.0            # input-gradient backward (all of it without the split)
    w: float = 0.0            # weight-gradient phase
    step: float = 0.0         # seconds per step: the optimizer's compute
    flops: float = 0.0        # flops per micro-batch (F + I + W), as executed
    param: int = 0            # state bytes at rest
    grad: int = 0             # one gradient copy
    optimizer: int = 0
    saved_i: int = 0          # bytes a micro-batch keeps from F to I
    saved_w: int = 0          # ... from F to W
    saved_iw: int = 0         # ... from I to W (zero-bubble schedules only)
    params: int = 0           # parameter tensors (dp collectives: one each)
    expert: int = 0           # bytes of expert parameters at rest (within `param`)
    layers: int = 0           # layers (ZeRO-3 gathers a layer's parameters at once)
    dp: tuple[tuple[DpKey, tuple[int, int]], ...] = ()  # key -> (n, bytes)
    transient: int = 0        # per stage, not additive: the largest action's scratch
    temp: int = 0
    send_f: int = 0           # bytes per micro-batch the stage sends on (its boundary)
    send_b: int = 0
    # seconds of f, i, w that sequence parallelism could at most save at this
    # tp: its tp collectives, and the (1 - 1/tp) share of its compute
    # replicated over tp (`estimate.Priced.bounding`)
    sp_f: float = 0.0
    sp_i: float = 0.0
    sp_w: float = 0.0

    def plus(self, o: Work) -> Work:
        out = {n: getattr(self, n) + getattr(o, n) for n in _ADDITIVE}
        wide = {n: max(getattr(self, n), getattr(o, n)) for n in _WIDEST}
        return Work(**out, **wide, dp=_lin(self.dp, 1, o.dp, 1))

    def times(self, k: int) -> Work:
        return replace(self, **{n: getattr(self, n) * k for n in _ADDITIVE},
                       dp=_lin(self.dp, k))

    def per(self, k: int) -> Work:
        """One of `k` identical layers: the additive fields over k (bytes
        and counts exactly, as identical layers make them)."""
        out: dict[str, Any] = {n: _over(getattr(self, n), k) for n in _ADDITIVE}
        return replace(self, **out, dp=tuple((key, (c // k, b // k)) for key, (c, b) in self.dp))

    def minus(self, o: Work) -> Work:
        """The extras of a stage beyond `o` (one layer); its own widest fields."""
        return replace(self, **{n: getattr(self, n) - getattr(o, n) for n in _ADDITIVE},
                       dp=_lin(self.dp, 1, o.dp, -1))


_WIDEST = ("transient", "temp", "send_f", "send_b")
_ADDITIVE = tuple(f.name for f in fields(Work) if f.name not in (*_WIDEST, "dp"))


def _over(x, k: int):
    return x / k if isinstance(x, float) else x // k


def _lin(a, ka: int, b=(), kb: int = 0):
    """ka * a + kb * b of two (key, (count, bytes)) tuples."""
    out: dict = {}
    for items, k in ((a, ka), (b, kb)):
        for key, (c, s) in items:
            c0, s0 = out.get(key, (0, 0))
            out[key] = (c0 + k * c, s0 + k * s)
    return tuple(sorted((key, v) for key, v in out.items() if v[0]))


@dataclass(frozen=True, slots=True)
class StageWork:
    """A rank's work per virtual stage it runs, and its memory layout's peak."""

    by_stage: dict = field(default_factory=dict)   # virtual stage -> Work
    peak: dict = field(default_factory=dict)       # category -> planned bytes


def read_work(job, plan: RankPlan, dev: DeviceModel) -> StageWork:
    """The Work of each virtual stage `plan`'s rank runs, priced on `dev`."""
    where = stage_placement(job.strategy)
    over = _data_axes(job.strategy)
    acc: dict[int, dict] = {}
    metas = {b.id: TensorMeta(b.shape, b.dtype) for b in plan.buffers}
    value_meta = {b.value: metas[b.id] for b in plan.buffers}
    task_of = {t.id: t for t in plan.tasks}
    stage = plan.stage
    tp, tp_axis = job.strategy.tp, job.strategy.tp_axis
    step_v = where.stage_at(stage, 0)
    for t in plan.tasks:
        v = step_v if t.phase is Phase.OPTIMIZER else where.stage_at(stage, t.chunk)
        w = acc.setdefault(v, {"dp": Counter(), "dpn": Counter()})
        key = _PHASE[t.phase]
        op = job.graph.ops[t.op]
        if t.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE):
            full = full_bytes(short(op.kind), t, metas)
            axis = _data_side(op, over)
            if axis is not None:
                dkey = DpKey(key, DpKind(short(op.kind)), axis)
                w["dpn"][dkey] += 1
                w["dp"][dkey] += full
            else:
                crosses = len({job.mesh.node_of(r) for r in t.group}) > 1
                seconds = dev.collective_seconds(short(op.kind), full, len(t.group), crosses)
                w[key] = w.get(key, 0.0) + seconds
                _could_save(w, key, seconds)
            continue
        if t.kind is TaskKind.SEND:
            name = "send_f" if t.phase is Phase.FORWARD else "send_b"
            w[name] = w.get(name, 0) + send_bytes(t, metas)
            continue
        if t.kind is TaskKind.RECV:
            continue
        flops, seconds = compute_cost(job, t, value_meta, dev, plan.coord)
        w[key] = w.get(key, 0.0) + seconds
        if tp > 1 and all(isinstance(job.sbp[r][tp_axis], Replicate) for r in op.refs()):
            _could_save(w, key, seconds * (1 - 1 / tp))
        if key is not Slot.STEP:
            w["flops"] = w.get("flops", 0.0) + flops
    _memory(job, plan, task_of, where, stage, acc)
    by_stage = {}
    for v, w in acc.items():
        dp = tuple(sorted((k, (w["dpn"][k], w["dp"][k])) for k in w["dpn"]))
        by_stage[v] = Work(**{k: x for k, x in w.items() if k not in ("dp", "dpn")}, dp=dp)
    return StageWork(by_stage, dict(plan.memory.peak))


def _could_save(w: dict, key: Slot, seconds: float) -> None:
    """Count `seconds` of slot `key` as what sequence parallelism could save."""
    if key is not Slot.STEP:
        w[f"sp_{key}"] = w.get(f"sp_{key}", 0.0) + seconds


def _data_side(op, over: dict[int, Over]) -> Over | None:
    """The data-side ranks collective `op` runs over (None: a model-side one,
    tp's or a stage boundary's); `over`: `_data_axes`."""
    kw = dict(op.kwargs)
    return Over.DP if "stages" in kw else over.get(kw["axis"]) if "axis" in kw else None


def _data_axes(strategy) -> dict[int, Over]:
    """The grid's data-side axes and the ranks each spans, as `Over` names
    them (the ep axis and the one before it when ep > 1, else dp alone; and
    the cp axis)."""
    cp = {strategy.cp_axis: Over.CP} if strategy.cp_axis is not None else {}
    if strategy.ep_axis is None:
        return {a: Over.DP for a in strategy.data_axes} | cp
    return {a: Over.EP if a == strategy.ep_axis else Over.DP_PER_EP
            for a in strategy.data_axes} | cp


def _memory(job, plan: RankPlan, task_of, where, stage: int, acc: dict) -> None:
    """State bytes and saved bytes per micro-batch, by virtual stage; the
    transient extent and workspace of the whole rank go to its first stage."""
    saved_extent = 0
    first = where.stage_at(stage, 0)
    blocked = {i for blk in plan.memory.blocks for i in blk.buffers}
    for b in plan.buffers:
        users = [task_of[t] for t in b.producers + b.consumers if t in task_of]
        chunk = min((t.chunk for t in users if t.phase is not Phase.OPTIMIZER), default=0)
        w = acc.setdefault(where.stage_at(stage, chunk), {"dp": Counter(), "dpn": Counter()})
        if b.category in _STATE:
            name = _STATE[b.category]
            w[name] = w.get(name, 0) + b.nbytes
            if b.category is BufferCategory.PARAM:
                w["params"] = w.get("params", 0) + 1
                if is_expert_param(job.graph.values[b.value].name):
                    w["expert"] = w.get("expert", 0) + b.nbytes
        elif b.id in blocked and (b.category is BufferCategory.DATA or b.copies > 1):
            made = {task_of[t].phase for t in b.producers if t in task_of}
            name = ("saved_iw" if made and Phase.FORWARD not in made else
                    "saved_w" if any(t.phase is Phase.WEIGHT for t in users) else "saved_i")
            w[name] = w.get(name, 0) + b.nbytes
            saved_extent += b.nbytes * b.copies
    peak = dict(plan.memory.peak)
    w = acc.setdefault(first, {"dp": Counter(), "dpn": Counter()})
    w["transient"] = max(0, peak.get("activation", 0) - saved_extent)
    # without the data-side collectives' buffers: the estimate prices the
    # candidate's own (`estimate._collective_bytes`), not the probe's
    by_value = {b.value: b for b in plan.buffers}
    over = _data_axes(job.strategy)
    g, s = job.graph, job.strategy
    w["temp"] = peak.get("temp", 0) - \
        collective_temp(plan.tasks, g.ops, g.values, s, by_value, plan.buckets) + \
        collective_temp(plan.tasks, g.ops, g.values, s, by_value, (),
                        keep=lambda t: _data_side(g.ops[t.op], over) is None)
