"""Plan classes: ranks whose plans are one plan up to a renaming of ranks.

A rank's plan depends on the rank through its own ids (relative to it in a
class body), its collective groups (its lines along mesh axes, or across the
stages holding a shared parameter's copies: named, not listed), its peers
and the slices it sends and receives, and the local shapes at its grid
coordinate. Along a *free* mesh axis all of these are translation-invariant:
every value splits evenly (equal local shapes, offsets linear in the
coordinate), and every stage-crossing transfer is aligned (the same layout on
both sides, the source's replicated axes last), so each rank exchanges its
whole local slice with the rank at its own coordinate on the other stage
(`ir/pieces`). Then:

- a rank's class is (its stage, its coordinate on the fixed axes); the class
  is lowered once, at any member, and its body (`encode`) says everything
  relative: buffer ids less `rank << LOCAL_BITS`, tasks by index (their ids are
  derived), groups as ("axis", a) / ("stages", ...), a peer as its stage and
  its coordinate on the fixed axes (on the free ones, the rank's own), a
  box less the rank's offsets along the free axes (`moves`: per free axis
  the dim it splits and the slice's length);
- `resolve(body, head, strategy)` is the rank's plan: equal to `lower` of it
  (tested at every rank; `compile` also lowers a second member per class and
  asserts it).

The fixed axes (`fixed_axes`) are those splitting some value unevenly, or
all axes when some transfer is not aligned. A class's representative is its
member at coordinate 0 on every free axis; the representatives are closed
under peers, shared-parameter lines and fixed-axis lines, so `check` proves
them and the heads (`lowering/check_classes.py`).
"""

from __future__ import annotations

from meshplan.ir import DType, Phase
from meshplan.ir.job import Job, StageView
from meshplan.ir.kinds import TRANSFER
from meshplan.ir.mesh import Strategy
from meshplan.ir.sbp import NdSbp, Shard
from meshplan.lowering.ids import (
    COLLECTIVE_STREAM,
    COMPUTE_STREAM,
    DEVICE_TYPES,
    LOCAL_BITS,
    P2P_STREAM,
    task_id,
)
from meshplan.lowering.rankplan import (
    Block,
    Bucket,
    Buffer,
    BufferCategory,
    MemoryLayout,
    RankPlan,
    Task,
    TaskKind,
)
from meshplan.schedules.action import Action

_STREAM = {TaskKind.COMPUTE: COMPUTE_STREAM, TaskKind.OPTIMIZER: COMPUTE_STREAM,
           TaskKind.COLLECTIVE: COLLECTIVE_STREAM, TaskKind.GRAD_REDUCE: COLLECTIVE_STREAM}


def fixed_axes(job: Job) -> tuple[int, ...]:
    """The mesh axes along which ranks' plans are not translates of each other."""
    grid = job.strategy.grid
    every = tuple(range(len(grid)))
    for op in job.graph.ops:
        if op.kind == TRANSFER and not aligned(job.sbp[op.refs()[0]], job.sbp[op.outputs[0]]):
            return every
    fixed: set[int] = set()
    for meta_sbp in {(v.meta.shape, job.sbp[v.id]) for v in job.graph.values}:
        fixed |= uneven_axes(*meta_sbp, grid)
    return tuple(sorted(fixed))


def aligned(src: NdSbp, dst: NdSbp) -> bool:
    """Whether a transfer sends each rank's whole slice to the rank at its own
    coordinate: one layout on both sides, and its replicated axes last (a
    receiver's source replica is picked by its flat index, `ir/pieces`)."""
    shard = [isinstance(s, Shard) for s in src]
    return src == dst and shard == sorted(shard, reverse=True)


def uneven_axes(shape: tuple[int, ...], sbp: NdSbp, grid: tuple[int, ...]) -> set[int]:
    """The axes of `sbp` cutting a dim of `shape` into unequal parts (and
    every later axis cutting that dim again)."""
    sizes, out, broken = list(shape), set(), set()
    for a, s in enumerate(sbp):
        if isinstance(s, Shard):
            d = s.dim
            if d in broken or sizes[d] % grid[a]:
                out.add(a)
                broken.add(d)
            else:
                sizes[d] //= grid[a]
    return out


