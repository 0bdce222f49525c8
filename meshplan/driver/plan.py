"""plan: a zoo model and a strategy -> the Job, and its report.

Invariant: the report is computed from the Job alone (plus the micro-batch
count), so it says exactly what the ranks will be asked to do.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from meshplan.autodiff import OptimizerConfig
from meshplan.capture import cached, capture, capture_key
from meshplan.capture.export import ConstantOnMeta
from meshplan.ir import Phase, Role
from meshplan.ir.gc_pause import paused_gc
from meshplan.ir.job import Job
from meshplan.ir.kinds import ALL_REDUCE, CLIP_COEF, short
from meshplan.ir.mesh import AXES, DERIVED, Mesh, Strategy
from meshplan.ir.sbp import fmt
from meshplan.lowering.lower import lower
from meshplan.models import build_model, example_batch, layer_pattern, model_config
from meshplan.models.hf import PREFIX as HF
from meshplan.models.hf import attention_of, saved_config
from meshplan.ops.rule import Category
from meshplan.ops.table import rule_for
from meshplan.passes.plan import PASSES, Compilation
from meshplan.passes.strategy import MEGATRON_PLAN, check_heads, check_strategy

log = logging.getLogger("meshplan")


@dataclass(frozen=True, slots=True)
class Planned:
    job: Job
    capture_s: float
    timings: dict


def zoo_strategy(model: str, cfg, **fields) -> Strategy:
    """A Strategy with the zoo's defaults: its layer pattern, the Megatron plan."""
    fields.setdefault("layer_pattern", layer_pattern(cfg) or DERIVED)
    if fields.get("tp", 1) > 1 and model in ("gpt", "bert"):
        fields.setdefault("tp_plan", MEGATRON_PLAN)
    elif fields.get("tp", 1) > 1 and model.startswith(HF):
        fields.setdefault("tp_plan", DERIVED)
    return Strategy(**fields)


def capture_zoo(cfg, batch_size: int, use_cache: bool = True):
    """The forward Graph of a zoo model for one micro-batch of `batch_size`,
    captured on the meta device (no weights) and cached by config and shape."""
    key = capture_key(config=cfg, batch_size=batch_size, kind="zoo",
                      saved=saved_config(cfg.source) if cfg.source else None)

    return cached(key, lambda: capture_built(cfg, batch_size), enabled=use_cache)[0]


def capture_built(cfg, batch_size: int, on_meta=None):
    """`cfg`'s model (`on_meta`, built there if None) captured on the meta
    device; with weights (on the CPU) where its forward makes a tensor
    constant whose value meta cannot know."""
    try:
        return capture(on_meta or build_model(cfg, device="meta"),
                       example_batch(cfg, batch_size, device="meta"))
    except ConstantOnMeta:
        return capture(build_model(cfg), example_batch(cfg, batch_size))


def plan_model(model: str, size: str, mesh: Mesh, strategy: Strategy,
               optimizer: str | OptimizerConfig = "sgd", lr: float | None = None,
               encode: bool = True,
               **overrides) -> Planned:
    """Capture a zoo model (on the meta device: no weights; cached) and plan
    it; `encode=False` skips the Job's bytes (for a Job no rank receives)."""
    cfg = model_config(model, size, **overrides)
    strategy = check_strategy(mesh, strategy)
    if not model.startswith(HF):  # an auto plan checks the heads it splits
        check_heads(cfg.heads, strategy.tp, model)
    t0 = time.perf_counter()
    forward = capture_zoo(cfg, strategy.micro_batch_size * strategy.dp)
    t1 = time.perf_counter()
    timings: dict = {}  # seconds per pass (the pass manager's), then the Job's bytes
    with paused_gc():  # the master: see ir/gc_pause.py
        job = PASSES.run(Compilation(forward, mesh, strategy,
                                     OptimizerConfig.of(optimizer, lr), notes=_notes(cfg)),
                         timings=timings).job
        t2 = time.perf_counter()
        if encode:
            job.to_bytes()  # what the ranks receive; its digest comes with it (hashed once)
        timings["job_bytes"] = time.perf_counter() - t2
    # The collection the pause deferred, paid and counted here rather than at
    # a random later allocation: the young generations only (what the master
    # made), not the process's old objects (torch's import alone is ~1M).
    t3 = time.perf_counter()
    del forward
    gc.collect(1)
    timings["collect"] = time.perf_counter() - t3
    log.info("%s %s: captured in %.2f s, planned in %.2f s (%d ops in the Job)", model, size,
             t1 - t0, sum(timings.values()), len(job.graph.ops))
    return Planned(job, t1 - t0, timings)


def _notes(cfg) -> tuple[str, ...]:
    """What the Job should say of how its model was built: a transformers
    model's attention implementation."""
    if not cfg.model.startswith(HF):
        return ()

    if attention_of(cfg) == "sdpa":
        return ("attention: transformers' sdpa implementation (one fused op)",)
    return (f"attention: transformers' eager implementation (matmul, softmax, matmul): "
            f"{cfg.model} has no SDPA kernel",)


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
            "axis": AXES[kw["axis"]] if "axis" in kw else "pp",
            "phase": op.phase.value, "stage": job.stage[op.id], "chunk": job.chunk[op.id],
            "module": op.module_path, "bytes": job.graph.values[src].meta.nbytes,
            "from": fmt(job.sbp[src]), "to": fmt(job.sbp[op.outputs[0]]),
        })
    return out


def report(job: Job) -> dict:
    """The Job summary: stages and chunks, communication, totals per step."""
    g = job.graph
    m = job.strategy.num_microbatches
    chunks: dict = defaultdict(lambda: {"layers": [], "ops": 0, "param_bytes": 0})
    for name, s, c in zip(job.layers, job.layer_stage, job.layer_chunk):
        chunks[(s, c)]["layers"].append(name)
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
    per_step = sum(c["bytes"] * (1 if c["phase"] == Phase.OPTIMIZER.value else m) for c in comms)
    s = job.strategy
    return {
        "world": job.mesh.world, "nodes": job.mesh.nodes,
        "devices_per_node": job.mesh.devices_per_node,
        "dp": s.dp, "tp": s.tp, "pp": s.pp, "vpp": s.vpp, "schedule": s.schedule,
        "precision": s.precision, "recompute": s.recompute,
        "num_microbatches": m, "ops": len(g.ops), "job_digest": job.digest(),
        "chunks": [{"stage": k[0], "chunk": k[1], **v} for k, v in sorted(chunks.items())],
        "comm": comms,
        "comm_counts": dict(Counter(f"{c['kind']}/{c['axis']}/{c['phase']}" for c in comms)),
        "totals_per_step": {"comm_ops": sum(1 if c["phase"] == "optimizer" else m
                                            for c in comms),
                            "comm_bytes": per_step},
        "layer_pattern": s.layer_pattern, "tp_plan": [list(x) for x in s.tp_plan],
        "zero": s.zero, "memory": stage_memory(job),
        "shared": shared_params(job),
        "optimizer": optimizer_summary(job),
        "notes": list(job.notes),
    }


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
