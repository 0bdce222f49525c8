"""Data: how a global batch becomes micro-batches, the same on every rank.

Invariant: micro-batch `i` is the `i`-th of `m` equal chunks along dim 0 of
every input; a rank then keeps its slice of each (its box of the DATA value),
so dp ranks split a micro-batch, not the global batch.
"""

from __future__ import annotations

import torch


def split_microbatches(batch: tuple[torch.Tensor, ...], m: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every tensor of `batch` into `m` equal micro-batches along dim 0."""
    parts = [t.chunk(m, dim=0) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(m)]
