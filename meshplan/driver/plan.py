"""plan: a zoo model and a strategy -> the Job (its report:
`driver/job_report.py`).

Invariant: a zoo model is captured on the meta device (no weights), cached
by config and shape; one whose constants need values is captured again
with weights (`ConstantOnMeta`).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from meshplan.autodiff import OptimizerConfig
from meshplan.capture import cached, capture, capture_key
from meshplan.capture.export import ConstantOnMeta
from meshplan.ir.choices import Precision
from meshplan.ir.gc_pause import paused_gc
from meshplan.ir.job import Job
from meshplan.ir.mesh import DERIVED, Mesh, Strategy
from meshplan.models import build_model, example_batch, layer_pattern, model_config
from meshplan.models.hf import PREFIX as HF
from meshplan.models.hf import attention_of, saved_config
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


def capture_zoo(cfg, batch_size: int, precision: Precision | str = Precision.FP32,
                use_cache: bool = True):
    """The forward Graph of a zoo model for one micro-batch of `batch_size`,
    captured for `precision` on the meta device (no weights) and cached by
    config, shape and precision."""
    precision = Precision(precision)
    key = capture_key(config=cfg, batch_size=batch_size, kind="zoo", precision=precision,
                      saved=saved_config(cfg.source) if cfg.source else None)

    return cached(key, lambda: capture_built(cfg, batch_size, precision=precision),
                  enabled=use_cache)[0]


def capture_built(cfg, batch_size: int, on_meta=None,
                  precision: Precision | str = Precision.FP32):
    """`cfg`'s model (`on_meta`, built there if None) captured for
    `precision` on the meta device; with weights (on the CPU) where its
    forward makes a tensor constant whose value meta cannot know."""
    try:
        return capture(on_meta or build_model(cfg, device="meta"),
                       example_batch(cfg, batch_size, device="meta"), precision=precision)
    except ConstantOnMeta:
        return capture(build_model(cfg), example_batch(cfg, batch_size), precision=precision)


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
    forward = capture_zoo(cfg, strategy.micro_batch_size * strategy.dp, strategy.precision)
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
