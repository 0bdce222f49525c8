"""Eager PyTorch reference training, the judge of every meshplan run.

Invariant: the reference sees exactly the data meshplan sees: the same
global batches, split into the same micro-batches, with each micro-batch's
loss scaled by 1/num_microbatches before `backward()` so gradients
accumulate to the gradient of the mean loss.
"""

from __future__ import annotations

import time

from torch import nn

from meshplan.autodiff import OptimizerConfig
from meshplan.runtime.data import split_microbatches


def eager_train(
    module: nn.Module, batches, num_microbatches: int, optimizer: OptimizerConfig
) -> tuple[list[float], list[float]]:
    """Train `module` in place on `batches`; returns (losses, step seconds)."""
    opt = optimizer.torch_optimizer(module.parameters())
    losses, times = [], []
    for batch in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in split_microbatches(batch, num_microbatches):
            loss = module(*mb)
            (loss / num_microbatches if num_microbatches > 1 else loss).backward()
            total += loss.detach()
        opt.step()
        losses.append(float(total / num_microbatches))
        times.append(time.perf_counter() - t0)
    return losses, times
