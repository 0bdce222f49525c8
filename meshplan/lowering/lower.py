"""lower(job, rank) -> RankPlan: one rank's physical plan, and only its own.

Invariants:
- Reads only the rank's `StageView` (its stage's ops and the transfers in
  and out): cost is O(ops of the stage + this rank's peers). Pieces from
  `ir.pieces` are computed for this rank only, collective groups from this
  rank's grid line (once per axis). Nothing here enumerates the cluster, and
  nothing infers: kernel workspace sizes come from the Job's `temps`.
- A peer's task id is derived, never looked up: send/recv tasks are
  numbered by (op, peer's position in its placement) on both sides.
- Pure function of (Job, rank, device type): central and separate compiles
  agree byte for byte (a view decoded from the Job's bytes equals the view
  of the decoded Job). The device type only picks each task's physical
  kernel (the op rule table's per-device chooser) and the device-type field
  of task ids; the Job stays device-independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from meshplan.errors import PlanError
from meshplan.ir import Phase, Role, TensorMeta
from meshplan.ir.job import Job, StageView
from meshplan.ir.kinds import TRANSFER
from meshplan.ir.mesh import Placement
from meshplan.ir.pieces import recv_pieces, send_pieces
from meshplan.ir.sbp import NdSbp, local_shape
from meshplan.lowering.actions import stage_actions
from meshplan.lowering.buckets import bound, grad_buckets, run_order
from meshplan.lowering.ids import (
    COLLECTIVE_STREAM,
    COMPUTE_STREAM,
    DEVICE_TYPES,
    P2P_STREAM,
    local_id,
    task_id,
)
from meshplan.lowering.memory import memory_layout
from meshplan.lowering.prefetch import gather_groups
from meshplan.lowering.rankplan import (
    STATE_CATEGORIES,
    Buffer,
    BufferCategory,
    RankPlan,
    Task,
    TaskKind,
    line_axis,
)
from meshplan.ops.rule import Category
from meshplan.ops.table import physical_kernel, rule_for
from meshplan.schedules import stage_placement
from meshplan.schedules.action import ActionType

# what `ir.pieces` needs of a transfer: (shape, src placement, src SBP, dst placement, dst SBP)
PieceArgs = tuple[tuple[int, ...], Placement, NdSbp, Placement, NdSbp]
_CATEGORY = {Role.PARAM: BufferCategory.PARAM, Role.BUFFER: BufferCategory.BUFFER,
             Role.GRAD: BufferCategory.GRAD, Role.OPT_STATE: BufferCategory.OPTIMIZER,
             Role.DATA: BufferCategory.DATA}


@dataclass
class _Buf:
    id: int
    value: int
    shape: tuple[int, ...]
    producers: list = field(default_factory=list)
    consumers: list = field(default_factory=list)
    made_in: tuple | None = None          # (chunk, phase) of the producing task
    used_in: set = field(default_factory=set)


class _Lowering:
    def __init__(self, view: StageView, rank: int, device_type: str):
        s = view.strategy
        self.view, self.rank = view, rank
        self.stage = s.stage_of_rank(rank)
        assert view.stage == self.stage, f"rank {rank} is not on stage {view.stage}"
        self.place = s.placement(self.stage)
        self.coord = self.place.coord(rank)
        self.dpn = view.mesh.devices_per_node
        if device_type not in DEVICE_TYPES:
            raise PlanError(f"no lowering for device type {device_type!r}; use one of "
                            f"{', '.join(DEVICE_TYPES)}")
        self.device = device_type
        self.device_type = DEVICE_TYPES[device_type]
        self.counter = 0
        self.bufs: dict[int, _Buf] = {}
        self.tasks: list[Task] = []
        self.edges: set[tuple[int, int, str]] = set()
        self.shapes: dict[tuple, tuple[int, ...]] = {}
        self.groups: dict[int, tuple[int, ...]] = {}

    @cached_property
    def op_of(self) -> dict:
        """The view's ops by id (asked by the memory layout)."""
        return {op.id: op for op in self.view.ops}

    def next_id(self) -> int:
        self.counter += 1
        return local_id(self.rank, self.counter - 1)

    def tid(self, stream: int, op_id: int, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return task_id(r, self.dpn, stream, op_id, self.device_type)

    def buf(self, vid: int) -> _Buf:
        b = self.bufs.get(vid)
        if b is None:
            key = (self.view.values[vid].meta.shape, self.view.sbp[vid])
            shape = self.shapes.get(key)
            if shape is None:
                shape = self.shapes[key] = local_shape(*key, self.place.grid, self.coord)
            b = self.bufs[vid] = _Buf(self.next_id(), vid, shape)
        return b

    def add(self, task: Task, reads, writes) -> None:
        self.tasks.append(task)
        key = (task.chunk, task.phase)
        for vid in reads:
            b = self.buf(vid)
            b.consumers.append(task.id)
            b.used_in.add(key)
        for vid in writes:
            b = self.buf(vid)
            b.producers.append(task.id)
            b.made_in = key

    def visit(self, op) -> None:
        view = self.view
        if op.kind == TRANSFER and view.strategy.pp > 1:
            self.transfer(op)
            return
        if view.op_stage[op.id] != self.stage:
            return
        category = rule_for(op.kind).category
        if category is Category.COLLECTIVE:
            kind = TaskKind.GRAD_REDUCE if op.phase is Phase.OPTIMIZER else TaskKind.COLLECTIVE
            kw = dict(op.kwargs)
            group = self.across(kw["stages"]) if "stages" in kw else self.group(kw["axis"])
            stream = COLLECTIVE_STREAM
        else:
            kind = TaskKind.OPTIMIZER if category is Category.OPTIMIZER else TaskKind.COMPUTE
            line = line_axis(view.op_variant[op.id])  # a ring, routed experts: over its line
            stream, group = COMPUTE_STREAM, () if line is None else self.group(line)
        outs = [o for o in op.outputs if o >= 0]
        refs = op.refs()
        task = Task(self.tid(stream, op.id), kind, op.id, view.op_chunk[op.id], op.phase,
                    tuple(self.buf(r).id for r in refs),
                    tuple(self.buf(o).id if o >= 0 else -1 for o in op.outputs),
                    view.op_variant[op.id], group,
                    kernel=physical_kernel(op, view.values, self.device))
        self.add(task, refs, outs)

    def group(self, axis: int) -> tuple[int, ...]:
        """The ranks of this rank's line along `axis`, in grid order."""
        out = self.groups.get(axis)
        if out is None:
            line = []
            for k in range(self.place.grid[axis]):
                c = list(self.coord)
                c[axis] = k
                line.append(self.place.rank_at(tuple(c)))
            out = self.groups[axis] = tuple(line)
        return out

    def across(self, stages) -> tuple[int, ...]:
        """The ranks at this rank's grid coordinate on each of `stages`."""
        return tuple(self.view.strategy.placement(st).rank_at(self.coord) for st in stages)

    def transfer(self, op) -> None:
        view, s = self.view, self.view.strategy
        kw = dict(op.kwargs)
        src_stage, dst_stage = kw["src_stage"], view.op_stage[op.id]
        if self.stage not in (src_stage, dst_stage):
            return
        src, dst = op.args[0].id, op.outputs[0]
        shape = view.values[src].meta.shape
        src_place, dst_place = s.placement(src_stage), s.placement(dst_stage)
        phase = Phase(kw["src_phase"])
        direction = "F" if phase is Phase.FORWARD else "B"
        where = stage_placement(s)
        self.edges.add((where.stage_at(src_stage, kw["src_chunk"]),
                        where.stage_at(dst_stage, view.op_chunk[op.id]), direction))
        args = (shape, src_place, view.sbp[src], dst_place, view.sbp[dst])
        if self.stage == src_stage:
            self.sends(op, args, src, kw["src_chunk"], phase, dst_place)
        else:
            self.recvs(op, args, dst, src_place, dst_place)

    def sends(self, op, args: PieceArgs, src, chunk, phase, dst_place: Placement) -> None:
        me = self.place.ranks.index(self.rank)
        for p in send_pieces(*args, self.rank):
            k = dst_place.ranks.index(p.dst)
            task = Task(self.tid(P2P_STREAM + k, op.id), TaskKind.SEND, op.id, chunk, phase,
                        (self.buf(src).id,), (), peer=p.dst,
                        peer_task=self.tid(P2P_STREAM + me, op.id, p.dst), box=p.box)
            self.add(task, (src,), ())

    def recvs(self, op, args: PieceArgs, dst, src_place: Placement, dst_place: Placement) -> None:
        me = dst_place.ranks.index(self.rank)
        for p in recv_pieces(*args, self.rank):
            k = src_place.ranks.index(p.src)
            task = Task(self.tid(P2P_STREAM + k, op.id), TaskKind.RECV, op.id,
                        self.view.op_chunk[op.id], op.phase, (), (self.buf(dst).id,), peer=p.src,
                        peer_task=self.tid(P2P_STREAM + me, op.id, p.src), box=p.box)
            self.add(task, (), (dst,))


def lower(job: Job | StageView, rank: int, device_type: str = "cpu") -> RankPlan:
    """The physical plan of `rank` on `device_type` (cpu | cuda): tasks (with
    the device's kernels), buffers, memory layout and actions. `job` may be the
    whole Job or the view of `rank`'s stage (`Job.view`, `StageView.from_bytes`)."""
    view = job if isinstance(job, StageView) else job.view(job.strategy.stage_of_rank(rank))
    low = _Lowering(view, rank, device_type)
    for op in sorted(view.ops, key=_run_order):
        low.visit(op)
    actions = stage_actions(view.strategy, low.stage, sorted(low.edges))
    inflight = in_flight(actions, stage_placement(view.strategy))
    buffers = _buffers(low, inflight)
    memory = memory_layout(low, buffers)
    tasks, op_of = tuple(low.tasks), low.op_of.__getitem__
    s = view.strategy
    nbytes = {b.value: b.nbytes for b in buffers}
    buckets = grad_buckets(tasks, op_of, view.values, view.finals, bound(s),
                           nbytes.__getitem__) if bound(s) else ()
    ordered = run_order(tasks, buckets, op_of)
    run_ids = tuple(t.id for t in ordered) if ordered != list(tasks) else ()
    gathers = tuple((key, tuple(tuple(t.op for t in layer) for layer in layers))
                    for key, layers in gather_groups(tasks, op_of, view.values,
                                                     s.layer_pattern).items()) \
        if s.zero.regathers else ()
    return RankPlan(rank, view.mesh.world, low.stage, low.coord, view.digest, tasks, buffers,
                    memory, tuple(actions), device_type, buckets, run_ids, gathers)


_RUN_ORDER = {Phase.WEIGHT: 1, Phase.OPTIMIZER: 2}


def _run_order(op) -> int:
    """Tasks in the order one micro-batch runs them when its B runs I then
    W: the weight phase after the rest of the backward (a stable sort keeps
    the Job's order within each), the optimizer last."""
    return _RUN_ORDER.get(op.phase, 0)


_ENDS = {ActionType.I: (Phase.BACKWARD,), ActionType.W: (Phase.WEIGHT,),
         ActionType.B: (Phase.BACKWARD, Phase.WEIGHT)}


def in_flight(actions, where) -> dict[tuple[int, Phase], int]:
    """Most micro-batches of each chunk alive at once between their F and
    the end of their I (key phase BACKWARD) or of their W (WEIGHT); a B ends
    both. Without the split the two agree."""
    live: dict[tuple[int, Phase], int] = {}
    peak: dict[tuple[int, Phase], int] = {}
    chunks = where.chunks
    for a in actions:
        if not a.type.is_compute:
            continue
        c = chunks[a.virtual_stage]
        for ph in (Phase.BACKWARD, Phase.WEIGHT) if a.type is ActionType.F else _ENDS[a.type]:
            key = (c, ph)
            live[key] = live.get(key, 0) + (1 if a.type is ActionType.F else -1)
            peak[key] = max(peak.get(key, 0), live[key])
    return peak


def _category(low: _Lowering, vid: int) -> BufferCategory:
    return _CATEGORY.get(low.view.values[vid].role, BufferCategory.ACTIVATION)


def _buffers(low: _Lowering, inflight: dict[tuple[int, Phase], int]) -> tuple[Buffer, ...]:
    out = []
    for vid, b in low.bufs.items():
        meta = low.view.values[vid].meta
        cat = _category(low, vid)
        crosses = b.made_in is None or any(k != b.made_in for k in b.used_in)
        if cat in STATE_CATEGORIES:
            copies = 1
        elif crosses:
            chunks = {k[0] for k in b.used_in} | ({b.made_in[0]} if b.made_in else set())
            # kept until W when a W reads it, else until I (or B)
            until = Phase.WEIGHT if any(k[1] is Phase.WEIGHT for k in b.used_in) \
                else Phase.BACKWARD
            copies = max([inflight.get((c, until), 1) for c in chunks] + [1])
        else:
            copies = 1
        nbytes = TensorMeta(b.shape, meta.dtype).nbytes
        out.append(Buffer(b.id, vid, tuple(b.producers), tuple(b.consumers), b.shape,
                          meta.dtype, nbytes, copies, cat))
    return tuple(sorted(out, key=lambda x: x.id))

