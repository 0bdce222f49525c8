"""Data: how a global batch becomes micro-batches, the same on every rank,
and which of a micro-batch's rows a rank reads.

Invariants:
- Micro-batch `i` is the `i`-th of `m` equal chunks along dim 0 of every
  input; a rank then keeps its slice of each (its box of the DATA value), so
  dp ranks split a micro-batch, not the global batch.
- A rank's rows (`data_rows`) are the union, along dim 0, of the boxes of
  the DATA values its plan reads: a rank that reads none (a middle pipeline
  stage) has none, and a reader gives each rank exactly these rows.
"""

from __future__ import annotations

import torch

from meshplan.data.feed import FeedReader, TokenFeed


def split_microbatches(batch: tuple[torch.Tensor, ...], m: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every tensor of `batch` into `m` equal micro-batches along dim 0."""
    parts = [t.chunk(m, dim=0) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(m)]


def data_rows(ctx, vids) -> tuple[int, int] | None:
    """The rows `[lo, hi)` of each micro-batch (its samples, dim 0) that the
    rank of `ctx` reads through the DATA values `vids` it uses; None if it
    uses none."""
    boxes = [ctx.box(v)[0] for v in vids if ctx.box(v)]
    if not boxes:
        return None
    return min(a for a, _ in boxes), max(b for _, b in boxes)


def local_rows(microbatches, rows: tuple[int, int] | None) -> list[tuple[torch.Tensor, ...]]:
    """Rows `[lo, hi)` of each global micro-batch (what a rank reading only
    its own rows would have read); [] for a rank that reads none."""
    if rows is None:
        return [() for _ in microbatches]
    lo, hi = rows
    return [tuple(t[lo:hi] for t in mb) for mb in microbatches]


def batch_feed(batches, m: int):
    """`feed(step) -> (micro-batches, local_rows)` of global batches given:
    step `k`'s batch split into `m` micro-batches (every rank gets them whole
    and keeps its box)."""
    return lambda step: (split_microbatches(batches[step], m), False)


def token_feed(text: str, strategy, rows):
    """`feed(step)`: this rank's rows of each micro-batch, read from the
    token file; a rank whose plan reads no data opens no file at all."""
    m = strategy.num_microbatches
    if rows is None:
        return lambda step: ([() for _ in range(m)], True)
    reader = FeedReader(TokenFeed.from_json(text), strategy.global_batch_size, m)

    def feed(step: int):
        return reader.microbatches(step, rows), True

    feed.reader = reader  # type: ignore[attr-defined]  # its rows_read are reported
    return feed


