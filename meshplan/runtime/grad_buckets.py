"""One rank's gradient buckets at run time (`lowering/buckets.py` forms them).

Invariants:
- `hooks(key)` are compiled into task group `key`'s function: after the op
  that makes a bucket's last value, the bucket starts (a STEP bucket only
  in the group's last run of the step, its last micro-batch; a
  per-micro-batch one in every run): its values are copied into one flat
  tensor, all-reduced in the background.
- `kernel(op)` is the kernel of a bucketed reduction: it waits for its
  bucket (once) and returns its own slice of the flat result (a
  reduce-scatter, its part of it, in a storage of its own). It reads no
  argument: `segment_op` drops a per-micro-batch reduction's, so the value
  it reduces dies at the bucket's start, not at the reduction.
- A STEP bucket's flat tensor counts in the rank's live bytes until the
  step ends; a per-micro-batch one's until its last slice is taken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
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

    def segment_op(self, op):
        """`op` as its task group's function runs it: a per-micro-batch
        bucketed reduction reads nothing (its bucket has the value)."""
        where = self.at.get(op.id)
        return replace(op, args=()) if where and self.buckets[where[0]].every_run else op

    def kernel(self, op):
        """The kernel of reduction `op` if a bucket carries it, else None."""
        where = self.at.get(op.id)
        if where is None:
            return None
        src = op.args[0].id
        shape = tuple(b - a for a, b in self.ctx.box(src))
        cut = narrower(self.ctx, src, op.outputs[0]) if op.kind == REDUCE_SCATTER else None

        def from_bucket(*_, **__):
            out = self._result(*where, shape)
            return cut(out) if cut is not None else out
        return from_bucket

    def end_step(self) -> None:
        for _, flat, _, _ in self.flight.values():
            self.mem.drop(flat)
        self.flight.clear()

    def _start(self, i: int, grads: list) -> None:
        b = self.buckets[i]
        if not b.every_run and self.runs[b.template] != self.microbatches:
            return  # not the last micro-batch: the gradients are not final yet
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.mem.add(flat)
        offsets = [0]
        for g in grads:
            offsets.append(offsets[-1] + g.numel())
        # [work, flat, offsets, slices still to take (0: waited)]
        self.flight[i] = [self.comm.all_reduce_async(flat, b.group), flat, offsets, -1]

    def _result(self, i: int, k: int, shape) -> torch.Tensor:
        f = self.flight[i]
        if f[3] < 0:
            f[0].wait()
            f[3] = len(self.buckets[i].ops)
        flat, offsets = f[1], f[2]
        out = flat[offsets[k]:offsets[k + 1]].view(shape)
        f[3] -= 1
        if f[3] == 0 and self.buckets[i].every_run:  # its last slice: the flat copy goes
            del self.flight[i]
            self.mem.drop(flat)
        return out
