"""Plan directories: `job.json` plus one `rank_NNNNN.plan` per rank.

Invariants:
- Every file is sealed (`ir.fileio`: versioned, checksummed JSON, never
  pickle) and written atomically, so a reader sees a whole file or none.
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
from meshplan.ir.fileio import read_bytes, read_sealed, seal, unseal, write_atomic
from meshplan.ir.job import Job
from meshplan.plan.rankplan import Block, Buffer, MemoryPlan, RankPlan, Task, TaskKind
from meshplan.schedules.action import Action

KIND, VERSION = "meshplan.rankplan", 1
JOB_FILE = "job.json"
_PLAN_FILE = re.compile(r"rank_(\d+)\.plan")


def plan_name(rank: int) -> str:
    return f"rank_{rank:05d}.plan"


def _task_row(t: Task) -> list:
    row = [t.id, t.kind.value, t.op, t.chunk, t.phase.value, list(t.inputs),
           list(t.outputs), list(t.local), list(t.group), t.peer, t.peer_task,
           [list(x) for x in t.box]]
    return row + [t.kernel] if t.kernel else row  # cpu plans: the rows they always had


def plan_to_json(p: RankPlan) -> dict:
    out = {
        "rank": p.rank, "world": p.world, "stage": p.stage, "coord": list(p.coord),
        "job_digest": p.job_digest,
        "tasks": [_task_row(t) for t in p.tasks],
        "buffers": [[b.id, b.value, list(b.producers), list(b.consumers), list(b.shape),
                     b.dtype.name, b.nbytes, b.copies, b.category] for b in p.buffers],
        "memory": {"chunks": [list(c) for c in p.memory.chunks],
                   "blocks": [[b.id, b.chunk, b.offset, b.size, list(b.buffers)]
                              for b in p.memory.blocks],
                   "peak": [list(x) for x in p.memory.peak]},
        "actions": [str(a) for a in p.actions],
    }
    if p.device != "cpu":
        out["device"] = p.device
    return out


def _t(x) -> tuple:
    return tuple(x)


def plan_from_json(d: dict, where: str) -> RankPlan:
    try:
        tasks = tuple(Task(i, TaskKind(k), op, c, Phase(ph), _t(ins), _t(outs), _t(loc),
                           _t(grp), peer, pt, tuple(_t(b) for b in box), *kernel)
                      for i, k, op, c, ph, ins, outs, loc, grp, peer, pt, box, *kernel
                      in d["tasks"])
        buffers = tuple(Buffer(i, v, _t(pr), _t(co), _t(sh), DType(dt), nb, cp, cat)
                        for i, v, pr, co, sh, dt, nb, cp, cat in d["buffers"])
        m = d["memory"]
        memory = MemoryPlan(tuple(_t(c) for c in m["chunks"]),
                            tuple(Block(i, c, o, s, _t(b)) for i, c, o, s, b in m["blocks"]),
                            tuple(_t(x) for x in m["peak"]))
        return RankPlan(d["rank"], d["world"], d["stage"], _t(d["coord"]), d["job_digest"],
                        tasks, buffers, memory, tuple(Action.parse(a) for a in d["actions"]),
                        d.get("device", "cpu"))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where} holds a malformed {KIND} v{VERSION} body "
                        f"({type(e).__name__}: {str(e)[:80]}); recompile it") from None


def plan_to_bytes(p: RankPlan) -> bytes:
    return seal(KIND, VERSION, plan_to_json(p))


def plan_from_bytes(data: bytes, where: str = "<bytes>") -> RankPlan:
    return plan_from_json(unseal(data, KIND, VERSION, where), where)


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
    return plan_from_json(read_sealed(path, KIND, VERSION), str(path))


def read_dir(out: Path) -> tuple[Job, dict[int, RankPlan]]:
    """The Job and every rank's plan of a plan directory, cross-checked."""
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
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise PlanError(f"{out} lacks the plans of ranks {shown} (world {job.mesh.world}); "
                        "compile them, or check a directory compiled for all ranks")
    return job, plans
