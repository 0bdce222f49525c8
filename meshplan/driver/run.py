"""run: the master once, then one process per rank, each lowering and
running its own plan; results merged.

Invariant: the losses reported are the last pipeline stage's (every rank
there holds the replicated loss), the mean over the global batch per step.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.plan import plan_model
from meshplan.driver.results import RunResult, steady_step_s
from meshplan.errors import ConfigError, PlanError, RuntimeFault
from meshplan.ir import Role
from meshplan.ir.fileio import write_atomic
from meshplan.ir.mesh import Mesh, Strategy
from meshplan.lowering.check_classes import check_dir
from meshplan.lowering.files import read_plan
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.checkpoint import check_resumable
from meshplan.runtime.devices import resolve_backend, resolve_device
from meshplan.runtime.fused import check_kernels
from meshplan.runtime.launch import launch_local
from meshplan.runtime.rank_result import RankResult, read_gathered
from meshplan.runtime.state import weights_of
from meshplan.runtime.tensor_file import STATE, read_tensors, save_inputs
from meshplan.runtime.worker import RunSpec, rank_main
from meshplan.schedules.trace import Span, bubble, chrome_events

log = logging.getLogger("meshplan")


# How long a collective may wait when the caller sets no timeout. With Inductor's
# kernels a rank's first step also waits on its peers' builds of theirs on a cold
# cache: ResNet tiny at dp2*pp2 built 79 runs, 400 s a rank on 2 cores, and a
# stage's receive waited on the other's longer than 60 s.
TIMEOUT_S = {"eager": 60.0, "inductor": 900.0}


def timeout_for(timeout_s: float | None, kernels: str) -> float:
    """The caller's timeout, or the kernels' default (`TIMEOUT_S`)."""
    return TIMEOUT_S.get(kernels, TIMEOUT_S["eager"]) if timeout_s is None else timeout_s


def train_timeout(stall_s: float, kernels: str) -> float:
    """A training run's collective timeout: a minute past its stall watchdog
    (which ends a hung run first, naming the rank), and no shorter than the
    kernels' default: a rank waits in a receive while a peer builds its
    runs, which the watchdog counts as progress."""
    return max(stall_s + 60, timeout_for(None, kernels))


def check_run_args(steps: int, threads: int, timeout_s: float) -> None:
    """Flags every rank would trip over: refused before any process starts."""
    for flag, value in (("--steps", steps), ("--threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer, e.g. {flag} 1")
    if not timeout_s > 0:
        raise ConfigError(f"--timeout {timeout_s} must be a positive number of seconds, "
                          "e.g. --timeout 60")


def _load_plans(plan_dir: str, mesh: Mesh, model: str, size: str, overrides: dict,
                device: str = "cpu"):
    """The Job of a compiled plan directory, proved consistent, for this mesh
    and this model (a rank would otherwise die slicing the wrong weights)."""
    job, res = check_dir(Path(plan_dir), partial=False)
    if job.mesh.world != mesh.world:
        raise RuntimeFault(f"{plan_dir} holds plans for {job.mesh.world} ranks but "
                           f"{mesh.world} were asked for; recompile or match the mesh")
    lowered = read_plan(Path(plan_dir), 0, job.strategy, job.mesh.devices_per_node).device
    if lowered != device:
        raise ConfigError(f"{plan_dir} holds plans lowered for {lowered}, but the run is on "
                          f"{device}; run with --device {lowered}, or recompile with "
                          f"--device {device}")
    if not res.ok:
        raise PlanError(f"{plan_dir} fails `meshplan check`: "
                        f"{res.errors[0].splitlines()[0]}; recompile it")
    module = build_model(model_config(model, size, **overrides), device="meta")
    mine = {k: list(t.shape) for k, t in module.state_dict().items()}
    for v in job.graph.values:
        if v.role in (Role.PARAM, Role.BUFFER) and mine.get(v.name) != list(v.meta.shape):
            raise PlanError(f"{plan_dir} was compiled for another model: its '{v.name}' is "
                            f"{list(v.meta.shape)}, but --model {model} --size {size} "
                            f"{'has ' + str(mine[v.name]) if v.name in mine else 'has none'}; "
                            "pass the model flags it was compiled with, or recompile")
    return job


def run(model: str, size: str, mesh: Mesh, strategy: Strategy, steps: int = 10,
        optimizer: str | OptimizerConfig = "sgd", seed: int = 0, threads: int = 1,
        timeout_s: float | None = None,
        plan_dir: str = "", save_dir: str = "", resume: bool = False,
        lr: float | None = None, trace: str = "", on_step=None,
        report_state: bool = False, device: str = "cpu", backend: str = "",
        kernels: str = "eager", **overrides) -> RunResult:
    """Train on `mesh.world` local processes; returns losses, step times, memory.

    With `trace` (a path), the last step is timed on every rank and written
    there as one Chrome/Perfetto trace; the result's "trace" holds its
    measured bubble ratio. `on_step(k)` is called as the ranks finish step k.
    With `report_state`, "state_slices" holds every rank's final state
    (rank -> `<name>|<box>` -> tensor) for `verify`.
    `device` is cpu, cuda or auto; `backend` gloo or nccl (""
    picks: nccl on cuda, gloo on cpu; see runtime/devices.py); `kernels`
    eager or inductor (`runtime/fused.py`); `timeout_s` bounds every wait
    (None: the kernels' default, `TIMEOUT_S`)."""
    t0 = time.perf_counter()
    timeout_s = timeout_for(timeout_s, kernels)
    check_run_args(steps, threads, timeout_s)
    device, backend = run_devices(device, backend, mesh.world)
    check_kernels(kernels, device)
    if plan_dir:  # compiled plans: validated whole before any process starts
        job = _load_plans(plan_dir, mesh, model, size, overrides, device)
    else:
        job = plan_model(model, size, mesh, strategy, optimizer, lr, **overrides).job
    if resume:
        check_resumable(save_dir, job)
    spec = RunSpec(steps, "", threads, timeout_s, plan_dir=plan_dir, save_dir=save_dir,
                   resume=resume, trace=bool(trace), report_state=report_state, device=device,
                   backend=backend, seed=seed, kernels=kernels)
    weights, batches = zoo_source(model, size, seed, steps, job.strategy.global_batch_size,
                                  overrides)
    return launch(job, spec, t0, trace, saved={"weights": weights, "batches": batches},
                  on_step=on_step)


def zoo_source(model: str, size: str, seed: int, steps: int, global_batch_size: int,
               overrides: dict) -> tuple[dict, list]:
    """A zoo model's initial weights (built from its config after
    `torch.manual_seed(seed)`, as the eager reference builds it) and its
    synthetic global batch of each step (seed + step): what the ranks
    receive, so no rank builds a model."""

    cfg = model_config(model, size, **overrides)
    torch.manual_seed(seed)
    weights = weights_of(build_model(cfg))
    return weights, [example_batch(cfg, global_batch_size, seed=seed + step)
                     for step in range(steps)]


def run_devices(device: str, backend: str, ranks_here: int) -> tuple[str, str]:
    """(device type, backend) for `ranks_here` ranks on this machine, or one
    `ConfigError` line before any process starts."""
    device = resolve_device(device)
    return device, resolve_backend(device, backend, ranks_here)


def launch(job, spec: RunSpec, t0: float, trace: str = "", saved=None,
           on_step=None, results: str = "", eval_job=None) -> RunResult:
    """Run `spec` on `job.mesh.world` local processes and merge what they
    report. Results go to a temporary folder (or `results`, which the caller
    reads while the run goes on); `saved`, weights and batches, if given, go
    there as the ranks' `module_file` (tensors only), and `eval_job` (the
    forward-only Job) as their `eval_job` file."""
    if not results:
        with tempfile.TemporaryDirectory(prefix="meshplan-run-") as tmp:
            return launch(job, spec, t0, trace, saved, on_step, tmp, eval_job)
    module_file = eval_file = ""
    if saved is not None:
        module_file = str(Path(results) / "inputs.bin")
        save_inputs(Path(module_file), saved["weights"], saved["batches"])
    if eval_job is not None:
        eval_file = str(Path(results) / "eval_job.bin")
        write_atomic(Path(eval_file), eval_job.to_bytes())
    spec = replace(spec, results=results, module_file=module_file, eval_job=eval_file)
    log.info("starting %d rank processes for %d steps (plans: %s)", job.mesh.world,
             spec.steps, spec.plan_dir or "each rank lowers its own")
    per_rank = launch_local(spec, job.mesh.world, job.to_bytes(), on_step=on_step)
    slices = {r: read_tensors(Path(results) / f"state_{r}.bin", STATE)[0]
              for r in range(job.mesh.world)} if spec.report_state else None
    out = merge(per_rank, job, time.perf_counter() - t0, trace)
    out.state_slices = slices
    out.rows_read = {str(r): v.rows_read for r, v in sorted(per_rank.items())}
    return out


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "RANK" in os.environ)


