"""The report of a Job (`meshplan plan`): what the ranks will be asked to do.

Invariants:
- Computed from the Job alone (plus lowering one rank per stage for the
  planned memory), so it says exactly what the ranks will run.
- `JobReport` is typed (communication counted by `CommKey`); `to_json` is
  the one place its JSON form (`plan --json`) is spelled.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, fields

from meshplan.ir import Phase, Role
from meshplan.ir.choices import KernelVariant
from meshplan.ir.job import Job
from meshplan.ir.kinds import ALL_REDUCE, ALL_TO_ALL, CLIP_COEF, ROUTED_EXPERTS, short
from meshplan.ir.sbp import fmt
from meshplan.ir.zero import ZeroLevel
from meshplan.lowering.lower import lower
from meshplan.ops.routed_experts import ROUTED
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for
from meshplan.passes.expert_parallel import expert_weights


def comm_ops(job: Job) -> list[dict]:
    """Every communication op: kind, axis, phase, stage, bytes per micro-batch."""
    out = []
    for op in job.graph.ops:
        if not rule_for(op.kind).category.communicates:
            continue
        kw = dict(op.kwargs)
        src = op.args[0].id
        out.append({
            "op": op.id, "kind": short(op.kind),
            "axis": job.strategy.axes[kw["axis"]] if "axis" in kw else "pp",
            "phase": op.phase.value, "stage": job.stage[op.id], "chunk": job.chunk[op.id],
            "module": op.module_path, "bytes": job.graph.values[src].meta.nbytes,
            "from": fmt(job.sbp[src]), "to": fmt(job.sbp[op.outputs[0]]),
        })
    return out


@dataclass(frozen=True, slots=True, order=True)
class CommKey:
    """What a communication op does: its kind, grid axis (or pp) and phase."""

    kind: str
    axis: str
    phase: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.axis}/{self.phase}"


@dataclass(frozen=True)
class JobReport:
    """The Job summary `meshplan plan` prints: stages and chunks,
    communication, totals per step, planned memory, the optimizer step."""

    world: int
    nodes: int
    devices_per_node: int
    dp: int
    tp: int
    pp: int
    vpp: int
    schedule: str
    precision: str
    recompute: str
    num_microbatches: int
    ops: int
    job_digest: str
    chunks: list[dict]          # {stage, chunk, layers, ops, param_bytes}
    comm: list[dict]            # `comm_ops`
    comm_counts: dict[CommKey, int]
    comm_ops_per_step: int
    comm_bytes_per_step: int
    layer_pattern: str
    tp_plan: list[list[str]]
    zero: ZeroLevel
    memory: list[dict]          # `stage_memory`
    shared: dict[str, list[int]]
    optimizer: dict             # `optimizer_summary`
    notes: list[str]
    ep: int = 1
    experts: dict | None = None  # `expert_summary`, for a mixture of experts

    def to_json(self) -> dict:
        """The report as `plan --json` prints it (the one place it is spelled)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("comm_counts", "comm_ops_per_step", "comm_bytes_per_step")}
        out["comm_counts"] = {str(k): n for k, n in self.comm_counts.items()}
        out["totals_per_step"] = {"comm_ops": self.comm_ops_per_step,
                                  "comm_bytes": self.comm_bytes_per_step}
        return out


def report(job: Job) -> JobReport:
    """The Job summary, computed from the Job alone."""
    g = job.graph
    m = job.strategy.num_microbatches
    chunks: dict = defaultdict(lambda: {"layers": [], "ops": 0, "param_bytes": 0})
    for name, st, c in zip(job.layers, job.layer_stage, job.layer_chunk):
        chunks[(st, c)]["layers"].append(name)
    consumers: dict[int, int] = {}
    for op in g.ops:
        chunks[(job.stage[op.id], job.chunk[op.id])]["ops"] += 1
        for r in op.refs():
            consumers.setdefault(r, op.id)
    for p in g.inputs_by_role(Role.PARAM):
        if p.id in consumers:
            i = consumers[p.id]
            chunks[(job.stage[i], job.chunk[i])]["param_bytes"] += p.meta.nbytes
    comms = comm_ops(job)
    once = Phase.OPTIMIZER.value  # the step's communication runs once, the rest per micro-batch
    s = job.strategy
    return JobReport(
        job.mesh.world, job.mesh.nodes, job.mesh.devices_per_node, s.dp, s.tp, s.pp, s.vpp,
        s.schedule, s.precision, s.recompute, m, len(g.ops), job.digest(),
        [{"stage": k[0], "chunk": k[1], **v} for k, v in sorted(chunks.items())], comms,
        dict(Counter(CommKey(c["kind"], c["axis"], c["phase"]) for c in comms)),
        sum(1 if c["phase"] == once else m for c in comms),
        sum(c["bytes"] * (1 if c["phase"] == once else m) for c in comms),
        s.layer_pattern, [list(x) for x in s.tp_plan], s.zero, stage_memory(job),
        shared_params(job), optimizer_summary(job), list(job.notes), s.ep,
        expert_summary(job, comms))


