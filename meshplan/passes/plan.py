"""plan: the planning passes, in order, from a train-step Graph to a Job.

    check_strategy -> resolve_auto ("auto" plans) -> expand_batch_norm (dp > 1)
        -> expand_log_softmax (vocab tp) -> assign_stages
        -> share_params (a parameter read on several stages)
        -> tensor_parallel -> propagate_sbp -> add_boxing -> recompute
        -> kernel_temps -> Job

Each step is a pure function of immutable data; `plan_job` only wires them.
`timings` (seconds per pass) is filled when given, for the compile report.
"""

from __future__ import annotations

import time
from dataclasses import replace

from meshplan.errors import ConfigError
from meshplan.ir import Graph, verify
from meshplan.ir.choices import Recompute, TpStyle
from meshplan.ir.job import Job, verify_job
from meshplan.ir.mesh import AXES, Mesh, Strategy
from meshplan.passes.auto_plan import resolve_auto
from meshplan.passes.batch_norm import expand_batch_norm
from meshplan.passes.boxing import add_boxing
from meshplan.passes.log_softmax import expand_log_softmax
from meshplan.passes.pipeline import StageAssignment, assign_stages
from meshplan.passes.propagate import propagate_sbp
from meshplan.passes.recompute import recompute
from meshplan.passes.shared import param_readers, share_params
from meshplan.passes.strategy import check_strategy
from meshplan.passes.temps import kernel_temps
from meshplan.passes.tp_plan import tensor_parallel

TP_AXIS = AXES.index("tp")


def plan_job(graph: Graph, mesh: Mesh, strategy: Strategy, checks: bool = False,
             timings: dict | None = None) -> Job:
    """Place, lay out, box and stage `graph` (a train step) for `strategy` on `mesh`."""
    timings = {} if timings is None else timings
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        timings[name] = now - t
        t = now

    strategy = check_strategy(mesh, strategy)
    strategy, auto_notes = resolve_auto(graph, strategy)
    if strategy.dp > 1:  # batch statistics must become sums the dp ranks reduce
        graph = expand_batch_norm(graph)
    assert not isinstance(strategy.tp_plan, str), "resolve_auto replaced 'auto'"
    if strategy.tp > 1 and any(style == TpStyle.VOCAB for _, style in strategy.tp_plan):
        graph = expand_log_softmax(graph)  # the class reductions become Partials
    if strategy.pp == strategy.vpp == 1 and not strategy.layer_pattern:
        stages = StageAssignment((0,) * len(graph.ops), (0,) * len(graph.ops), (), (), (), ())
    else:
        stages = assign_stages(graph, strategy.pp, strategy.vpp, strategy.layer_pattern,
                               strategy.layer_stages)
    places = list(zip(stages.stage, stages.chunk))
    shared = share_params(graph, places, param_readers(graph, places))
    if shared.copies:
        graph = shared.graph
        stages = replace(stages, stage=tuple(p[0] for p in shared.places),
                         chunk=tuple(p[1] for p in shared.places))
    lap("assign_stages")
    param_tp, hints = tensor_parallel(graph, strategy.tp_plan, TP_AXIS)
    lap("tensor_parallel")
    sbp = propagate_sbp(graph, stages.stage, strategy.grid, param_tp, hints, TP_AXIS)
    lap("propagate_sbp")
    boxed = add_boxing(graph, sbp, stages.stage, stages.chunk, len(strategy.grid),
                       shared.copies)
    lap("add_boxing")
    if strategy.recompute != Recompute.NONE:
        pattern = strategy.recompute_pattern or strategy.layer_pattern
        if not pattern:
            raise ConfigError("--recompute needs regions: give --recompute-pattern (or "
                              "--layer-pattern), a regex over module paths like 'blocks\\.\\d+'")
        boxed = recompute(boxed, strategy.recompute, pattern)
        lap("recompute")
    temps = kernel_temps(boxed.graph, boxed.stage, boxed.sbp, strategy)
    lap("kernel_temps")
    job = Job(
        graph=boxed.graph, mesh=mesh, strategy=strategy, stage=boxed.stage,
        chunk=boxed.chunk, sbp=boxed.sbp, local=boxed.local, layers=stages.layers,
        layer_stage=stages.layer_stage, layer_chunk=stages.layer_chunk,
        notes=auto_notes + stages.notes, temps=temps,
    )
    if checks:
        verify(job.graph)
        verify_job(job)
    return job
