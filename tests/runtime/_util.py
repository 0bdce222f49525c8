"""Shared by the runtime tests: a job's ranks on threads against eager."""

from __future__ import annotations

import copy

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.verify import against_eager
from meshplan.models import build_model, example_batch
from meshplan.runtime.local import run_local

# GPT tiny layouts that `--kernels inductor` tests share: `test_fused`'s verify builds
# their runs (spawned ranks, one torch thread each), and a test on threads that runs
# them again with one torch thread loads the same artifacts from the machine's cache
# (`runtime/kernel_cache.artifact_key`), where other layouts would build their own
# (each build seconds of C++).
GPT_1_RANK = dict(global_batch_size=8, micro_batch_size=4)
GPT_4D = dict(dp=2, tp=2, pp=2, vpp=2, global_batch_size=8, micro_batch_size=2,
              schedule="interleaved")


def eager_verdict(job, cfg, batch_size: int, steps: int = 2) -> dict:
    """Train `cfg`'s model (seed 0) `steps` steps with every rank of `job` on
    threads (so a test's monkeypatch reaches them); the verdict against
    eager PyTorch (`driver.verify.against_eager`: losses, parameters and
    optimizer state)."""
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, batch_size, seed=i) for i in range(steps)]
    mine = run_local(job, copy.deepcopy(module), batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches,
                               job.strategy.num_microbatches, OptimizerConfig.of_job(job))
    return verdict


def local_verdict(job, cfg, batch_size: int, steps: int = 2) -> bool:
    """`eager_verdict`'s: True when equal to eager."""
    return eager_verdict(job, cfg, batch_size, steps)["ok"]
