"""Predicted seconds of each action, from the op cost model and a device
model (`costmodel/`), for the simulator.

A task costs `dev.compute_seconds(flops, bytes moved, dtype of its first
output)` on its physical (local) shapes; a collective costs
`dev.collective_seconds` on the full tensor's bytes (ring or tree, whichever
is cheaper), over the inter-node link when its group's ranks lie on more
than one node of the Job's mesh; a stage-crossing transfer costs
`dev.p2p_seconds` of its piece, inter-node when the peer is on another node.
Without a device model named, `CPU_DEFAULT` (a CPU-class guess) is used:
then the simulator ranks schedules and finds bubbles, it does not promise
wall-clock seconds.
"""

from __future__ import annotations

import math
from functools import cache

from meshplan.costmodel import CPU_DEFAULT, DeviceModel
from meshplan.ir import Phase, TensorMeta
from meshplan.ir.choices import KernelVariant
from meshplan.ir.kinds import short
from meshplan.ir.sbp import local_box
from meshplan.ir.sequence_order import causal_pairs
from meshplan.ir.stage_placement import StagePlacement
from meshplan.lowering.rankplan import RankPlan, TaskKind
from meshplan.ops.cost import bytes_moved
from meshplan.ops.infer import to_sig
from meshplan.ops.table import rule_for
from meshplan.schedules import stage_placement


@cache
def _op_cost(kind: str, sig_args: tuple, outs: tuple, dev: DeviceModel) -> tuple[float, float]:
    fl = rule_for(kind).flops
    flops = fl(sig_args) if fl is not None else 0.0
    dtype = next((o.dtype for o in outs if o is not None), "float32")
    return flops, dev.compute_seconds(flops, bytes_moved(sig_args, outs), dtype)


def compute_cost(job, t, value_meta: dict, dev: DeviceModel,
                 coord: tuple[int, ...] = ()) -> tuple[float, float]:
    """(flops, seconds) of compute task `t` on its physical shapes
    (`value_meta`: Job value id -> the rank's TensorMeta); a causal
    attention of a rank's rows (CAUSAL_OFFSET) computes every pair of its
    rows and keys, not half: its kernel takes the mask as an additive one,
    which flash kernels apply to every block rather than skip (measured on
    the CPU kernel: its first rows cost what its last ones do,
    docs/concepts/long_context.md); a ring's (RING) the pairs its blocks see."""
    op = job.graph.ops[t.op]
    sig = to_sig(op.args, lambda i: value_meta.get(i) or job.graph.values[i].meta)
    outs = tuple(value_meta.get(o) for o in op.outputs if o >= 0)
    flops, seconds = _op_cost(op.kind, sig, outs, dev)
    if KernelVariant.CAUSAL_OFFSET in t.variant:  # the op's rule counts half
        flops *= 2
        dtype = next((o.dtype for o in outs if o is not None), "float32")
        seconds = dev.compute_seconds(flops, bytes_moved(sig, outs), dtype)
    if KernelVariant.RING in t.variant and coord:
        return _ring_cost(job, op, t, sig, outs, flops, value_meta, dev, coord)
    if KernelVariant.EXPERTS in t.variant:
        return flops, seconds + _routing_seconds(job, op, t, sig, dev)
    return flops, seconds


def _routing_seconds(job, op, t, sig, dev: DeviceModel) -> float:
    """The all-to-alls of routed experts over its line (EXPERTS,
    `runtime/expert_dispatch.py`), the rows spread evenly over the experts:
    the counts, then the rows there and back (the forward's tokens; the
    backward's tokens, their gradients and gates there, the rows' and
    gates' gradients back). The kernel waits on each, so they add."""
    n, x, idx = len(t.group), sig[0], sig[1]
    rows = math.prod(idx.shape)
    row = x.shape[-1] * x.dtype.itemsize
    crosses = len({job.mesh.node_of(r) for r in t.group}) > 1
    backward = len(op.outputs) == 4
    moves = ((2 * row + 4, row + 4) if backward else (row, row))
    seconds = dev.collective_seconds("all_to_all", 8 * (sig[3].shape[0] * n) * n, n, crosses)
    return seconds + sum(dev.collective_seconds("all_to_all", rows * b * n, n, crosses)
                         for b in moves)


