"""run: the master once, then one process per rank, each lowering and
running its own plan; results merged.

Invariant: the losses reported are the last pipeline stage's (every rank
there holds the replicated loss), the mean over the global batch per step.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from meshplan.driver.plan import plan_model
from meshplan.errors import RuntimeFault
from meshplan.ir.fileio import write_atomic
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.runtime.launch import launch_local
from meshplan.runtime.worker import RunSpec, rank_main
from meshplan.schedules.trace import Span, bubble, chrome_events

log = logging.getLogger("meshplan")


def run(model: str, size: str, mesh: Mesh, strategy: Strategy, steps: int = 10,
        optimizer: str = "sgd", seed: int = 0, threads: int = 1, timeout_s: float = 60.0,
        plan_dir: str = "", kill: tuple[int, float] | None = None, save_dir: str = "",
        resume: bool = False, lr: float | None = None, trace: str = "", on_step=None,
        **overrides) -> dict:
    """Train on `mesh.world` local processes; returns losses, step times, memory.

    With `trace` (a path), the last step is timed on every rank and written
    there as one Chrome/Perfetto trace; the result's "trace" holds its
    measured bubble ratio. `on_step(k)` is called as the ranks finish step k."""
    t0 = time.perf_counter()
    if plan_dir:  # compiled plans: validated whole before any process starts
        from meshplan.plan.files import read_dir

        job, _ = read_dir(Path(plan_dir))
        if job.mesh.world != mesh.world:
            raise RuntimeFault(f"{plan_dir} holds plans for {job.mesh.world} ranks but "
                               f"{mesh.world} were asked for; recompile or match the mesh")
    else:
        job = plan_model(model, size, mesh, strategy, optimizer, lr, **overrides).job
    spec = RunSpec(model, size, tuple(sorted(overrides.items())), steps, seed, "", threads,
                   timeout_s, plan_dir=plan_dir, save_dir=save_dir, resume=resume,
                   trace=bool(trace))
    return launch(job, spec, t0, trace, kill=kill, on_step=on_step)


def launch(job, spec: RunSpec, t0: float, trace: str = "", saved=None, kill=None,
           on_step=None) -> dict:
    """Run `spec` on `job.mesh.world` local processes (results in a temporary
    folder; `saved`, if given, is torch-saved there as the ranks' `module_file`)
    and merge what they report."""
    import torch

    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as results:
        module_file = ""
        if saved is not None:
            module_file = str(Path(results) / "module.pt")
            torch.save(saved, module_file)
        spec = replace(spec, results=results, module_file=module_file)
        log.info("starting %d rank processes for %d steps (plans: %s)", job.mesh.world,
                 spec.steps, spec.plan_dir or "each rank lowers its own")
        per_rank = launch_local(spec, job.mesh.world, job.to_bytes(),
                                deadline_s=60 + spec.steps * 60, kill=kill, on_step=on_step)
    return merge(per_rank, job, time.perf_counter() - t0, trace)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "RANK" in os.environ)


def run_torchrun(model: str, size: str, mesh: Mesh, strategy: Strategy, steps: int = 10,
                 optimizer: str = "sgd", seed: int = 0, threads: int = 1,
                 timeout_s: float = 60.0, lr: float | None = None, trace: str = "",
                 **overrides) -> dict | None:
    """This process is one torchrun rank: rank 0 plans and broadcasts the Job,
    every rank lowers and runs itself. Returns the merged result on rank 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != mesh.world:
        raise RuntimeFault(f"torchrun started {world} ranks but the strategy needs "
                           f"{mesh.nodes}x{mesh.devices_per_node} = {mesh.world}; match "
                           "--nnodes/--nproc-per-node to --nodes/--devices-per-node")
    t0 = time.perf_counter()

    def master() -> bytes:
        return plan_model(model, size, mesh, strategy, optimizer, lr,
                          **overrides).job.to_bytes()

    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as results:
        spec = RunSpec(model, size, tuple(sorted(overrides.items())), steps, seed, results,
                       threads, timeout_s, gather=True, trace=bool(trace))
        code = rank_main(spec, rank, world, None, "env://", master=master)
        if code != 0:
            fail = json.loads((Path(results) / f"fail_{rank}.json").read_text())
            raise RuntimeFault(f"rank {rank} failed in action {fail['action']}: "
                               f"{fail['error']}")
        if rank != 0:
            return None
        per_rank = {d["rank"]: d for d in json.loads(
            (Path(results) / "all_ranks.json").read_text())}
    return merge(per_rank, None, time.perf_counter() - t0, trace)


def merge(per_rank: dict[int, dict], job, wall_s: float, trace: str = "") -> dict:
    """One result from every rank's: the losses, the slowest rank's step
    times, memory per rank; with `trace`, the merged trace written there."""
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
        "job_digest": job.digest() if job is not None else None, "wall_s": wall_s,
        "first_step": next(iter(per_rank.values())).get("first_step", 0),
        "trace": write_trace(per_rank, trace) if trace else None,
    }


def write_trace(per_rank: dict[int, dict], path: str) -> dict:
    """Merge the ranks' measured spans into one Chrome trace at `path`;
    returns its path, step time and bubble ratios (see schedules/trace.py)."""
    spans = {r: [Span.from_json(row) for row in v["trace"]] for r, v in per_rank.items()
             if v.get("trace")}
    write_atomic(Path(path), json.dumps(chrome_events(spans)).encode())
    b = bubble(spans)
    return {"path": str(path), "step_s": b["step_s"], "bubble_ratio": b["bubble_ratio"],
            "per_rank_bubble": {str(r): x for r, x in sorted(b["per_rank_bubble"].items())}}
