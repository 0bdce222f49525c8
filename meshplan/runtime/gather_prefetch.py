"""ZeRO-3: each layer's parameter all-gathers started one layer ahead.

Invariants:
- `kernel(task)` replaces a prefetchable gather's kernel
  (`lowering/prefetch.py` groups them by layer within a task group): when
  layer j's first gather is needed, every gather of layers j and j+1 not
  yet started is started asynchronously from the parameter shards in the
  state, then the kernel waits for its own. Forward and backward alike, so
  the next layer's communication overlaps this layer's compute.
- A task group's gathers run in its own order in each of its runs; a run
  starts with its first gather, which forgets what an earlier run left.
- Every rank of a dp group starts the same gathers in the same order.
"""

from __future__ import annotations

from meshplan.lowering.prefetch import gather_groups


class GatherPrefetch:
    def __init__(self, job, plan, ctx, comm, names: dict):
        self.comm, self.state = comm, {}
        values = job.graph.values
        self.order: dict[int, tuple] = {}      # gather op -> (template, index)
        self.items: dict[tuple, list] = {}     # template -> [(op, layer index)]
        groups = gather_groups(plan.tasks, job.graph.ops.__getitem__, values,
                               job.strategy.layer_pattern)
        for key, layers in groups.items():
            self.items[key] = [(t.op, j) for j, layer in enumerate(layers) for t in layer]
            for i, (op, _) in enumerate(self.items[key]):
                self.order[op] = (key, i)
        self.start_of = {}  # (template, layer) -> index of its first gather
        for key, items in self.items.items():
            for i, (_, j) in enumerate(items):
                self.start_of.setdefault((key, j), i)
        self.args = {}      # gather op -> (state name, group, dim, shapes)
        self.ctx, self.names, self.job = ctx, names, job
        self.flight: dict[int, object] = {}

    def kernel(self, task):
        """The kernel of `task` if it is a prefetched gather, else None."""
        where = self.order.get(task.op)
        if where is None:
            return None
        op = self.job.graph.ops[task.op]
        src, axis = op.args[0].id, dict(op.kwargs)["axis"]
        shapes = [tuple(b - a for a, b in self.ctx.box(src, c)) for c in self.ctx.along(axis)]
        self.args[task.op] = (self.names[src], task.group, dict(op.kwargs)["dim"], shapes)
        key, index = where
        return lambda x, **_: self._take(key, index)

    def start_step(self, state: dict) -> None:
        self.state = state

    def _take(self, key, index: int):
        items = self.items[key]
        if index == 0:
            self.flight.clear()  # a new run of this task group
        layer = items[index][1]
        end = self.start_of.get((key, layer + 2), len(items))
        for i in range(index, end):
            op = items[i][0]
            if op not in self.flight:
                name, group, dim, shapes = self.args[op]
                self.flight[op] = self.comm.all_gather_async(self.state[name], group, dim,
                                                             shapes)
        return self.flight.pop(items[index][0])()