def _ring_cost(job, op, t, sig, outs, flops: float, value_meta: dict, dev: DeviceModel,
               coord: tuple[int, ...]) -> tuple[float, float]:
    """(flops, seconds) of a ring attention task: its rows against every
    key (a causal one's pairs its tokens keep), each block's transfer hidden
    behind the previous block's compute where it is shorter (the forward
    passes keys and values cp-1 times; the backward also their gradients,
    in fp32, cp times)."""
    backward = len(op.outputs) == 3
    causal = op.args[7] if backward else (len(op.args) > 4 and op.args[4] is True)
    q, k = (op.args[1], op.args[2]) if backward else (op.args[0], op.args[1])
    n, seq = len(t.group), job.graph.values[q.id].meta.shape[2]
    kmeta = value_meta.get(k.id) or job.graph.values[k.id].meta
    rows, cols = (value_meta.get(q.id) or job.graph.values[q.id].meta).shape[2], kmeta.shape[2]
    per_pair = (2 * flops if causal else flops) / max(1, rows * cols)
    grid = job.strategy.placement(job.stage[op.id]).grid
    lo, hi = local_box(job.graph.values[q.id].meta.shape, job.sbp[q.id], grid, coord)[2]
    pairs = causal_pairs(job.strategy, seq, (lo, hi), (0, seq)) if causal else rows * seq
    dtype = next((o.dtype for o in outs if o is not None), "float32")
    compute = dev.compute_seconds(per_pair * pairs, n * bytes_moved(sig, outs), dtype)
    crosses = len({job.mesh.node_of(r) for r in t.group}) > 1
    moved = (n - 1) * dev.p2p_seconds(2 * kmeta.nbytes, crosses)
    if backward:  # the gradients travel as fp32
        moved += n * dev.p2p_seconds(2 * kmeta.nbytes * 4 // kmeta.dtype.itemsize, crosses)
    return per_pair * pairs, max(compute, moved)


def send_bytes(t, metas: dict) -> int:
    """Bytes a SEND task moves: its box of the value."""
    nbytes = metas[t.inputs[0]].dtype.itemsize
    for a, b in t.box:
        nbytes *= b - a
    return nbytes


def action_costs(job, reps: dict[int, RankPlan], dev: DeviceModel = CPU_DEFAULT) -> dict:
    """{(virtual stage, "F"|"I"|"W"): s, ("comm", src, dst): s, ("step", stage): s}.

    I is the backward phase's tasks, W the weight phase's: in a Job without
    the split every backward task is I, W costs 0, and B = I + W."""
    where = stage_placement(job.strategy)
    out: dict = {}
    for stage, p in reps.items():
        metas = {b.id: TensorMeta(b.shape, b.dtype) for b in p.buffers}
        value_meta = {b.value: metas[b.id] for b in p.buffers}
        for t in p.tasks:
            key = _key(t, stage, where)
            out[key] = out.get(key, 0.0) + _task_seconds(job, p, t, value_meta, metas, dev,
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


def _task_seconds(job, p, t, value_meta, metas, dev, where, stage, out) -> float:
    op = job.graph.ops[t.op]
    if t.kind in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE):
        kind = short(op.kind)
        crosses = len({job.mesh.node_of(r) for r in t.group}) > 1
        return dev.collective_seconds(kind, full_bytes(kind, t, metas), len(t.group), crosses)
    if t.kind is TaskKind.SEND:
        src = where.stage_at(stage, t.chunk)
        dst = where.stage_at(job.stage[op.id], job.chunk[op.id])
        nbytes = send_bytes(t, metas)
        crosses = job.mesh.node_of(p.rank) != job.mesh.node_of(t.peer)
        out[("comm", src, dst)] = max(out.get(("comm", src, dst), 0.0),
                                      dev.p2p_seconds(nbytes, crosses))
        return 0.0
    if t.kind is TaskKind.RECV:
        return 0.0
    return compute_cost(job, t, value_meta, dev, p.coord)[1]


def full_bytes(kind: str, t, metas) -> int:
    """The full (unsharded) tensor's bytes of a collective task: its input for
    a reduction (every member holds the whole tensor), its output for an
    all-gather, the group times its shard for an all-to-all."""
    if kind == "all_gather" and t.outputs and t.outputs[0] in metas:
        return metas[t.outputs[0]].nbytes
    nbytes = metas[t.inputs[0]].nbytes
    return nbytes * len(t.group) if kind == "all_to_all" else nbytes


def attention_flops(job, plan: RankPlan, dev: DeviceModel) -> float:
    """The flops of one rank's attention kernels (forward and backward) per
    micro-batch, as its plan prices them (`compute_cost`)."""
    metas = {b.value: TensorMeta(b.shape, b.dtype) for b in plan.buffers}
    return sum(compute_cost(job, t, metas, dev, plan.coord)[0] for t in plan.tasks
               if t.kind is TaskKind.COMPUTE and "scaled_dot_product" in job.graph.ops[t.op].kind)
