"""The Job: the logical train step, placed, laid out, boxed and staged.

Invariants:
- Per op: `stage[i]`, `chunk[i]` and `local[i]` (the rank-dependent kernel
  variant per mesh axis, "" if none). Per value: `sbp[v]`, its layout on
  the (dp, tp) grid of the stage that produces it.
- Every op's inputs are on its own stage in the layout it needs: the only
  cross-stage edges are `meshplan.transfer` ops.
- The Job is deterministic: the same inputs give byte-identical `to_bytes`
  and the same `digest`, in any process.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass

from meshplan.errors import PlanError
from meshplan.ir.fileio import seal, unseal
from meshplan.ir.graph import Graph
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.ir.sbp import NdSbp, Partial, Replicate, Shard
from meshplan.ir.serialize import graph_from_json, graph_to_json

KIND = "meshplan.job"
VERSION = 1


@dataclass(frozen=True, slots=True)
class Job:
    graph: Graph
    mesh: Mesh
    strategy: Strategy
    stage: tuple[int, ...]
    chunk: tuple[int, ...]
    sbp: tuple[NdSbp, ...]
    local: tuple[tuple[str, ...], ...]
    layers: tuple[str, ...] = ()
    layer_stage: tuple[int, ...] = ()
    layer_chunk: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return seal(KIND, VERSION, job_to_json(self))

    def digest(self) -> str:
        """sha256 of the serialized Job: the cache key of every rank's plan."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @staticmethod
    def from_bytes(data: bytes, where: str = "<bytes>") -> Job:
        return job_from_json(unseal(data, KIND, VERSION, where), where)


_TOKEN = re.compile(r"S\((\d+)\)|P\((\w+)\)|P|R")


def parse_sbp(text: str) -> NdSbp:
    """`S(0)R` -> (Shard(0), Replicate()); the inverse of `sbp.fmt`."""
    out = []
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            out.append(Shard(int(m.group(1))))
        elif m.group(2) is not None:
            out.append(Partial(m.group(2)))
        elif m.group(0) == "P":
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def _fmt(sbp: NdSbp) -> str:
    return "".join(str(s) for s in sbp)


def job_to_json(job: Job) -> dict:
    strategy = asdict(job.strategy)
    return {
        "graph": graph_to_json(job.graph), "mesh": asdict(job.mesh), "strategy": strategy,
        "stage": list(job.stage), "chunk": list(job.chunk),
        "sbp": [_fmt(s) for s in job.sbp], "local": [list(x) for x in job.local],
        "layers": list(job.layers), "layer_stage": list(job.layer_stage),
        "layer_chunk": list(job.layer_chunk), "notes": list(job.notes),
    }


def _tuples(x):
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


def job_from_json(d: dict, where: str = "<json>") -> Job:
    try:
        strategy = Strategy(**{k: _tuples(v) for k, v in d["strategy"].items()})
        return Job(
            graph=graph_from_json(d["graph"], where), mesh=Mesh(**d["mesh"]),
            strategy=strategy, stage=tuple(d["stage"]), chunk=tuple(d["chunk"]),
            sbp=tuple(parse_sbp(s) for s in d["sbp"]),
            local=tuple(tuple(x) for x in d["local"]), layers=tuple(d["layers"]),
            layer_stage=tuple(d["layer_stage"]), layer_chunk=tuple(d["layer_chunk"]),
            notes=tuple(d["notes"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where} holds a malformed {KIND} v{VERSION} body "
                        f"({type(e).__name__}: {str(e)[:80]}); recompile it") from None


def verify_job(job: Job) -> None:
    """Assert the Job's placement invariants (internal errors only): every op
    reads values made on its own stage (or graph inputs), except a transfer,
    which reads on its source stage; annotations cover every op and value."""
    g = job.graph
    assert len(job.stage) == len(job.chunk) == len(job.local) == len(g.ops)
    assert len(job.sbp) == len(g.values)
    made_on: dict[int, int] = {}
    for op in g.ops:
        here = job.stage[op.id]
        if op.kind == "meshplan.transfer":
            here = dict(op.kwargs)["src_stage"]
        for r in op.refs():
            src = made_on.get(r, here)
            assert src == here, (
                f"op {op.id} {op.kind} ({op.module_path}) on stage {here} reads value {r} "
                f"made on stage {src}")
        for o in op.outputs:
            if o >= 0:
                made_on[o] = job.stage[op.id]
