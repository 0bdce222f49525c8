"""A training run whose ranks torchrun starts: `torchrun --nproc-per-node N
[--max-restarts R] -m meshplan train ...`, each process one rank.

Invariants:
- Every process plans from the same flags and builds the same starting
  weights, but the ranks run global rank 0's Job (`rank_main`'s master
  broadcasts its bytes), so they lower one Job; a rank reads only its own
  rows of the token data, as under the local launcher.
- The run's directory is on storage every rank reaches, as its checkpoints
  must be: each rank writes its step rows and final slices into
  `OUT/.ranks/attempt_<k>/`, and global rank 0 alone writes the run's files
  (metrics while the run goes on, from a thread that merges the rows; the
  weights at the end).
- A failed rank makes this process exit non-zero; torchrun ends the others.
  With `--max-restarts`, torchrun starts them all again
  (`TORCHELASTIC_RESTART_COUNT` > 0): each resumes from the newest complete
  checkpoint under `OUT/checkpoints`, and the metrics get a `resume` row.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

from meshplan.autodiff import OptimizerConfig
from meshplan.data.feed import TokenFeed
from meshplan.driver.metrics import MetricsLog
from meshplan.driver.run import merge
from meshplan.driver.train import (
    CHECKPOINTS,
    StepMerger,
    TrainResult,
    complete_checkpoints,
    peak_capacity,
    prune_checkpoints,
    run_spec,
    step_flops,
    trained_weights,
)
from meshplan.driver.unread import start_values
from meshplan.errors import RuntimeFault
from meshplan.ir.fileio import write_atomic
from meshplan.runtime.checkpoint import check_resumable
from meshplan.runtime.rank_result import read_results, result_name
from meshplan.runtime.tensor_file import STATE, read_tensors
from meshplan.runtime.worker import rank_main

RANKS_DIR = ".ranks"


def restart_count() -> int:
    """How many times torchrun has restarted this run's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_point(out: str, job, resume_from: str) -> str:
    """Where this attempt starts: `resume_from`, or on a torchrun restart the
    newest complete checkpoint (none yet: the start)."""
    if resume_from or not restart_count():
        return resume_from
    done = complete_checkpoints(Path(out) / CHECKPOINTS)
    return str(done[-1]) if done else ""


def train_here(job, weights: dict, data, steps: int, out: str, *, eval_job=None,
               keep: int = 0, tensorboard: bool | None = None, on_step=None,
               record: dict | None = None, resume_from: str = "", **run):
    """Run this process as its torchrun rank; returns the `TrainResult` on
    global rank 0, None elsewhere. `run` are `train.run_spec`'s options."""
    t0 = time.perf_counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != job.mesh.world:
        raise RuntimeFault(f"torchrun started {world} ranks but the strategy needs "
                           f"{job.mesh.world}; match --nnodes x --nproc-per-node to "
                           "--nodes x --devices-per-node")
    resume_from = resume_point(out, job, resume_from)
    results = Path(out) / RANKS_DIR / f"attempt_{restart_count()}"
    results.mkdir(parents=True, exist_ok=True)
    unread = start_values(job, weights, run.get("init_from", ""), resume_from) \
        if rank == 0 else None
    spec = run_spec(job, data, steps, out, record if rank == 0 else None, unread,
                    eval_job=eval_job, resume_from=resume_from, **run)
    eval_file = ""
    if eval_job is not None:  # this process's own copy, in the attempt's folder (removed
        # with it at the end, and left in the run's folder, not /tmp, by a killed worker)
        eval_file = str(results / f"eval_job_{rank}.bin")
        write_atomic(Path(eval_file), eval_job.to_bytes())
    spec = replace(spec, results=str(results), eval_job=eval_file)
    merging = _Merging(job, data, out, results, tensorboard, resume_from, keep,
                       on_step, spec) if rank == 0 else None
    batches = [] if spec.data else list(data)
    try:
        code = rank_main(spec, rank, world, None, "env://", master=job.to_bytes,
                         source=(weights, batches))
    finally:
        if merging is not None:
            merging.stop()
    if code != 0:
        fail = json.loads((results / f"fail_{rank}.json").read_text())
        raise RuntimeFault(f"rank {rank} failed in action {fail['action']}: {fail['error']}")
    if rank != 0:
        return None
    r = merging.result(world, t0, unread, spec.timeout_s)
    if keep:
        prune_checkpoints(Path(out) / CHECKPOINTS, keep)
    shutil.rmtree(Path(out) / RANKS_DIR, ignore_errors=True)
    return r


class _Merging:
    """Global rank 0's thread: the ranks' step rows merged into metrics as
    they come (`train.StepMerger`), old checkpoints pruned."""

    def __init__(self, job, data, out, results, tensorboard, resume_from, keep, on_step,
                 spec):
        self.job, self.out, self.results, self.keep = job, out, results, keep
        self.first = check_resumable(resume_from, job) if resume_from else 0
        self.log = MetricsLog(out, tensorboard=tensorboard, append=bool(resume_from))
        if resume_from:
            why = "resumed" if not restart_count() else \
                f"torchrun restart {restart_count()}: a rank failed"
            self.log.log_resume(self.first, resume_from, why)
        tokens = isinstance(data, TokenFeed)
        per_step = job.strategy.global_batch_size * (data.seq_len if tokens else 1)
        self.merger = StepMerger(results, job, self.log, per_step, step_flops(job),
                                 peak_capacity(spec.device, job.mesh.world, spec.threads)[0],
                                 OptimizerConfig.of_job(job).lr)
        self.on_step, self.done = on_step, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        written = 0
        while not self.done.wait(0.2):
            self.merger.poll()
            if self.keep:
                prune_checkpoints(Path(self.out) / CHECKPOINTS, self.keep)
            if self.on_step is not None and len(self.merger.written) > written:
                written = len(self.merger.written)
                self.on_step(self.first + written)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.merger.poll(final=True)
        self.log.close()

    def result(self, world: int, t0: float, unread: dict, timeout_s: float):
        """The run's result, once every rank has written its own."""
        deadline = time.monotonic() + timeout_s
        while not all((self.results / result_name(r)).is_file() for r in range(world)):
            if time.monotonic() > deadline:
                raise RuntimeFault(f"not every rank reported within {timeout_s:.0f} s after "
                                   f"rank 0 finished ({self.results}); see their logs")
            time.sleep(0.1)
        per_rank = read_results(self.results, world)
        slices = {r: read_tensors(self.results / f"state_{r}.bin", STATE)[0]
                  for r in range(world)}
        r = merge(per_rank, self.job, time.perf_counter() - t0)
        return TrainResult(r.losses, self.merger.eval_written,
                           trained_weights(self.job, slices, unread), self.merger.written,
                           {str(k): v.rows_read for k, v in sorted(per_rank.items())},
                           time.perf_counter() - t0, self.first)
