"""Shared by the runtime tests: a job's ranks on threads against eager."""

from __future__ import annotations

import torch

from meshplan.autodiff import OptimizerConfig
from meshplan.driver.verify import against_eager
from meshplan.models import build_model, example_batch
from meshplan.runtime.local import run_local


def local_verdict(job, cfg, batch_size: int, steps: int = 2) -> bool:
    """Train `cfg`'s model (seed 0) `steps` steps with every rank of `job` on
    threads (so a test's monkeypatch reaches them); True when losses,
    parameters and optimizer state equal eager PyTorch's."""
    torch.manual_seed(0)
    module = build_model(cfg)
    batches = [example_batch(cfg, batch_size, seed=i) for i in range(steps)]
    mine = run_local(job, module, batches)
    verdict, _ = against_eager(mine.rank_losses, mine.slices, module, batches,
                               job.strategy.num_microbatches, OptimizerConfig.of_job(job))
    return verdict["ok"]
