"""Plan directories: `job.json` plus one `rank_NNNNN.plan` per rank.

Invariants:
- Every file is sealed (`ir.fileio`: versioned, checksummed JSON, never
  pickle) and written atomically, so a reader sees a whole file or none.
- A plan file has two parts: a head (rank, coordinate, Job digest, the
  base of the rank's task ids) and a body in which the rank's own ids are
  relative to it, so that data-parallel ranks whose plans differ only in
  their ids share one body (`driver/compile.py` writes it once).
- A RankPlan file names the digest of the Job it was lowered from; loading
  a directory checks that all agree, and that the ranks cover the world.
- Any problem is one `PlanError` line naming the file and how to fix it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.ir import DType, Phase
from meshplan.ir.fileio import encode_part, open_parts, read_bytes, seal_parts, write_atomic
from meshplan.ir.job import Job
from meshplan.lowering.ids import TASK_LOCAL_BITS
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

KIND, VERSION = "meshplan.rankplan", 4  # 4: buckets, run order and gathers
JOB_FILE = "job.json"
_PLAN_FILE = re.compile(r"rank_(\d+)\.plan")


def plan_name(rank: int) -> str:
    return f"rank_{rank:05d}.plan"


def plan_head(p: RankPlan, task_base: int) -> dict:
    """What a plan file says about its rank: who, where, of which Job."""
    head = {"rank": p.rank, "world": p.world, "stage": p.stage, "coord": list(p.coord),
            "job_digest": p.job_digest, "task_base": task_base}
    if p.device != "cpu":
        head["device"] = p.device
    return head


def plan_body(p: RankPlan, task_base: int) -> bytes:
    """The rest of a plan file, with the rank's own ids written relative to
    it: a task id less `task_base` (its rank and device bits), a buffer,
    block or arena id less `rank << 48`. Ranks whose lowering differs only in
    their own ids (`lower.RankClasses`) therefore share these bytes. Each
    distinct collective group is written once (`groups`; a task names its
    index): a data-parallel group of 128 ranks is not repeated per task."""
    own = p.rank << 48
    groups: dict[tuple[int, ...], int] = {}  # each distinct group written once

    def rows_of(t: Task) -> list:
        row = [t.id - task_base, t.kind.value, t.op, t.chunk, t.phase.value,
               [i - own for i in t.inputs], [o - own if o >= 0 else o for o in t.outputs],
               list(t.variant), groups.setdefault(t.group, len(groups)), t.peer, t.peer_task,
               [list(x) for x in t.box]]
        return row + [t.kernel] if t.kernel else row

    tasks = [rows_of(t) for t in p.tasks]
    extra: dict[str, list] = {}  # written only where a plan has them
    if p.buckets:
        extra["buckets"] = [[groups.setdefault(b.group, len(groups)), list(b.ops),
                             list(b.sources), b.after, [b.template[0], b.template[1].value],
                             b.every_run, b.kind, list(b.slots)] for b in p.buckets]
    if p.run_ids:
        extra["run_ids"] = [i - task_base for i in p.run_ids]
    if p.gathers:
        extra["gathers"] = [[[c, ph.value], [list(layer) for layer in layers]]
                            for (c, ph), layers in p.gathers]
    return encode_part({
        "groups": [list(g) for g in groups],
        "tasks": tasks,
        "buffers": [[b.id - own, b.value, [t - task_base for t in b.producers],
                     [t - task_base for t in b.consumers], list(b.shape), b.dtype.name,
                     b.nbytes, b.copies, b.category] for b in p.buffers],
        "memory": {"arenas": [[c - own, n, sz] for c, n, sz in p.memory.arenas],
                   "blocks": [[b.id - own, b.arena - own, b.offset, b.size,
                               [x - own for x in b.buffers]] for b in p.memory.blocks],
                   "peak": [list(x) for x in p.memory.peak]},
        "actions": [str(a) for a in p.actions],
    } | extra)


def seal_plan(head: dict, body: bytes) -> bytes:
    return seal_parts(KIND, VERSION, {"head": encode_part(head), "body": body})


def plan_to_bytes(p: RankPlan) -> bytes:
    base = own_task_base(p)
    return seal_plan(plan_head(p, base), plan_body(p, base))


def own_task_base(p: RankPlan) -> int:
    """The rank and device bits of `p`'s own task ids (any task of the plan has them)."""
    if not p.tasks:
        return 0
    return p.tasks[0].id >> TASK_LOCAL_BITS << TASK_LOCAL_BITS


