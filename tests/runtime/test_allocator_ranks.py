"""The plan's peak against the CPU allocator's, on every rank of a gloo run
in processes (`tests/runtime/allocator_ranks.py`): ZeRO 1-3's gathers and
reductions and tp·pp's transfers, with their buffers and the backend's
own (`lowering/memory.collective_temp`). On threads the profiler sees one
rank only (`test_memory.py`), so these run as processes.

The allocator's peak moves from run to run with what is in flight when; the
bound must hold for every run, and these cases are the ones that found the
plan short (planted below)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.driver.plan import plan_model, zoo_strategy
from meshplan.ir.mesh import Mesh
from meshplan.ir.optimizer_config import OptimizerConfig
from meshplan.models import model_config
from tests.runtime.test_memory import STATE_HEAVY

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allocated_and_planned(tmp_path: Path, world: int, overrides: dict, bug: str = "-",
                          **fields) -> list[tuple[int, int]]:
    """(allocator's peak over the second step, planned peak) of each rank of
    GPT tiny with AdamW, `world` gloo processes."""
    cfg = model_config("gpt", "tiny", **overrides)
    job = plan_model("gpt", "tiny", Mesh(1, world), zoo_strategy("gpt", cfg, **fields),
                     OptimizerConfig.of("adamw", 1e-3), **overrides).job
    job_path = tmp_path / "job.bin"
    job_path.write_bytes(job.to_bytes())
    config = json.dumps(overrides | {"batch": fields["global_batch_size"]})
    port = _port()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.allocator_ranks",
                               str(job_path), str(r), str(world), str(port), config,
                               str(tmp_path), bug], cwd=ROOT, env=env, stderr=subprocess.PIPE)
             for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    out = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(world)]
    return [(o["allocated"], o["planned"]) for o in out]


CASES = {
    # buckets: the STEP's gathers (1, 2), per micro-batch reduce-scatters (2, 3),
    # ZeRO-3's prefetched layer gathers
    "zero1": (4, {}, dict(dp=4, zero=1, bucket_mb=0.2, global_batch_size=8,
                          micro_batch_size=1)),
    "zero2": (4, {}, dict(dp=4, zero=2, bucket_mb=0.2, global_batch_size=8,
                          micro_batch_size=1)),
    "zero3": (4, {}, dict(dp=4, zero=3, bucket_mb=0.2, global_batch_size=8,
                          micro_batch_size=1)),
    "tp2pp2": (4, {}, dict(tp=2, pp=2, global_batch_size=8, micro_batch_size=2)),
    # no buckets: each parameter gathered alone, the largest 1 MB (the embedding)
    "zero1-unbucketed": (2, STATE_HEAVY, dict(dp=2, zero=1, bucket_mb=0, global_batch_size=2,
                                              micro_batch_size=1)),
    "zero2-state-heavy": (2, STATE_HEAVY, dict(dp=2, zero=2, global_batch_size=2,
                                               micro_batch_size=1)),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_planned_peak_bounds_every_ranks_allocator_peak(tmp_path, case):
    world, overrides, fields = CASES[case]
    for rank, (allocated, planned) in enumerate(
            allocated_and_planned(tmp_path, world, overrides, **fields)):
        assert 0 < allocated <= planned, f"rank {rank}: allocated {allocated} > planned {planned}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_plan_without_the_collectives_workspace_is_caught(tmp_path):
    """Planted: no collective's workspace in the plan (as before): each
    unbucketed gather's parts and gloo's own flat output take the allocator
    past it, on every rank."""
    world, overrides, fields = CASES["zero1-unbucketed"]
    ranks = allocated_and_planned(tmp_path, world, overrides, "no_comm_temp", **fields)
    assert all(allocated > planned for allocated, planned in ranks), ranks
