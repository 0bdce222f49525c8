"""A rank process of tests/runtime/test_agreement.py: lower its own plan of a
test Job, plant a disagreement if told, and run the distributed check."""

from __future__ import annotations

import datetime
import json
import sys
import time
from dataclasses import replace

import torch.distributed as dist

from meshplan.errors import PlanError
from meshplan.ir.fileio import read_bytes, write_atomic
from meshplan.ir.job import Job
from meshplan.lowering.lower import lower
from meshplan.lowering.rankplan import TaskKind
from meshplan.runtime.agreement import agree
from meshplan.runtime.comm import Comm, rank_groups


def plant(plan, bug: str):
    if bug == "box":  # one send's piece cut short
        i = next(i for i, t in enumerate(plan.tasks) if t.kind is TaskKind.SEND)
        t = plan.tasks[i]
        box = ((t.box[0][0], t.box[0][1] - 1),) + t.box[1:]
        return replace(plan, tasks=plan.tasks[:i] + (replace(t, box=box),) + plan.tasks[i + 1:])
    if bug == "order":  # two collectives of one group swapped
        i, j = [i for i, t in enumerate(plan.tasks) if t.kind is TaskKind.COLLECTIVE][:2]
        tasks = list(plan.tasks)
        tasks[i], tasks[j] = tasks[j], tasks[i]
        return replace(plan, tasks=tuple(tasks))
    if bug == "actions":
        a = list(plan.actions)
        k = next(k for k in range(len(a) - 1) if a[k].type != a[k + 1].type)
        a[k], a[k + 1] = a[k + 1], a[k]
        return replace(plan, actions=tuple(a))
    return plan


def main(job_path: str, rank: int, world: int, port: int, bad_rank: int, bug: str, out: str):
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    job = Job.from_bytes(read_bytes(job_path), job_path)  # planned once, by the test
    view = job.view(job.strategy.stage_of_rank(rank))
    plan = lower(view, rank)
    if rank == bad_rank:
        plan = plant(plan, bug)
    comm = Comm(rank, rank_groups(job.strategy, rank, view.ops), "gloo")
    t0 = time.perf_counter()
    try:
        agree(plan, view, comm.groups)
        verdict = "ok"
    except PlanError as e:
        verdict = str(e)
    seconds = time.perf_counter() - t0
    write_atomic(f"{out}/rank_{rank}.json",
                 json.dumps({"verdict": verdict, "seconds": seconds}).encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:8])