def _t(x) -> tuple:
    return tuple(x)


def plan_from_bytes(data: bytes, where: str = "<bytes>") -> RankPlan:
    parts = open_parts(data, KIND, VERSION, where)
    try:
        h, d = parts.load("head"), parts.load("body")
        base, own = h["task_base"], h["rank"] << 48

        def ids(xs, add):
            return tuple(x + add for x in xs)

        groups = [_t(g) for g in d["groups"]]
        tasks = tuple(Task(i + base, TaskKind(k), op, c, Phase(ph), ids(ins, own),
                           tuple(o + own if o >= 0 else o for o in outs), _t(loc), groups[grp],
                           peer, pt, tuple(_t(b) for b in box), *kernel)
                      for i, k, op, c, ph, ins, outs, loc, grp, peer, pt, box, *kernel
                      in d["tasks"])
        buffers = tuple(Buffer(i + own, v, ids(pr, base), ids(co, base), _t(sh), DType(dt), nb,
                               cp, BufferCategory(cat))
                        for i, v, pr, co, sh, dt, nb, cp, cat in d["buffers"])
        m = d["memory"]
        memory = MemoryLayout(tuple((c + own, n, sz) for c, n, sz in m["arenas"]),
                            tuple(Block(i + own, c + own, o, s, ids(b, own))
                                  for i, c, o, s, b in m["blocks"]),
                            tuple(_t(x) for x in m["peak"]))
        buckets = tuple(Bucket(groups[grp], _t(ops), _t(src), after, (c, Phase(ph)), every,
                               kind, _t(slots))
                        for grp, ops, src, after, (c, ph), every, kind, slots
                        in d.get("buckets", ()))
        gathers = tuple(((c, Phase(ph)), tuple(_t(layer) for layer in layers))
                        for (c, ph), layers in d.get("gathers", ()))
        return RankPlan(h["rank"], h["world"], h["stage"], _t(h["coord"]), h["job_digest"],
                        tasks, buffers, memory, tuple(Action.parse(a) for a in d["actions"]),
                        h.get("device", "cpu"), buckets, ids(d.get("run_ids", ()), base),
                        gathers)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PlanError(f"{where} holds a malformed {KIND} v{VERSION} body "
                        f"({type(e).__name__}: {str(e)[:80]}); recompile it") from None


def write_job(out: Path, job: Job) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / JOB_FILE, job.to_bytes())


def write_plan(out: Path, plan: RankPlan) -> None:
    write_atomic(out / plan_name(plan.rank), plan_to_bytes(plan))


def read_job(out: Path) -> Job:
    path = Path(out) / JOB_FILE
    return Job.from_bytes(read_bytes(path), str(path))


def read_plan(out: Path, rank: int) -> RankPlan:
    path = Path(out) / plan_name(rank)
    return plan_from_bytes(read_bytes(path), str(path))


def read_dir(out: Path, partial: bool = False) -> tuple[Job, dict[int, RankPlan]]:
    """The Job and every rank's plan of a plan directory, cross-checked;
    with `partial`, the plans of the ranks it holds (at least one)."""
    out = Path(out)
    if not out.is_dir():
        raise PlanError(f"plan directory {out} does not exist; run `meshplan compile --out {out}`")
    job = read_job(out)
    digest = job.digest()
    # `plan_name` pads to 5 digits, so rank 100000 and up take more than 5.
    ranks = sorted(int(m[1]) for n in os.listdir(out) if (m := _PLAN_FILE.fullmatch(n))
                   and n == plan_name(int(m[1])))
    plans = {}
    for rank in ranks:
        p, n = read_plan(out, rank), plan_name(rank)
        if p.rank != rank or rank >= job.mesh.world:
            raise PlanError(f"{out / n} holds the plan of rank {p.rank}, which is not its own "
                            f"rank or is outside world {job.mesh.world}; recompile the whole "
                            "directory")
        if p.job_digest != digest:
            raise PlanError(f"{out / n} was lowered from another Job ({p.job_digest[:12]} != "
                            f"{digest[:12]}); recompile the whole directory")
        plans[p.rank] = p
    missing = sorted(set(range(job.mesh.world)) - set(plans))
    if missing and not (partial and plans):
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise PlanError(f"{out} lacks the plans of ranks {shown} (world {job.mesh.world}); "
                        "compile them, or check a directory compiled for all ranks")
    return job, plans
