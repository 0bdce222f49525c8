"""Part 3 of `benchmarks/fused.py`: pp=2 on 2 processes (gloo, one thread
each), 1F1B, meshplan with `--kernels eager` and `inductor` against
torch.distributed.pipelining's Schedule1F1B with each stage's module eager
and compiled by `torch.compile` (Inductor): the pipeline benchmark's GPT
(`common.SHAPE`), global batch 16 as 4 micro-batches, SGD, the same weights
and batches. Configurations alternate round by round (`common.alternate`);
a round's step time is the median of its timed steps (the slowest rank's,
between barriers), after warm-up steps that compile."""

from __future__ import annotations

import statistics
import tempfile
from functools import partial
from pathlib import Path

import common
import torch.distributed as dist
from common import (
    BATCH,
    SHAPE,
    WARMUP,
    TorchPipeline,
    batches,
    cfg,
    join_group,
    meshplan_rank,
    spawn_ranks,
    timed_steps,
    write_rank,
)

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.driver.reference import split_microbatches
from meshplan.ir.fileio import write_atomic
from meshplan.ir.mesh import Mesh

PP, MICRO = 2, 4
M = BATCH // MICRO
CONFIGS = ("meshplan eager", "meshplan inductor", "torch eager", "torch compiled")


def _step(kind: str, rank: int, job_path: str, dev):
    """This rank's step function: batch -> its mean loss (None off the last stage)."""
    if kind.startswith("meshplan"):
        ex, state = meshplan_rank(job_path, rank, dev, kernels=kind.split()[1])

        def step(batch):
            out = ex.step(state, split_microbatches(batch, M))
            return float(sum(float(x) for x in out) / len(out)) if out else None
        return step
    return TorchPipeline("Schedule1F1B", [rank], PP, MICRO, M, dev,
                         compiled=kind == "torch compiled").step


def _rank(rank: int, port: int, out: str, kind: str, job_path: str, steps: int) -> None:
    dev = join_group(rank, port, PP)
    step = _step(kind, rank, job_path, dev)
    data = batches(WARMUP + steps)
    losses, times = timed_steps(step, data, dev)
    write_rank(out, rank, {"losses": losses, "step_s": times})
    dist.destroy_process_group()


def pp2_part(steps: int = 8, rounds: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        s = zoo_strategy("gpt", cfg(), pp=PP, global_batch_size=BATCH, micro_batch_size=MICRO,
                         schedule="1f1b")
        job = plan_model("gpt", "tiny", Mesh(1, PP), s, "sgd", **SHAPE).job
        path = Path(folder, "pp2.job")
        write_atomic(path, job.to_bytes())
        runs = common.alternate({k: partial(spawn_ranks, _rank, (k, str(path), steps), PP)
                                 for k in CONFIGS}, rounds)
    out = {}
    for k in CONFIGS:
        per_round = [[max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
                     for ranks in runs[k]["rounds"]]
        # to the first compiled step: meshplan's first step runs eager kernels, and its
        # second builds (cold) or loads the runs first (docs/concepts/kernels.md)
        first = [x[0] + (x[1] if k == "meshplan inductor" else 0) for x in per_round]
        timed = [statistics.median(x[WARMUP:]) for x in per_round]
        losses = next(r["losses"] for r in runs[k]["rounds"][0] if r["losses"])
        out[k] = {"step_s": statistics.median(timed), "per_round_s": timed,
                  "first_step_s": first, "losses": losses}
    ref = out["torch eager"]["losses"]
    for k in CONFIGS:
        out[k]["loss_diff_vs_torch_eager"] = max(abs(a - b) for a, b in
                                                 zip(out[k]["losses"], ref))
    out["vs_torch_compiled"] = out["meshplan inductor"]["step_s"] / \
        out["torch compiled"]["step_s"]
    return {"steps": steps, "rounds": rounds, "warmup": WARMUP, "configs": out}