def _moves(shape: tuple[int, ...], sbp: NdSbp, grid, free) -> list[list[int]]:
    """Per free axis splitting `shape`: [axis, dim, slice length]: a rank's
    slice starts `coord[axis] * length` further along `dim` per axis."""
    sizes, out = list(shape), []
    for a, s in enumerate(sbp):
        if isinstance(s, Shard):
            sizes[s.dim] //= grid[a]
            if a in free:
                out.append([a, s.dim, sizes[s.dim]])
    return out


def _shift(box, moves, coord, sign: int) -> list[list[int]]:
    out = [list(b) for b in box]
    for a, d, n in moves:
        out[d][0] += sign * coord[a] * n
        out[d][1] += sign * coord[a] * n
    return out


class GroupNames:
    """A rank's collective groups, named: by axis, by stages, or listed."""

    def __init__(self, strategy: Strategy, stage: int, coord: tuple[int, ...]):
        self.s, self.stage, self.coord = strategy, stage, coord
        self.place = strategy.placement(stage)

    def line(self, axis: int) -> tuple[int, ...]:
        c = list(self.coord)
        out = []
        for k in range(self.place.grid[axis]):
            c[axis] = k
            out.append(self.place.rank_at(tuple(c)))
        return tuple(out)

    def across(self, stages) -> tuple[int, ...]:
        return tuple(self.s.placement(st).rank_at(self.coord) for st in stages)

    def name(self, group: tuple[int, ...]) -> list:
        if not group:
            return ["none"]
        for a in range(len(self.coord)):
            if self.place.grid[a] == len(group) and group == self.line(a):
                return ["axis", a]
        stages = [self.s.stage_of_rank(r) for r in group]
        if group == self.across(stages):
            return ["stages", stages]
        return ["ranks", list(group)]

    def of(self, ref: list) -> tuple[int, ...]:
        kind = ref[0]
        if kind == "none":
            return ()
        if kind == "axis":
            return self.line(ref[1])
        if kind == "stages":
            return self.across(ref[1])
        return tuple(ref[1])


def encode(p: RankPlan, view: StageView, strategy: Strategy, fixed: tuple[int, ...]) -> dict:
    """The body of `p`'s class (JSON-able, with no trace of which member `p` is)."""
    free = [a for a in range(len(p.coord)) if a not in fixed]
    own = p.rank << LOCAL_BITS
    names = GroupNames(strategy, p.stage, p.coord)
    refs: dict[tuple[int, ...], int] = {}
    group_rows: list = []

    def gref(group) -> int:
        if group not in refs:
            refs[group] = len(group_rows)
            group_rows.append(names.name(group))
        return refs[group]

    index = {t.id: i for i, t in enumerate(p.tasks)}
    value_of = {b.id: b.value for b in p.buffers}
    grid = strategy.grid

    def task_row(t: Task) -> list:
        row: list = [t.kind.value, t.op, t.chunk, t.phase.value, [i - own for i in t.inputs],
               [o - own if o >= 0 else o for o in t.outputs], list(t.variant), gref(t.group)]
        if t.kind in (TaskKind.SEND, TaskKind.RECV):
            vid = value_of[(t.inputs or t.outputs)[0]]
            moves = _moves(view.values[vid].meta.shape, view.sbp[vid], grid, free)
            pstage = strategy.stage_of_rank(t.peer)
            pcoord = strategy.placement(pstage).coord(t.peer)
            row += [[pstage, [pcoord[a] if a in fixed else None for a in range(len(grid))]],
                    _shift(t.box, moves, p.coord, -1), moves]
        else:
            row += [None, None, None]
        return row + [t.kernel] if t.kernel else row

    tasks = [task_row(t) for t in p.tasks]
    out = {
        "stage": p.stage, "fixed": [[a, p.coord[a]] for a in fixed], "world": p.world,
        "device": p.device, "tasks": tasks,
        "buffers": [[b.id - own, b.value, [index[t] for t in b.producers],
                     [index[t] for t in b.consumers], list(b.shape), b.dtype.name,
                     b.nbytes, b.copies, b.category] for b in p.buffers],
        "memory": {"arenas": [[c - own, n, sz] for c, n, sz in p.memory.arenas],
                   "blocks": [[b.id - own, b.arena - own, b.offset, b.size,
                               [x - own for x in b.buffers]] for b in p.memory.blocks],
                   "peak": [list(x) for x in p.memory.peak]},
        "actions": [str(a) for a in p.actions],
    }
    if p.buckets:
        out["buckets"] = [[gref(b.group), list(b.ops), list(b.sources), b.after,
                           [b.template[0], b.template[1].value], b.every_run, b.kind,
                           list(b.slots)] for b in p.buckets]
    if p.run_ids:
        out["run_ids"] = [index[i] for i in p.run_ids]
    if p.gathers:
        out["gathers"] = [[[c, ph.value], [list(layer) for layer in layers]]
                          for (c, ph), layers in p.gathers]
    out["groups"] = group_rows
    return out


