"""One rank's gradient buckets at run time (`lowering/buckets.py` forms them).

Invariants:
- `hooks(key)` are compiled into task group `key`'s function: after the op
  that makes a bucket's last gradient, the bucket starts, but only in the
  group's last run of the step (its last micro-batch): its gradients are
  copied into one flat tensor, all-reduced in the background.
- `kernel(op)` is the STEP's kernel of a bucketed reduction: it waits for
  its bucket (once) and returns its own slice of the flat result (a
  reduce-scatter, its part of it).
- The flat tensors count in the rank's live bytes until the step ends.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch

from meshplan.ir.kinds import REDUCE_SCATTER
from meshplan.runtime.bind import narrower


class GradBuckets:
    def __init__(self, buckets, ctx, comm, mem):
        self.ctx, self.comm, self.mem = ctx, comm, mem
        self.buckets = buckets
        self.at = {op: (i, k) for i, b in enumerate(self.buckets) for k, op in enumerate(b.ops)}
        self.runs: Counter = Counter()
        self.flight: dict[int, list] = {}
        self.microbatches = 0

    def start_step(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.runs.clear()

    def ran(self, key) -> None:
        """Task group `key` is about to run (once more this step)."""
        self.runs[key] += 1

    def hooks(self, key) -> dict:
        return {b.after: (partial(self._start, i), list(b.sources))
                for i, b in enumerate(self.buckets) if b.template == key}

    def kernel(self, op):
        """The STEP's kernel of reduction `op` if a bucket carries it, else None."""
        where = self.at.get(op.id)
        if where is None:
            return None
        cut = narrower(self.ctx, op.args[0].id, op.outputs[0]) if op.kind == REDUCE_SCATTER \
            else None

        def from_bucket(x, **_):
            out = self._result(*where, x.shape)
            return cut(out) if cut is not None else out
        return from_bucket

    def end_step(self) -> None:
        for _, flat, _, _ in self.flight.values():
            self.mem.drop(flat)
        self.flight.clear()

    def _start(self, i: int, grads: list) -> None:
        b = self.buckets[i]
        if self.runs[b.template] != self.microbatches:
            return  # not the last micro-batch: the gradients are not final yet
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.mem.add(flat)
        offsets = [0]
        for g in grads:
            offsets.append(offsets[-1] + g.numel())
        self.flight[i] = [self.comm.all_reduce_async(flat, b.group), flat, offsets, False]

    def _result(self, i: int, k: int, shape) -> torch.Tensor:
        f = self.flight[i]
        if not f[3]:
            f[0].wait()
            f[3] = True
        flat, offsets = f[1], f[2]
        return flat[offsets[k]:offsets[k + 1]].view(shape)
