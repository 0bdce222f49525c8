"""ZeRO-3: each layer's parameter all-gathers started one layer ahead.

Invariants:
- `kernel(task)` replaces a prefetchable gather's kernel
  (the plan's `gathers`: `lowering/prefetch.py` groups them by layer
  within a task group): when
  layer j's first gather is needed, layers j and j+1, if not yet started,
  are started asynchronously from the parameter shards in the state, each
  as one collective (per group and dtype: `Comm.all_gather_many_async`,
  as FSDP2 gathers a block), then the kernel waits for it and takes its
  own tensor. Forward and backward alike, so the next layer's
  communication overlaps this layer's compute. A layer's gathered flat
  tensors live until its last parameter is taken.
- A task group's gathers run in its own order in each of its runs; a run
  starts with its first gather, which forgets what an earlier run left.
- Every rank of a dp group starts the same gathers in the same order.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from meshplan.runtime.bind import gathered_parts


class GatherPrefetch:
    def __init__(self, plan, ctx, comm, names: dict):
        self.comm = comm
        self.state: dict = {}
        self.order: dict[int, tuple] = {}      # gather op -> (template, index)
        self.items: dict[tuple, list] = {}     # template -> [(op, layer index)]
        for key, layers in plan.gathers:  # lowered: `lowering/prefetch.py`
            self.items[key] = [(op, j) for j, layer in enumerate(layers) for op in layer]
            for i, (op, _) in enumerate(self.items[key]):
                self.order[op] = (key, i)
        self.start_of: dict[tuple, int] = {}  # (template, layer) -> index of its first gather
        for key, items in self.items.items():
            for i, (_, j) in enumerate(items):
                self.start_of.setdefault((key, j), i)
        self.args: dict[int, tuple] = {}  # gather op -> (state name, group, dim, shapes)
        self.ctx, self.names = ctx, names
        self.flight: dict[int, Callable] = {}  # gather op -> the call that gives its tensor
        self.started: set[int] = set()          # layers started in this run

    def kernel(self, task):
        """The kernel of `task` if it is a prefetched gather, else None."""
        where = self.order.get(task.op)
        if where is None:
            return None
        op = self.ctx.view.op_of[task.op]
        dim, shapes = gathered_parts(op, self.ctx)
        self.args[task.op] = (self.names[op.args[0].id], task.group, dim, shapes)
        key, index = where
        return lambda x, **_: self._take(key, index)

    def start_step(self, state: dict) -> None:
        self.state = state

    def _take(self, key, index: int):
        items = self.items[key]
        if index == 0:  # a new run of this task group
            self.flight.clear()
            self.started.clear()
        layer = items[index][1]
        for j in (layer, layer + 1):
            if j not in self.started and (key, j) in self.start_of:
                self.started.add(j)
                self._start(key, j)
        return self.flight.pop(items[index][0])()

    def _start(self, key, layer: int) -> None:
        """Layer `layer`'s gathers, one collective per group and dtype."""
        items = self.items[key]
        end = self.start_of.get((key, layer + 1), len(items))
        together: dict[tuple, list[int]] = {}
        for op, _ in items[self.start_of[(key, layer)]:end]:
            name, group, _, _ = self.args[op]
            together.setdefault((group, self.state[name].dtype), []).append(op)
        for (group, _), ops in together.items():
            args = [self.args[op] for op in ops]
            take = self.comm.all_gather_many_async([self.state[a[0]] for a in args], group,
                                                   [a[2] for a in args], [a[3] for a in args])
            for k, op in enumerate(ops):
                self.flight[op] = partial(take, k)