def _flat(coord, grid) -> int:
    i = 0
    for c, n in zip(coord, grid):
        i = i * n + c
    return i


def _t(x) -> tuple:
    return tuple(x)


def resolve(d: dict, rank: int, coord: tuple[int, ...], job_digest: str,
            strategy: Strategy, devices_per_node: int) -> RankPlan:
    """The plan of `rank` at grid `coord` of class body `d` (`encode`)."""
    stage, device = d["stage"], d["device"]
    dtype = DEVICE_TYPES[device]
    grid, own = strategy.grid, rank << LOCAL_BITS
    me = _flat(coord, grid)
    names = GroupNames(strategy, stage, coord)
    groups = [names.of(ref) for ref in d["groups"]]

    def tid(stream: int, op: int, r: int = rank) -> int:
        return task_id(r, devices_per_node, stream, op, dtype)

    tasks = []
    for kind, op, c, ph, ins, outs, var, grp, peer, box, moves, *kernel in d["tasks"]:
        kind = TaskKind(kind)
        inputs, outputs = tuple(i + own for i in ins), tuple(o + own if o >= 0 else o
                                                             for o in outs)
        if peer is None:
            tasks.append(Task(tid(_STREAM[kind], op), kind, op, c, Phase(ph), inputs, outputs,
                              _t(var), groups[grp], kernel=kernel[0] if kernel else ""))
            continue
        pstage, fixed_at = peer
        pcoord = tuple(coord[a] if x is None else x for a, x in enumerate(fixed_at))
        prank = strategy.placement(pstage).rank_at(pcoord)
        tasks.append(Task(tid(P2P_STREAM + _flat(pcoord, grid), op), kind, op, c, Phase(ph),
                          inputs, outputs, _t(var), groups[grp], prank,
                          tid(P2P_STREAM + me, op, prank),
                          tuple(_t(b) for b in _shift(box, moves, coord, 1)),
                          kernel[0] if kernel else ""))
    ids = [t.id for t in tasks]
    buffers = tuple(Buffer(i + own, v, tuple(ids[k] for k in pr), tuple(ids[k] for k in co),
                           _t(sh), DType(dt), nb, cp, BufferCategory(cat))
                    for i, v, pr, co, sh, dt, nb, cp, cat in d["buffers"])
    m = d["memory"]
    memory = MemoryLayout(tuple((c + own, n, sz) for c, n, sz in m["arenas"]),
                          tuple(Block(i + own, c + own, o, s, tuple(x + own for x in b))
                                for i, c, o, s, b in m["blocks"]),
                          tuple(_t(x) for x in m["peak"]))
    buckets = tuple(Bucket(groups[grp], _t(ops), _t(src), after, (c, Phase(ph)), every,
                           kind, _t(slots))
                    for grp, ops, src, after, (c, ph), every, kind, slots
                    in d.get("buckets", ()))
    gathers = tuple(((c, Phase(ph)), tuple(_t(layer) for layer in layers))
                    for (c, ph), layers in d.get("gathers", ()))
    return RankPlan(rank, d["world"], stage, coord, job_digest, tuple(tasks), buffers, memory,
                    tuple(Action.parse(a) for a in d["actions"]), device, buckets,
                    tuple(ids[k] for k in d.get("run_ids", ())), gathers)