def run_torchrun(model: str, size: str, mesh: Mesh, strategy: Strategy, steps: int = 10,
                 optimizer: str | OptimizerConfig = "sgd", seed: int = 0, threads: int = 1,
                 timeout_s: float | None = None, lr: float | None = None, trace: str = "",
                 save_dir: str = "", device: str = "cpu", backend: str = "",
                 kernels: str = "eager", **overrides) -> RunResult | None:
    """This process is one torchrun rank: rank 0 plans and broadcasts the Job,
    every rank lowers and runs itself. Returns the merged result on rank 0.
    With `save_dir` (on storage every rank reaches) the ranks save a DCP
    checkpoint at the end."""
    timeout_s = timeout_for(timeout_s, kernels)
    check_run_args(steps, threads, timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, backend = run_devices(device, backend,
                                  int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    check_kernels(kernels, device)
    if world != mesh.world:
        raise RuntimeFault(f"torchrun started {world} ranks but the strategy needs "
                           f"{mesh.nodes}x{mesh.devices_per_node} = {mesh.world}; match "
                           "--nnodes/--nproc-per-node to --nodes/--devices-per-node")
    t0 = time.perf_counter()

    def master() -> bytes:
        return plan_model(model, size, mesh, strategy, optimizer, lr,
                          **overrides).job.to_bytes()

    with tempfile.TemporaryDirectory(prefix="meshplan-run-") as results:
        spec = RunSpec(steps, results, threads, timeout_s, gather=True, trace=bool(trace),
                       save_dir=save_dir, device=device, backend=backend, seed=seed,
                       kernels=kernels)
        source = zoo_source(model, size, seed, steps, strategy.global_batch_size, overrides)
        code = rank_main(spec, rank, world, None, "env://", master=master, source=source)
        if code != 0:
            fail = json.loads((Path(results) / f"fail_{rank}.json").read_text())
            raise RuntimeFault(f"rank {rank} failed in action {fail['action']}: "
                               f"{fail['error']}")
        if rank != 0:
            return None
        per_rank = read_gathered(Path(results))
    return merge(per_rank, None, time.perf_counter() - t0, trace)


def merge(per_rank: dict[int, RankResult], job, wall_s: float, trace: str = "") -> RunResult:
    """One result from every rank's: the losses, the slowest rank's step
    times, memory per rank; with `trace`, the merged trace written there."""
    holders = [r for r, v in sorted(per_rank.items()) if v.losses]
    losses = per_rank[holders[0]].losses if holders else []
    any_rank = next(iter(per_rank.values()))
    steps = [max(v.step_s[i] for v in per_rank.values()) for i in range(len(any_rank.step_s))]
    return RunResult(
        losses=losses, step_s=steps,
        rank_losses={str(r): per_rank[r].losses for r in holders},
        rank_grad_norms={str(r): v.grad_norms for r, v in sorted(per_rank.items())
                         if v.grad_norms},
        skipped_steps=any_rank.skipped_steps,
        median_step_s=steady_step_s(steps),
        ranks={str(r): v.memory() for r, v in sorted(per_rank.items())},
        job_digest=job.digest() if job is not None else None, wall_s=wall_s,
        first_step=any_rank.first_step,
        trace=write_trace(per_rank, trace) if trace else None,
        reports={name: value for _, v in sorted(per_rank.items(), reverse=True)
                 for name, value in v.reports.items()},  # the lowest rank's
    )


def write_trace(per_rank: dict[int, RankResult], path: str) -> dict:
    """Merge the ranks' measured spans into one Chrome trace at `path`;
    returns its path, step time and bubble ratios (see schedules/trace.py)."""
    spans = {r: [Span.from_json(row) for row in v.trace] for r, v in per_rank.items()
             if v.trace}
    write_atomic(Path(path), json.dumps(chrome_events(spans)).encode())
    b = bubble(spans)
    return {"path": str(path), "step_s": b["step_s"], "bubble_ratio": b["bubble_ratio"],
            "per_rank_bubble": {str(r): x for r, x in sorted(b["per_rank_bubble"].items())}}
