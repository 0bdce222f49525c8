"""Where a rank's plan comes from: lowered from the Job in the rank's own
process (the rank-per-process compile), or read from a compiled plan
directory.

Invariants:
- `rank_plan` is the one place in `runtime/` that calls `lower`
  (tests/test_layering.py); the rest of the runtime executes a `RankPlan`
  and imports from `lowering/` only the plan's types (`rankplan`) and the
  file reader (`files`). Everything a rank runs is in its plan: tasks,
  actions, memory, buckets, their run order and ZeRO-3's gathers.
- A plan read from a directory must be of this Job (its digest): else one
  `PlanError` line.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.errors import PlanError
from meshplan.ir.job import Job, StageView, stage_view
from meshplan.lowering.files import read_plan
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import RankPlan


def rank_plan(job: Job | StageView, rank: int, device_type: str = "cpu",
              plan_dir: str = "") -> RankPlan:
    """Rank `rank`'s plan of `job` (the whole Job, or the view of the rank's
    stage) for `device_type`: read from `plan_dir` (compiled by `meshplan
    compile`) when given, else lowered here."""
    view = stage_view(job, job.strategy.stage_of_rank(rank))
    if not plan_dir:
        return lower(view, rank, device_type)
    plan = read_plan(Path(plan_dir), rank, view.strategy, view.mesh.devices_per_node)
    if plan.job_digest != view.digest:
        raise PlanError(f"{plan_dir} holds plans of another Job; recompile it")
    return plan
