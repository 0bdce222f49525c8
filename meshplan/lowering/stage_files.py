"""Plan files of the ranks of one stage, each rank class lowered once.

`StageFiles(view, device).plan_bytes(rank)` equals
`plan_to_bytes(lower(view, rank, device))` byte for byte (tested rank by
rank), but ranks with the same `RankClasses` key (data-parallel ranks of a
stage, most often) share one lowering and one encoded body: a rank after
the first of its class costs a head and a hash, not a lowering.
"""

from __future__ import annotations

import time
from dataclasses import replace

from meshplan.ir.job import StageView
from meshplan.lowering.files import own_task_base, plan_body, plan_head, seal_plan
from meshplan.lowering.ids import DEVICE_TYPES, task_id
from meshplan.lowering.lower import RankClasses, lower
from meshplan.lowering.rankplan import RankPlan


class StageFiles:
    def __init__(self, view: StageView, device: str = "cpu"):
        self.view, self.device = view, device
        self.classes = RankClasses(view)
        self.bodies: dict[tuple, tuple[bytes, RankPlan, bool]] = {}
        self.seconds: dict[str, float] = {}  # of the last plan_bytes: lower, serialize

    def plan_bytes(self, rank: int) -> tuple[bytes, RankPlan, bool]:
        """The plan file of `rank`; the plan of its class's first rank (same
        tasks, buffers and memory up to ids); whether `rank` was lowered."""
        t0 = time.perf_counter()
        key = self.classes.key(rank)
        shared = self.bodies.get(key)
        if shared is None:
            plan = lower(self.view, rank, self.device)
            t1 = time.perf_counter()
            base = own_task_base(plan)
            self.bodies[key] = (plan_body(plan, base), plan, bool(plan.tasks))
            data = seal_plan(plan_head(plan, base), self.bodies[key][0])
            self.seconds = {"lower": t1 - t0, "serialize": time.perf_counter() - t1}
            return data, plan, True
        body, plan, has_tasks = shared
        dpn = self.view.mesh.devices_per_node
        base = task_id(rank, dpn, 0, 0, DEVICE_TYPES[self.device]) if has_tasks else 0
        coord = self.view.strategy.placement(self.view.stage).coord(rank)
        data = seal_plan(plan_head(replace(plan, rank=rank, coord=coord), base), body)
        self.seconds = {"lower": 0.0, "serialize": time.perf_counter() - t0}
        return data, plan, False
