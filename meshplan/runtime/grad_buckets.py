"""One rank's gradient buckets at run time (`lowering/buckets.py` forms them).

Invariants:
- `hooks(key)` are compiled into task group `key`'s function: after the op
  that makes a bucket's last value, the bucket starts (a STEP bucket only
  in the group's last run of the step, its last micro-batch; a
  per-micro-batch one in every run): its values are copied into one flat
  tensor (a STEP bucket's kept from step to step), all-reduced (or
  all-gathered) in the background.
- `kernel(op)` is the kernel of a bucketed op: it waits for its bucket
  (once) and returns its own slice of the flat result (a reduce-scatter,
  its part of it, in a storage of its own; an all-gather, its gathered
  tensor). It reads no argument: `segment_op` drops the argument of one
  `run_order` moves, so the value it reads dies at the bucket's start.
- A STEP reduction bucket's flat tensor counts in the rank's live bytes
  until the step ends; a per-micro-batch one's until its last slice is
  taken; an all-gather bucket's parts are `Comm`'s, gone once its last
  tensor is taken (uncounted, as ZeRO-3's gathered parts are).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import partial

import torch

from meshplan.ir.kinds import ALL_GATHER, REDUCE_SCATTER
from meshplan.runtime.bind import gathered_parts, narrower


class GradBuckets:
    def __init__(self, buckets, ctx, comm, mem):
        self.ctx, self.comm, self.mem = ctx, comm, mem
        self.buckets = buckets
        self.at = {op: (i, k) for i, b in enumerate(self.buckets) for k, op in enumerate(b.ops)}
        ops = ctx.job.graph.ops
        self.parts = {i: [gathered_parts(ops[op], ctx) for op in b.ops]  # (dim, shapes) each
                      for i, b in enumerate(buckets) if b.kind == ALL_GATHER}
        self.runs: Counter = Counter()
        self.flight: dict[int, list] = {}   # reduction buckets started
        self.flats: dict[int, torch.Tensor] = {}  # a STEP bucket's flat tensor, kept
        self.gathers: dict[int, list] = {}  # all-gather buckets started: [take, tensors left]
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
        if op.kind == ALL_GATHER:
            return lambda *_, **__: self._gathered(*where)
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
        self.gathers.clear()

    def _gathered(self, i: int, k: int) -> torch.Tensor:
        g = self.gathers[i]
        g[1] -= 1
        if g[1] == 0:
            del self.gathers[i]
        return g[0](k)

    def _start(self, i: int, grads: list) -> None:
        b = self.buckets[i]
        if not b.every_run and self.runs[b.template] != self.microbatches:
            return  # not the last micro-batch: the gradients are not final yet
        if b.kind == ALL_GATHER:  # its parts live until its last tensor is taken
            dims, shapes = zip(*self.parts[i])
            self.gathers[i] = [self.comm.all_gather_many_async(grads, b.group, list(dims),
                                                               list(shapes)), len(b.ops)]
            return
        flat = self._flat(i, grads, keep=not b.every_run)
        self.mem.add(flat)
        offsets = [0]
        for g in grads:
            offsets.append(offsets[-1] + g.numel())
        # [work, flat, offsets, slices still to take (0: waited)]
        self.flight[i] = [self.comm.all_reduce_async(flat, b.group), flat, offsets, -1]

    def _flat(self, i: int, grads: list, keep: bool) -> torch.Tensor:
        """`grads` end to end in one flat tensor. A STEP bucket keeps its
        flat tensor from step to step (the memory plan counts it in the
        state arena): a fresh 26 MiB one cost a rank 10 ms of first-touch
        page faults a step here (GPT small, `benchmarks/sharded_dp.py`);
        nothing reads its slices after the STEP."""
        n = sum(g.numel() for g in grads)
        flat = self.flats.get(i)
        if flat is None or flat.numel() != n or flat.dtype != grads[0].dtype:
            flat = torch.empty(n, dtype=grads[0].dtype, device=grads[0].device)
            if keep:
                self.flats[i] = flat
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        return flat

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