def expert_summary(job: Job, comms: list[dict]) -> dict | None:
    """A mixture of experts' split: experts per block and per rank, and the
    all-to-alls' logical bytes per step (None: the model has no experts)."""
    weights = expert_weights(job.graph)
    if not weights:
        return None
    experts, ep = weights[0].meta.shape[0], job.strategy.ep
    m = job.strategy.num_microbatches
    a2a = [c for c in comms if c["kind"] == short(ALL_TO_ALL)]
    dispatched = max((c["bytes"] for c in a2a if c["phase"] == Phase.FORWARD.value), default=0)
    routed_ops, routed_bytes, worst = _routed(job)
    return {"experts": experts, "per_rank": experts // ep, "ep": ep,
            "expert_weights": len(weights), "all_to_all_ops_per_step": (len(a2a) + routed_ops) * m,
            "all_to_all_bytes_per_step": (sum(c["bytes"] for c in a2a) + routed_bytes) * m,
            # the largest dispatched buffer, one rank's share (split over dp, ep among it)
            "dispatch_bytes_per_rank": dispatched // job.strategy.dp,
            # routed experts' arriving rows at their worst case, one rank's
            "routed_worst_bytes_per_rank": worst}


def _routed(job: Job) -> tuple[int, int, int]:
    """Routed experts over ep (`runtime/expert_dispatch.py`), per
    micro-batch: the all-to-alls inside their kernels (a forward's three:
    the counts, the rows there and back; a backward's five: the counts, the
    rows with their gradients, the gates, the rows' and the gates'
    gradients back), their rows' logical bytes (the counts' left out), and
    the largest rows a rank may receive in one: every row of its ep line
    at its experts (dropless: no capacity bounds it)."""
    ops = nbytes = worst = 0
    s = job.strategy
    for op in job.graph.ops:
        if op.kind not in ROUTED or KernelVariant.EXPERTS not in job.variant[op.id]:
            continue
        x, idx = (job.graph.values[a.id].meta for a in op.args[:2])
        row, rows = x.shape[-1] * x.dtype.itemsize, idx.numel
        backward = op.kind != ROUTED_EXPERTS
        ops += 5 if backward else 3
        nbytes += rows * ((3 * row + 8) if backward else 2 * row)
        worst = max(worst, rows // s.dp * s.ep * row * (2 if backward else 1))
    return ops, nbytes, worst


def optimizer_summary(job: Job) -> dict:
    """The optimizer step: its kind, clipping threshold, learning-rate schedule,
    and how many parameters (and elements) take weight decay and how many not."""
    g = job.graph
    producer = {o: op for op in g.ops for o in op.outputs if o >= 0}
    groups: dict[str, dict[str, int]] = {"decay": {"params": 0, "elements": 0},
                                         "no_decay": {"params": 0, "elements": 0}}
    seen, kind, clip = set(), None, None
    for op in g.ops:
        if op.kind == CLIP_COEF:
            clip = dict(op.kwargs)["max_norm"]
        if rule_for(op.kind).category is not Category.OPTIMIZER:
            continue
        kind = op.kind
        vid = op.args[0].id
        while vid in producer and rule_for(producer[vid].kind).category.boxing:
            vid = producer[vid].args[0].id  # a shard of the parameter: the parameter
        v = g.values[vid]
        if v.name in seen:
            continue  # a tied weight's other copy
        seen.add(v.name)
        group = groups["decay" if dict(op.kwargs)["weight_decay"] else "no_decay"]
        group["params"] += 1
        group["elements"] += v.meta.numel
    lr = g.facts.train and g.facts.train.lr_schedule
    return {"kind": kind and kind.removeprefix("meshplan."), "max_grad_norm": clip,
            "lr_schedule": json.loads(lr[0].to_meta(lr[1])) if lr else None,
            "weight_decay_groups": groups}


def stage_memory(job: Job) -> list[dict]:
    """The planned peak bytes by category of each stage's first rank (the
    stage's ranks differ at most by uneven shards), lowered here; none for a
    layout with other chunk counts than vpp (a user layout kept by runs:
    reported, not schedulable)."""
    if max(job.chunk, default=0) + 1 != job.strategy.vpp:
        return []
    out = []
    for stage in range(job.strategy.pp):
        rank = job.strategy.ranks_of_stage(stage)[0]
        out.append({"stage": stage, "rank": rank, **dict(lower(job, rank).memory.peak)})
    return out


def shared_params(job: Job) -> dict[str, list[int]]:
    """Parameters with a copy on several stages, and those stages."""
    out = {}
    for op in job.graph.ops:
        kw = dict(op.kwargs)
        if op.kind == ALL_REDUCE and "stages" in kw:
            out[kw["param"]] = list(kw["stages"])
    return out
