"""One rank's gradient buckets at run time (`lowering/buckets.py` forms them).

Invariants:
- `hooks(key)` are compiled into task group `key`'s function: after the op
  that makes a bucket's last value, the bucket starts (a STEP bucket only
  in the group's last run of the step, its last micro-batch; a
  per-micro-batch one in every run): its values are in one flat tensor
  (copied there; a STEP bucket's is kept from step to step), all-reduced
  (or all-gathered) in the background.
- A STEP all-reduce bucket's flat tensor is its gradient accumulators'
  second copy (`Bucket.slots`): from the second micro-batch on, each
  `accumulate_grad` whose result only the bucketed reduction reads adds
  into its slot of the flat tensor (the first micro-batch's gradient is
  adopted, as `ops.kernels.accumulate_grad` does; with one micro-batch it
  is copied in), so the bucket starts with no copy, and the accumulator,
  once the bucket starts, is reduced in place: nothing else reads it. As
  DDP's `gradient_as_bucket_view`.
- `kernel(op)` is the kernel of a bucketed op: it waits for its bucket
  (once) and returns its own slice of the flat result (a reduce-scatter,
  its part of it, in a storage of its own; an all-gather, its gathered
  tensor). It reads no argument: `segment_op` drops the argument of one
  `run_order` moves, so the value it reads dies at the bucket's start.
- A STEP reduction bucket's flat tensor counts in the rank's live bytes
  until the step ends; a per-micro-batch one's until its last slice is
  taken; an all-gather bucket's parts are `Comm`'s, gone once its last
  tensor is taken (uncounted, as ZeRO-3's gathered parts are).
- An all-gather bucket writes each gathered parameter into the parameter's
  own tensor where the executor gives one (`start_step`'s `into`), as the
  plan's layout has it (an update aliases its state).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from functools import partial

import torch

from meshplan.ir.kinds import ALL_GATHER, REDUCE_SCATTER
from meshplan.ops.kernels import accumulate_grad
from meshplan.runtime.bind import gathered_parts, narrower


class GradBuckets:
    def __init__(self, buckets, ctx, comm, mem):
        self.ctx, self.comm, self.mem = ctx, comm, mem
        self.buckets = buckets
        self.at = {op: (i, k) for i, b in enumerate(self.buckets) for k, op in enumerate(b.ops)}
        ops = ctx.view.op_of
        self.parts = {i: [gathered_parts(ops[op], ctx) for op in b.ops]  # (dim, shapes) each
                      for i, b in enumerate(buckets) if b.kind == ALL_GATHER}
        self.shapes = {i: [tuple(hi - lo for lo, hi in ctx.box(v)) for v in b.sources]
                       for i, b in enumerate(buckets)}
        self.offsets = {i: _offsets(shapes) for i, shapes in self.shapes.items()}
        self.slots = {op: (i, k) for i, b in enumerate(buckets)  # accumulate_grad op ->
                      for k, op in enumerate(b.slots) if op >= 0}  # (bucket, index)
        self.runs: Counter = Counter()
        self.flight: dict[int, list] = {}   # reduction buckets started
        self.flats: dict[int, torch.Tensor] = {}  # a STEP bucket's flat tensor, kept
        self.gathers: dict[int, list] = {}  # all-gather buckets started: [take, tensors left]
        self.microbatches = 0
        self.into = lambda vid: None

    def start_step(self, microbatches: int, into=None) -> None:
        """`into(value id)`: the tensor a gathered value is written into (None:
        a fresh one)."""
        self.microbatches = microbatches
        self.runs.clear()
        if into is not None:
            self.into = into

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
        """The kernel of reduction `op` if a bucket carries it, of
        `accumulate_grad` `op` if it writes a bucket's slot, else None."""
        if op.id in self.slots:
            return partial(self._accumulate, *self.slots[op.id])
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
            outs = [self.into(self.ctx.view.op_of[op].outputs[0]) for op in b.ops]
            self.gathers[i] = [self.comm.all_gather_many_async(grads, b.group, list(dims),
                                                               list(shapes), outs), len(b.ops)]
            return
        flat = self._flat(i, grads, keep=not b.every_run)
        self.mem.add(flat)
        # [work, flat, offsets, slices still to take (0: waited)]
        self.flight[i] = [self.comm.all_reduce_async(flat, b.group), flat, self.offsets[i], -1]

    def _accumulate(self, i: int, k: int, acc, g: torch.Tensor, **_) -> torch.Tensor:
        """`accumulate_grad(acc, g)` of bucket `i`'s `k`-th value, from the
        second micro-batch on (or the only one) into its slot."""
        if acc is None and self.runs[self.buckets[i].template] != self.microbatches:
            return accumulate_grad(acc, g)  # the first micro-batch's, adopted
        slot = self._slot(i, k, g)
        if acc is None:
            slot.copy_(g)
        elif acc.data_ptr() == slot.data_ptr():
            slot.add_(g)
        else:
            torch.add(acc, g, out=slot)
        return slot

    def _slot(self, i: int, k: int, like: torch.Tensor) -> torch.Tensor:
        flat = self._kept(i, like)
        return flat[self.offsets[i][k]:self.offsets[i][k + 1]].view(self.shapes[i][k])

    def _kept(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """STEP bucket `i`'s flat tensor, kept from step to step: a fresh
        26 MiB one cost a rank 10 ms of first-touch page faults a step here
        (GPT small, `benchmarks/sharded_dp.py`)."""
        flat = self.flats.get(i)
        if flat is None or flat.dtype != like.dtype or flat.device != like.device:
            flat = self.flats[i] = torch.empty(self.offsets[i][-1], dtype=like.dtype,
                                               device=like.device)
        return flat

    def _flat(self, i: int, grads: list, keep: bool) -> torch.Tensor:
        """`grads` end to end in one flat tensor: the kept one of a STEP
        bucket (copying only the values not already in their slots), else
        a fresh one."""
        assert [g.numel() for g in grads] == [math.prod(s) for s in self.shapes[i]], i
        if not keep:
            flat = torch.empty(self.offsets[i][-1], dtype=grads[0].dtype, device=grads[0].device)
            return torch.cat([g.reshape(-1) for g in grads], out=flat)
        flat = self._kept(i, grads[0])
        off, size = self.offsets[i], flat.element_size()
        away = [k for k, g in enumerate(grads) if g.data_ptr() != flat.data_ptr() + off[k] * size]
        if len(away) == len(grads):
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        else:
            for k in away:
                flat[off[k]:off[k + 1]].copy_(grads[k].reshape(-1))
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


def _offsets(shapes) -> list[int]:
    out = [0]
    for shape in shapes:
        out.append(out[-1] + math.prod(shape))
    return out
