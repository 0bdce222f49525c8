"""runtime/live_bytes.py against lowering/memory.py: the bytes a rank holds while it
trains (LiveBytes, every tensor the executor holds, counted by storage) never
exceed the peak its plan promised; nor, on one rank, do the bytes the CPU
allocator hands out, kernels' own temporaries included (`tests/allocator.py`)."""

from __future__ import annotations

import gc

import pytest
import torch

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.ir.optimizer_config import OptimizerConfig
from meshplan.lowering import memory
from meshplan.models import build_model, example_batch, model_config
from meshplan.runtime import fused
from meshplan.runtime.data import split_microbatches
from meshplan.runtime.local import local_ranks, train_local
from tests.allocator import AllocatorPeak
from tests.runtime._util import GPT_1_RANK, GPT_4D


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
    (Mesh(1, 1), "adamw", GPT_1_RANK),
    (Mesh(1, 8), "sgd", GPT_4D),
])
def test_planned_peak_bounds_inductors_measured_peak(mesh, optimizer, fields,
                                                     one_torch_thread_here):
    """With `--kernels inductor` the measured peak counts each built run's own
    buffers (measured at its first call) on top of the values live around
    it; the plan, counting every value of the eager op sequence, bounds it.
    On one torch thread, as `test_fused`'s verify built these layouts' runs."""
    for rank, (measured, planned) in enumerate(
            measured_and_planned(mesh, optimizer, kernels="inductor", **fields)):
        assert 0 < measured <= planned, f"rank {rank}: measured {measured} > planned {planned}"


# GPT tiny with a 4096-token vocabulary, 2 layers, 8 positions: its state outweighs its
# activations, so the optimizer's step, not the backward, sets the peak
STATE_HEAVY = dict(vocab=4096, seq_len=8, layers=2)


def allocated_and_planned(optimizer: str, clip: bool, batch: int, micro: int,
                          **overrides) -> tuple[int, int]:
    """(the CPU allocator's peak over GPT tiny's second step, its planned
    peak) on one rank, the step run on this thread and every tensor made
    while the profiler looks: the state, the step's values, and the
    temporaries inside kernels."""
    cfg = model_config("gpt", "tiny", **overrides)
    opt = OptimizerConfig.of(optimizer, 1e-3, max_grad_norm=1.0 if clip else None)
    strategy = zoo_strategy("gpt", cfg, global_batch_size=batch, micro_batch_size=micro)
    job = plan_model("gpt", "tiny", Mesh(1, 1), strategy, opt, **overrides).job
    batches = [split_microbatches(example_batch(cfg, batch, seed=i), batch // micro)
               for i in range(2)]
    with AllocatorPeak() as alloc:
        torch.manual_seed(0)
        module = build_model(cfg)
        _, [(ex, state)] = local_ranks(job, module)
        del module  # the rank's state is its own copy
        gc.collect()
        ex.step(state, batches[0])
        alloc.mark()
        ex.step(state, batches[1])
    return alloc.peak(), ex.plan.memory.peak_bytes()


@pytest.mark.parametrize("optimizer, clip, batch, micro, overrides", [
    ("adamw", False, 8, 8, {}),
    ("adamw", True, 1, 1, STATE_HEAVY),
    ("adamw", False, 2, 1, STATE_HEAVY),  # the gradients' second copy
    ("sgd", True, 1, 1, STATE_HEAVY),
    ("sgd", False, 1, 1, STATE_HEAVY),
])
def test_planned_peak_bounds_the_allocators_peak(optimizer, clip, batch, micro, overrides):
    measured, planned = allocated_and_planned(optimizer, clip, batch, micro, **overrides)
    assert 0 < measured <= planned, f"allocated {measured} > planned {planned}"


def test_a_plan_without_the_updates_workspace_is_caught(monkeypatch):
    """Planted: the optimizer's clipped gradients and temporaries in no plan
    (as before they were counted): the allocator's peak passes it by 5-14%."""
    monkeypatch.setattr(memory, "_update_temp", lambda low, order: 0)
    with pytest.raises(AssertionError, match="allocated"):
        test_planned_peak_bounds_the_allocators_peak("adamw", True, 1, 1, STATE_HEAVY)
