"""A rank process of tests/runtime/test_allocator_ranks.py: train two steps
of GPT tiny on gloo with its own plan, the CPU allocator watched from
before the model is built (`tests/allocator.py`), and write the allocator's
peak over the second step beside the plan's peak and `LiveBytes`'."""

from __future__ import annotations

import datetime
import gc
import json
import sys

import torch
import torch.distributed as dist

from meshplan.ir.fileio import read_bytes, write_atomic
from meshplan.ir.job import Job
from meshplan.lowering import memory
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime.comm import Comm, rank_groups
from meshplan.runtime.data import split_microbatches
from meshplan.runtime.own_plan import rank_plan
from meshplan.runtime.rank_executor import RankExecutor
from tests.allocator import AllocatorPeak


def plant(bug: str) -> None:
    """Plant `bug` in this process: "copy", ZeRO 1 and 2's STEP gathers into
    fresh tensors (the parameter's old one lives to the STEP's end, as
    before); "no_comm_temp", a plan without the collectives' workspace."""
    if bug == "copy":
        RankExecutor._into = lambda self, vid: None
    elif bug == "no_comm_temp":
        memory.collective_temp = lambda *args, **kwargs: 0


def main(job_path: str, rank: int, world: int, port: int, config: str, out: str,
         bug: str = "-") -> None:
    plant(bug)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    job = Job.from_bytes(read_bytes(job_path), job_path)  # planned once, by the test
    overrides = json.loads(config)
    batch = overrides.pop("batch")
    cfg = model_config("gpt", "tiny", **overrides)
    batches = [split_microbatches(example_batch(cfg, batch, seed=i),
                                  job.strategy.num_microbatches) for i in range(2)]
    view = job.view(job.strategy.stage_of_rank(rank))
    plan = rank_plan(view, rank, "cpu")
    comm = Comm(rank, rank_groups(job.strategy, rank, view.ops), "gloo")
    with AllocatorPeak() as alloc:
        torch.manual_seed(0)
        module = build_model(cfg)
        ex = RankExecutor(view, plan, comm)
        state = ex.init_state(module)
        del module  # the rank's state is its own copy
        gc.collect()
        ex.step(state, batches[0])
        dist.barrier()
        alloc.mark()
        ex.step(state, batches[1])
        dist.barrier()
    write_atomic(f"{out}/rank_{rank}.json", json.dumps(
        {"allocated": alloc.peak(), "planned": plan.memory.peak_bytes(),
         "live": ex.mem.peak, "by": dict(plan.memory.peak)}).encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]), *sys.argv[5:8])
