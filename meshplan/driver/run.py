"""run: the master once, then one process per rank, each lowering and
running its own plan; results merged.

Invariant: the losses reported are the last pipeline stage's (every rank
there holds the replicated loss), the mean over the global batch per step.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from meshplan.driver.plan import plan_model
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.runtime.launch import launch_local
from meshplan.runtime.worker import RunSpec


def run(model: str, size: str, mesh: Mesh, strategy: Strategy, steps: int = 10,
        optimizer: str = "sgd", seed: int = 0, threads: int = 1, timeout_s: float = 60.0,
        plan_dir: str = "", kill: tuple[int, float] | None = None, **overrides) -> dict:
    """Train on `mesh.world` local processes; returns losses, step times, memory."""
    t0 = time.perf_counter()
    planned = plan_model(model, size, mesh, strategy, optimizer, **overrides)
    job = planned.job
    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as results:
        spec = RunSpec(model, size, tuple(sorted(overrides.items())), steps, seed, results,
                       threads, timeout_s, plan_dir=plan_dir)
        per_rank = launch_local(spec, mesh.world, job.to_bytes(),
                                deadline_s=60 + steps * 60, kill=kill)
    return merge(per_rank, job, time.perf_counter() - t0)


def merge(per_rank: dict[int, dict], job, wall_s: float) -> dict:
    holders = [r for r, v in sorted(per_rank.items()) if v["losses"]]
    losses = per_rank[holders[0]]["losses"] if holders else []
    steps = [max(v["step_s"][i] for v in per_rank.values())
             for i in range(len(next(iter(per_rank.values()))["step_s"]))]
    return {
        "losses": losses, "step_s": steps,
        "median_step_s": statistics.median(steps) if steps else None,
        "ranks": {str(r): {"planned_peak_bytes": v["planned_peak_bytes"],
                           "measured_peak_bytes": v["measured_peak_bytes"],
                           "planned_peak": v["planned_peak"]}
                  for r, v in sorted(per_rank.items())},
        "job_digest": job.digest(), "wall_s": wall_s,
    }
