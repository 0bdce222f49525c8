"""Plan directories: `job.json`, one small `rank_NNNNN.plan` per rank, and
one body per plan class under `classes/`.

Invariants:
- Every file is sealed (`ir.fileio`: versioned, checksummed JSON, never
  pickle) and written atomically, so a reader sees a whole file or none.
- A rank's file is a head: its rank, stage and grid coordinate, the Job's
  digest and the sha256 of its class's body (`lowering/classes.py`), which is
  stored once, content-addressed, as `classes/<sha256>.plan`. The rank's plan
  is the body resolved at its coordinate (`classes.resolve`): a rank reads
  its head, one body and the Job's strategy, nothing of any other rank.
- Loading a directory checks that every head names this Job and its own
  rank, that the ranks cover the world, and that a body's name is its hash.
- Any problem is one `PlanError` line naming the file and how to fix it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.ir.fileio import (
    encode_part,
    open_parts,
    read_bytes,
    seal_parts,
    sealed_parts,
    write_atomic,
)
from meshplan.ir.job import Job, JobReader
from meshplan.ir.mesh import Strategy
from meshplan.lowering.classes import encode, fixed_axes, resolve
from meshplan.lowering.rankplan import RankPlan

KIND, VERSION = "meshplan.rankplan", 5  # 5: a head naming its class's body
CLASS_KIND, CLASS_VERSION = "meshplan.planclass", 1
JOB_FILE = "job.json"
CLASS_DIR = "classes"
_PLAN_FILE = re.compile(r"rank_(\d+)\.plan")


def plan_name(rank: int) -> str:
    return f"rank_{rank:05d}.plan"


def class_name(digest: str) -> str:
    """A class body's file, named by its content's sha256."""
    return f"{CLASS_DIR}/{digest}.plan"


def class_bytes(body: dict) -> tuple[str, bytes]:
    """A class body's (`classes.encode`) digest and sealed file."""
    parts = sealed_parts(CLASS_KIND, CLASS_VERSION, {"body": encode_part(body)})
    return parts.digest, parts.data


def head_bytes(body: dict, klass: str, rank: int, coord: tuple[int, ...],
               job_digest: str) -> bytes:
    """The file of member `rank` at `coord` of the class whose body is `body`
    (digest `klass`): who, where, of which Job, and which class."""
    head = {"rank": rank, "world": body["world"], "stage": body["stage"], "coord": list(coord),
            "job_digest": job_digest, "class": klass, "device": body["device"]}
    return seal_parts(KIND, VERSION, {"head": encode_part(head)})


def plan_files(p: RankPlan, job: Job) -> tuple[bytes, str, bytes]:
    """`p`'s head file, its class's digest and its class's file."""
    body = encode(p, job.view(p.stage), job.strategy, fixed_axes(job))
    klass, data = class_bytes(body)
    return head_bytes(body, klass, p.rank, p.coord, p.job_digest), klass, data


def _part(data: bytes, kind: str, version: int, name: str, where: str):
    parts = open_parts(data, kind, version, where)
    if name not in parts:
        raise PlanError(f"{where} holds a malformed {kind} v{version} file; recompile it")
    return parts, parts.load(name)


def open_head(data: bytes, where: str) -> dict:
    _, head = _part(data, KIND, VERSION, "head", where)
    if not (isinstance(head, dict) and all(type(head.get(k)) is int
                                           for k in ("rank", "world", "stage"))
            and isinstance(head.get("class"), str) and isinstance(head.get("coord"), list)
            and isinstance(head.get("job_digest"), str)):
        raise PlanError(f"{where} holds a malformed {KIND} v{VERSION} head; recompile it")
    return head


def open_class(data: bytes, where: str, digest: str | None = None) -> dict:
    parts, body = _part(data, CLASS_KIND, CLASS_VERSION, "body", where)
    if digest is not None and parts.digest != digest:
        raise PlanError(f"{where} does not hold the class body its name says "
                        f"({parts.digest[:12]}); recompile the whole directory")
    if not isinstance(body, dict):
        raise PlanError(f"{where} holds a malformed {CLASS_KIND} body; recompile it")
    return body


def through_files(p: RankPlan, job: Job) -> RankPlan:
    """`p` written to its files and read back, as its rank reads them."""
    head, _, body = plan_files(p, job)
    return plan_from_files(open_head(head, "<head>"), open_class(body, "<class>"),
                           job.strategy, job.mesh.devices_per_node)


