"""A candidate evaluated the long way: the whole model planned under its
strategy, one rank per pipeline stage lowered, its Work read off those
plans, its memory taken from their memory layouts, and the same pricing and
simulation as the search (`estimate.price`).

It is the search's proof (its winner is the fastest candidate whose full
plan fits), and what the search's shortcuts (probes of one layer,
estimated memory, pruning) are held to: on a space small enough to plan
every candidate, the fastest full plan that fits is the search's winner.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import ConfigError, ScheduleError
from meshplan.lowering.lower import lower
from meshplan.schedules import stage_placement
from meshplan.search.estimate import Prediction, Setting, price
from meshplan.search.probe import Spec
from meshplan.search.space import Candidate
from meshplan.search.work import read_work


def evaluate(spec: Spec, cand: Candidate, st: Setting,
             stage_layers: tuple[int, ...] = ()) -> Prediction:
    """Plan, lower and price `cand` in full; raises the planner's ConfigError."""
    got = fits(spec, cand, st, stage_layers, None)
    assert isinstance(got, Prediction)
    return got


def fits(spec: Spec, cand: Candidate, st: Setting, stage_layers: tuple[int, ...],
         limit: int | None, first: tuple[int, ...] = ()) -> Prediction | int:
    """`evaluate`, or, as soon as one stage's planned peak is over `limit`,
    that peak (the stages in `first` lowered first: the likeliest to be
    over, so that a candidate that does not fit costs its plan and one
    stage's lowering)."""
    strategy = spec.strategy(dp=cand.dp, tp=cand.tp, pp=cand.pp, vpp=cand.vpp,
                             schedule=cand.schedule, global_batch_size=st.global_batch,
                             micro_batch_size=cand.micro_batch_size, recompute=cand.recompute,
                             zero=cand.zero, ep=cand.ep, cp=cand.cp, sequence_parallel=cand.sp,
                             bucket_mb=st.bucket_mb,
                             stage_layers=stage_layers if cand.pp > 1 else ())
    try:
        job = spec.plan(st.mesh, strategy)
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
    works, peaks = {}, {}
    for stage in dict.fromkeys((*first, *range(cand.pp))):
        plan = lower(job, strategy.ranks_of_stage(stage)[0])
        got = read_work(job, plan, st.dev)
        works.update(got.by_stage)
        peaks[stage] = dict(got.peak)["total"]
        if limit is not None and peaks[stage] > limit:
            return peaks[stage]
    counts = _layers_per_stage(job, strategy)
    return price(cand, [replace(works[v], layers=counts[v]) for v in range(len(works))], st,
                 counts, tuple(peaks[r] for r in range(cand.pp))).predict()


def _layers_per_stage(job, strategy) -> tuple[int, ...]:
    where = stage_placement(strategy)
    counts = [0] * where.num_stages
    for s, c in zip(job.layer_stage, job.layer_chunk):
        counts[where.stage_at(s, c)] += 1
    return tuple(counts)
