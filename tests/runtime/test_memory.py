"""runtime/live_bytes.py against lowering/memory.py: the bytes a rank holds while it
trains (LiveBytes, every tensor the executor holds, counted by storage) never
exceed the peak its plan promised."""

from __future__ import annotations

import pytest
import torch

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime import fused
from meshplan.runtime.local import local_ranks, train_local


def measured_and_planned(mesh: Mesh, optimizer: str, kernels: str = "eager",
                         **fields) -> list[tuple[int, int]]:
    """(measured peak, planned peak) of each rank over two steps of GPT tiny."""
    cfg = model_config("gpt", "tiny")
    job = plan_model("gpt", "tiny", mesh, zoo_strategy("gpt", cfg, **fields), optimizer).job
    torch.manual_seed(0)
    hub, ranks = local_ranks(job, build_model(cfg), kernels=kernels, timeout_s=600)
    train_local(job, hub, ranks, [example_batch(cfg, fields["global_batch_size"], seed=i)
                                  for i in range(2)], timeout_s=600)
    return [(ex.mem.peak, ex.plan.memory.peak_bytes()) for ex, _ in ranks]


@pytest.mark.parametrize("mesh, optimizer, fields", [
    (Mesh(1, 1), "sgd", dict(global_batch_size=8, micro_batch_size=4)),
    (Mesh(1, 1), "adamw", dict(global_batch_size=8, micro_batch_size=8)),
    (Mesh(1, 4), "sgd", dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2)),
    # gradient buckets: the STEP's gathers (zero 1 and 2), per micro-batch reduce-scatters
    # (zero 2 and 3, 5 a micro-batch) and, at zero 3, prefetched gathers
    (Mesh(1, 4), "adamw", dict(dp=4, zero=1, bucket_mb=0.2, global_batch_size=8,
                               micro_batch_size=1)),
    (Mesh(1, 4), "adamw", dict(dp=4, zero=2, bucket_mb=0.2, global_batch_size=8,
                               micro_batch_size=1)),
    (Mesh(1, 4), "adamw", dict(dp=4, zero=3, bucket_mb=0.2, global_batch_size=8,
                               micro_batch_size=1)),
])
def test_planned_peak_bounds_the_measured_peak(mesh, optimizer, fields):
    for rank, (measured, planned) in enumerate(measured_and_planned(mesh, optimizer, **fields)):
        assert 0 < measured <= planned, f"rank {rank}: measured {measured} > planned {planned}"


@pytest.mark.slow
@pytest.mark.skipif(not fused.can_compile(), reason="no C++ compiler for Inductor on cpu")
@pytest.mark.parametrize("mesh, optimizer, fields", [
    (Mesh(1, 1), "adamw", dict(global_batch_size=8, micro_batch_size=4)),
    (Mesh(1, 4), "sgd", dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2)),
])
def test_planned_peak_bounds_inductors_measured_peak(mesh, optimizer, fields):
    """With `--kernels inductor` the measured peak counts each built run's own
    buffers (measured at its first call) on top of the values live around
    it; the plan, counting every value of the eager op sequence, bounds it."""
    for rank, (measured, planned) in enumerate(
            measured_and_planned(mesh, optimizer, kernels="inductor", **fields)):
        assert 0 < measured <= planned, f"rank {rank}: measured {measured} > planned {planned}"