def plan_from_files(head: dict, body: dict, strategy: Strategy, devices_per_node: int,
                    where: str = "<bytes>") -> RankPlan:
    """The plan a rank's head and its class's body say (`classes.resolve`)."""
    try:
        if body["stage"] != head["stage"]:
            raise ValueError(f"class of stage {body['stage']}, rank of stage {head['stage']}")
        return resolve(body, head["rank"], tuple(head["coord"]), head["job_digest"], strategy,
                       devices_per_node)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PlanError(f"{where} and its class body do not make a plan "
                        f"({type(e).__name__}: {str(e)[:80]}); recompile it") from None


def write_job(out: Path, job: Job) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / JOB_FILE, job.to_bytes())


def write_plan(out: Path, plan: RankPlan, job: Job) -> None:
    """`plan`'s head and its class's body into directory `out`."""
    head, klass, body = plan_files(plan, job)
    (Path(out) / CLASS_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(out) / class_name(klass), body)
    write_atomic(Path(out) / plan_name(plan.rank), head)


def read_job(out: Path) -> Job:
    if not Path(out).is_dir():
        raise PlanError(f"plan directory {out} does not exist; run `meshplan compile --out {out}`")
    path = Path(out) / JOB_FILE
    return Job.from_bytes(read_bytes(path), str(path))


class PlanDir:
    """A plan directory read for its heads, each class body decoded once."""

    def __init__(self, out: Path, strategy: Strategy, devices_per_node: int):
        self.out, self.strategy, self.dpn = Path(out), strategy, devices_per_node
        self.bodies: dict[str, dict] = {}

    def head(self, rank: int) -> dict:
        path = self.out / plan_name(rank)
        return open_head(read_bytes(path), str(path))

    def body(self, klass: str, where: str) -> dict:
        if klass not in self.bodies:
            path = self.out / class_name(klass)
            if not path.is_file():
                raise PlanError(f"{where} names class {klass[:12]}, which {self.out} lacks; "
                                "recompile the whole directory")
            self.bodies[klass] = open_class(read_bytes(path), str(path), klass)
        return self.bodies[klass]

    def plan(self, head: dict) -> RankPlan:
        where = str(self.out / plan_name(head["rank"]))
        return plan_from_files(head, self.body(head["class"], where), self.strategy, self.dpn,
                               where)


def read_plan(out: Path, rank: int, strategy: Strategy | None = None,
              devices_per_node: int = 0) -> RankPlan:
    """Rank `rank`'s plan: its head, its class's body, and the Job's strategy
    and devices per node (read from `job.json` unless given)."""
    if strategy is None:
        path = Path(out) / JOB_FILE
        job = JobReader(read_bytes(path), str(path))
        strategy, devices_per_node = job.strategy, job.mesh.devices_per_node
    d = PlanDir(out, strategy, devices_per_node)
    return d.plan(d.head(rank))


def read_heads(out: Path, job: Job, partial: bool = False) -> tuple[PlanDir, dict[int, dict]]:
    """Every rank's head of a plan directory, each checked against its file
    name and the Job; with `partial`, the heads of the ranks it holds (at
    least one)."""
    out = Path(out)
    if not out.is_dir():
        raise PlanError(f"plan directory {out} does not exist; run `meshplan compile --out {out}`")
    digest, world = job.digest(), job.mesh.world
    # `plan_name` pads to 5 digits, so rank 100000 and up take more than 5.
    ranks = sorted(int(m[1]) for n in os.listdir(out) if (m := _PLAN_FILE.fullmatch(n))
                   and n == plan_name(int(m[1])))
    d = PlanDir(out, job.strategy, job.mesh.devices_per_node)
    heads = {}
    for rank in ranks:
        h, n = d.head(rank), plan_name(rank)
        if h["rank"] != rank or rank >= world:
            raise PlanError(f"{out / n} holds the plan of rank {h['rank']}, which is not its own "
                            f"rank or is outside world {world}; recompile the whole directory")
        if h["job_digest"] != digest:
            raise PlanError(f"{out / n} was lowered from another Job ({h['job_digest'][:12]} != "
                            f"{digest[:12]}); recompile the whole directory")
        heads[rank] = h
    missing = sorted(set(range(world)) - set(heads))
    if missing and not (partial and heads):
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise PlanError(f"{out} lacks the plans of ranks {shown} (world {world}); "
                        "compile them, or check a directory compiled for all ranks")
    return d, heads


def read_dir(out: Path, partial: bool = False) -> tuple[Job, dict[int, RankPlan]]:
    """The Job and every rank's plan of a plan directory, cross-checked;
    with `partial`, the plans of the ranks it holds (at least one)."""
    job = read_job(out)
    d, heads = read_heads(out, job, partial)
    return job, {r: d.plan(h) for r, h in heads.items()}
