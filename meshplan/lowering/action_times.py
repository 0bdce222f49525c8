"""Predicted seconds of each action, from the op cost model, for the simulator.

A task costs max(flops / FLOP rate, bytes moved / memory bandwidth) on its
physical (local) shapes; a collective costs its ring traffic over the link
bandwidth plus a latency; a stage-crossing transfer its bytes over the link.
The device constants are deliberately simple (a CPU-class default); the
simulator's use is ranking schedules and finding bubbles, not promising
wall-clock seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from meshplan.ir import Phase, TensorMeta
from meshplan.ir.stage_placement import StagePlacement
from meshplan.lowering.rankplan import RankPlan, TaskKind
from meshplan.ops.cost import bytes_moved
from meshplan.ops.infer import to_sig
from meshplan.ops.table import rule_for


@dataclass(frozen=True, slots=True)
class DeviceModel:
    flops: float = 5e10        # FLOP/s
    mem_bw: float = 1e10       # bytes/s
    link_bw: float = 2e9       # bytes/s between ranks
    latency: float = 2e-5      # s per collective or transfer


@cache
def _op_seconds(kind: str, sig_args: tuple, outs: tuple, dev: DeviceModel) -> float:
    fl = rule_for(kind).flops
    flops = fl(sig_args) if fl is not None else 0.0
    return max(flops / dev.flops, bytes_moved(sig_args, outs) / dev.mem_bw)


def action_costs(job, reps: dict[int, RankPlan], dev: DeviceModel = DeviceModel()) -> dict:
    """{(virtual stage, "F"|"I"|"W"): s, ("comm", src, dst): s, ("step", stage): s}.

    I is the backward phase's tasks, W the weight phase's: in a Job without
    the split every backward task is I, W costs 0, and B = I + W."""
    where = job.strategy.stage_placement
    out: dict = {}
    for stage, p in reps.items():
        metas = {b.id: TensorMeta(b.shape, b.dtype) for b in p.buffers}
        value_meta = {b.value: metas[b.id] for b in p.buffers}
        for t in p.tasks:
            key = _key(t, stage, where)
            out[key] = out.get(key, 0.0) + _task_seconds(job, t, value_meta, metas, dev,
                                                         where, stage, out)
    for v in range(where.num_stages):
        for kind in _KIND.values():
            out.setdefault((v, kind), 0.0)
    return out


_KIND = {Phase.FORWARD: "F", Phase.BACKWARD: "I", Phase.WEIGHT: "W"}


def _key(t, stage: int, where: StagePlacement):
    if t.phase is Phase.OPTIMIZER:
        return ("step", stage)
    return (where.stage_at(stage, t.chunk), _KIND[t.phase])


def _task_seconds(job, t, value_meta, metas, dev, where, stage, out) -> float:
    op = job.graph.ops[t.op]
    if t.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE):
        n = len(t.group)
        nbytes = metas[t.inputs[0]].nbytes
        return dev.latency + 2 * (n - 1) / max(n, 1) * nbytes / dev.link_bw
    if t.kind is TaskKind.SEND:
        src = where.stage_at(stage, t.chunk)
        dst = where.stage_at(job.stage[op.id], job.chunk[op.id])
        nbytes = metas[t.inputs[0]].dtype.itemsize
        for a, b in t.box:
            nbytes *= b - a
        out[("comm", src, dst)] = max(out.get(("comm", src, dst), 0.0),
                                      dev.latency + nbytes / dev.link_bw)
        return 0.0
    if t.kind is TaskKind.RECV:
        return 0.0
    sig = to_sig(op.args, lambda i: value_meta.get(i) or job.graph.values[i].meta)
    outs = tuple(value_meta.get(o) for o in op.outputs if o >= 0)
    return _op_seconds(op.kind, sig, outs, dev)
