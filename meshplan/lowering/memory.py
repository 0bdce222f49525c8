"""The memory layout: where each buffer lives, and the rank's planned peak.

Layout (two memory arenas):
- "state": parameters, module buffers, gradient accumulators and optimizer
  state, one block each, for the whole run. Values that update a state in
  place alias it and take no memory of their own.
- "activations": (a) saved values — those living from one action to another
  (a forward activation kept for its backward, a micro-batch's data) — get
  `copies` static slots per chunk, as many as the schedule keeps that chunk's
  micro-batches in flight; (b) transient values, living inside one action,
  are packed first-fit by liveness over the action's task order, and every
  action reuses that region.
Gradient buckets' flat tensors (`buckets.py`) of the STEP's reductions count
as gradient bytes, in the state arena, kept from step to step; those of the
other buckets (a
micro-batch's reduce-scatters at ZeRO 2 and 3, the STEP's all-gathers at 1
and 2, with what they gather) are transient activations, from their
bucket's start until their ops, moved there (`buckets.run_order`), take
their slices, and the values they copy die at that start.
Gradient accumulators count twice when a step has several micro-batches:
the first micro-batch's gradient is adopted as the accumulator, and the
second adds into a fresh tensor while the adopted one lives to the end of
that action (`ops.kernels.accumulate_grad`); for an accumulator written
into its bucket's slot (`buckets.writes_slot`) that second copy is the
bucket's flat tensor, counted once.
Kernel workspace ("temp") is the largest temp of any task, looked up by the
task's physical signature in the Job's `temps` (the master worked them out),
a ring attention's with its blocks and accumulators (`ring_bytes`), or of
any batched call of parameter updates (`_update_temp`: the clipped
gradients and torch's optimizer temporaries, on this device type); and on
top of it, as collectives run in the background, the workspace of the two
largest collective calls (`collective_temp`: an all-gather's parts and
the backend's own flat output, a reduce-scatter's all-reduced copy, an
all-to-all's flat tensors, what gloo's workers hold of a finished call).

Invariant: `peak` = the sum of the layout's extents, split by category:
param (incl. module buffers), grad, optimizer, activation, temp.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

from meshplan.ir import TensorMeta
from meshplan.ir.kinds import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER
from meshplan.lowering.buckets import bound, bucketed_bytes, flat_intervals, grad_buckets, run_order
from meshplan.lowering.prefetch import gather_groups, prefetched_bytes
from meshplan.lowering.rankplan import (
    STATE_CATEGORIES,
    Block,
    BufferCategory,
    MemoryLayout,
    TaskKind,
    line_axis,
)
from meshplan.ops.infer import to_sig
from meshplan.ops.routed_experts import ROUTED
from meshplan.ops.table import rule_for
from meshplan.ops.temp import has_temp, temp_key


def _first_fit(intervals: list[tuple[int, int, int, int]]) -> tuple[dict[int, int], int]:
    """Offsets for (key, start, end, size) intervals; returns ({key: offset}, extent).

    Simulates a first-fit allocator over the intervals' alloc/free events:
    freed ranges become holes (merged with their neighbours), an allocation
    takes the lowest hole that fits, else grows the top. Holes stay few, so
    this is near-linear where a pairwise interval scan is quadratic."""
    frees: list[tuple[int, int, int]] = []  # heap of (end, offset, size)
    holes: list[list[int]] = []             # sorted [offset, size]
    offsets, top = {}, 0
    for key, start, end, size in sorted(intervals, key=lambda x: (x[1], -x[3], x[0])):
        while frees and frees[0][0] <= start:
            _, freed, sz = heapq.heappop(frees)
            top = _release(holes, freed, sz, top)
        hole = _take(holes, size)
        if hole is None:
            off, top = top, top + size
        else:
            off = hole
        offsets[key] = off
        heapq.heappush(frees, (end, off, size))
    extent = max((offsets[k] + sz for k, _, _, sz in intervals), default=0)
    return offsets, extent


def _take(holes: list[list[int]], size: int) -> int | None:
    for i, (off, sz) in enumerate(holes):
        if sz >= size:
            if sz == size:
                holes.pop(i)
            else:
                holes[i] = [off + size, sz - size]
            return off
    return None


def _release(holes: list[list[int]], off: int, size: int, top: int) -> int:
    """Return [off, off+size) to the free list; returns the new top."""
    i = bisect.bisect_left(holes, [off, size])
    holes.insert(i, [off, size])
    if i + 1 < len(holes) and holes[i][0] + holes[i][1] == holes[i + 1][0]:
        holes[i][1] += holes.pop(i + 1)[1]
    if i > 0 and holes[i - 1][0] + holes[i - 1][1] == holes[i][0]:
        holes[i - 1][1] += holes.pop(i)[1]
        i -= 1
    if holes[i][0] + holes[i][1] == top:  # the top hole shrinks the arena
        top = holes.pop(i)[0]
    return top


def memory_layout(low, buffers) -> MemoryLayout:
    """Blocks for every buffer, and the planned peak by category."""
    updates = low.view.updates
    blocks, arenas = [], []
    peak: dict[str, int] = {}
    state_arena, act_arena = low.next_id(), low.next_id()
    off = 0
    for b in buffers:
        if b.category in STATE_CATEGORIES:
            blocks.append(Block(low.next_id(), state_arena, off, b.nbytes, (b.id,)))
            off += b.nbytes
            key = BufferCategory.PARAM if b.category == BufferCategory.BUFFER else b.category
            peak[key] = peak.get(key, 0) + b.nbytes
    if low.view.strategy.num_microbatches > 1 and "grad" in peak:
        off += peak["grad"]  # room for the second copy (no buffer of its own)
        peak["grad"] *= 2
    flat, in_place = bucketed_bytes(low.op_of.__getitem__, low.tasks, buffers,
                                    low.view.strategy)
    if flat:  # gradient buckets' flat copies, kept: the second copy of those written there
        off += flat - in_place
        peak["grad"] = peak.get("grad", 0) + flat - in_place
    arenas.append((state_arena, "state", off))
    saved = [b for b in buffers if b.category == BufferCategory.DATA or (
        b.category not in STATE_CATEGORIES and b.value not in updates and b.copies > 1)]
    saved_ids = {b.id for b in saved}
    off = 0
    for b in sorted(saved, key=lambda x: x.id):
        size = b.nbytes * b.copies
        blocks.append(Block(low.next_id(), act_arena, off, size, (b.id,)))
        off += size
    saved_extent = off
    transient = [b for b in buffers if b.category == BufferCategory.ACTIVATION
                 and b.id not in saved_ids and b.value not in updates]
    by_value = {b.value: b for b in buffers}
    buckets = grad_buckets(low.tasks, low.op_of.__getitem__, low.view.values, {},
                           bound(low.view.strategy), lambda v: by_value[v].nbytes) \
        if bound(low.view.strategy) else ()
    intervals, flats, ran = _intervals(low, buffers, transient, buckets)
    offsets, extent = _first_fit(intervals)
    for b in transient:
        blocks.append(Block(low.next_id(), act_arena, saved_extent + offsets[b.id], b.nbytes,
                            (b.id,)))
    for key, size, ids in flats:  # a per-micro-batch gradient bucket's flat copy
        blocks.append(Block(low.next_id(), act_arena, saved_extent + offsets[key], size, ids))
    # ZeRO-3: this and the next layer's gathered parameters (`prefetch.py`)
    ahead = prefetched_bytes(low.tasks, low.op_of.__getitem__, low.view.values,
                             low.view.strategy.layer_pattern, _padded(low, buffers)) \
        if low.view.strategy.zero.regathers else 0
    peak["activation"] = saved_extent + extent + ahead
    arenas.append((act_arena, "activations", saved_extent + extent + ahead))
    # collectives run in the background, beside any kernel's workspace
    peak["temp"] = max(_temp(low), _update_temp(low, ran)) + collective_temp(
        low.tasks, low.op_of, low.view.values, low.view.strategy, by_value, buckets)
    for k in ("param", "grad", "optimizer", "activation", "temp"):
        peak.setdefault(k, 0)
    total = sum(peak.values())
    order = ("param", "grad", "optimizer", "activation", "temp")
    return MemoryLayout(tuple(arenas), tuple(blocks),
                      tuple((k, peak[k]) for k in order) + (("total", total),))


def _intervals(low, buffers, transient, buckets) -> tuple[list[tuple[int, int, int, int]],
                                                          list, list]:
    """(buffer id, first task index, last task index + 1, bytes) of transient
    buffers, over the order the runtime runs the tasks in (per-micro-batch
    gradient buckets move their reductions: `buckets.run_order`); and of
    those buckets' flat copies (keys -1, -2, ...), with (key, bytes, the
    buffer ids they copy); and that order. A value a bucket copies dies at
    its start."""
    by_value = {b.value: b for b in buffers}
    order = run_order(low.tasks, buckets, low.op_of.__getitem__)
    index = {t.id: i for i, t in enumerate(order)}
    out: list[tuple[int, int, int, int]] = []
    flats: list[tuple[int, int, tuple[int, ...]]] = []
    copied: dict[int, int] = {}  # buffer id -> its bucket's start
    for k, (start, end, bucket) in enumerate(flat_intervals(low.tasks, buckets, index)):
        ids = tuple(by_value[v].id for v in bucket.sources)
        size = sum(by_value[v].nbytes for v in bucket.sources)  # the flat copy
        if bucket.kind == ALL_GATHER:  # and what it gathers, each part padded
            size += sum(_gathered(by_value, low.op_of[o], len(bucket.group)) for o in bucket.ops)
        out.append((-1 - k, start, end, size))
        flats.append((-1 - k, size, ids))
        copied.update((i, start) for i in ids)
    for b in transient:
        uses = [index[t] for t in b.producers + b.consumers if t in index]
        if b.id in copied:
            uses = [index[t] for t in b.producers if t in index] + [copied[b.id]]
        if uses:
            out.append((b.id, min(uses), max(uses) + 1, b.nbytes))
    return out, flats, order


def _padded(low, buffers):
    """A gather task's bytes as they travel: each member's part padded to the
    largest (`Comm.all_gather_many_async`)."""
    by_value = {b.value: b for b in buffers}

    def nbytes(t) -> int:
        return _gathered(by_value, low.op_of[t.op], len(t.group))
    return nbytes


def _gathered(by_value: dict, op, members: int) -> int:
    """All-gather `op`'s gathered bytes over `members`, each part padded."""
    b = by_value[op.outputs[0]]
    rows = b.shape[dict(op.kwargs)["dim"]]
    return b.nbytes // rows * (-(-rows // members) * members) if rows else 0


def _temp(low) -> int:
    """The largest kernel workspace of any task on this rank (a ring
    attention's: its kernel's, and its own blocks and accumulators; routed
    experts': their rows at the worst case)."""
    best = 0
    for t in low.tasks:
        op = low.op_of[t.op]
        inside = line_axis(t.variant)
        if t.kind.value != "compute" or not (inside is not None or has_temp(op.kind)
                                             or op.kind in ROUTED):
            continue
        sig = _local_sig(low, op)
        own = low.view.temps[temp_key(op.kind, sig)] if has_temp(op.kind) else 0
        if op.kind in ROUTED:
            own += expert_rows_bytes(op, sig, 1 if inside is None else len(t.group))
        elif inside is not None:
            own += ring_bytes(op, sig)
        best = max(best, own)
    return best


def collective_temp(tasks, op_of, values, strategy, by_value: dict, buckets,
                    keep=None) -> int:
    """The workspace of the collective calls in flight at once
    (`runtime/comm.py`), beyond the values and flat copies the layout holds:
    - an all-gather's: the backend's own flat output of all it gathers
      (gloo's and NCCL's list all-gathers gather into one, then copy out),
      and, for a gather in no bucket, the members' parts it is joined from
      and this rank's padded part; a ZeRO-3 layer's prefetched gathers are
      one call, whose parts `prefetched_bytes` counts;
    - a reduce-scatter's: the all-reduced copy of its whole input;
    - an all-reduce's: its output, which the finished call holds until the
      backend's worker thread lets go of it, maybe past its last use; so a
      per-micro-batch reduction bucket's flat tensor;
    - an all-to-all's: the flat tensor sent and the one received.
    Gloo's two worker threads each hold one call, running or just finished
    (a finished one until the worker lets go of it, maybe into the next
    action), so the two largest of the rank count. `keep(task)`: only the
    collective tasks it keeps (the search's probes: those not over dp).
    `op_of`, `values`: op and value by id; `by_value`: buffer by value."""
    layers = [g for gs in gather_groups(tasks, op_of.__getitem__, values,
                                        strategy.layer_pattern).values() for g in gs] \
        if strategy.zero.regathers else []
    if keep is not None:
        layers = [g for g in layers if keep(g[0])]
    prefetched = {t.id for g in layers for t in g}
    bucketed = {op for b in buckets for op in b.ops}
    sizes: list[int] = []
    for b in buckets:
        if b.kind == ALL_GATHER:
            sizes.append(sum(_gathered(by_value, op_of[o], len(b.group)) for o in b.ops))
        elif b.every_run:  # its flat tensor, held by the finished call past its last slice
            sizes.append(sum(by_value[v].nbytes for v in b.sources))
    for g in layers:
        gathered = sum(_gathered(by_value, op_of[t.op], len(t.group)) for t in g)
        sizes.append(gathered + gathered // len(g[0].group))
    for t in tasks:
        op = op_of[t.op]
        if t.kind not in (TaskKind.COLLECTIVE, TaskKind.GRAD_REDUCE) or len(t.group) < 2 \
                or t.op in bucketed or t.id in prefetched or (keep is not None and not keep(t)):
            continue
        if op.kind == ALL_GATHER:
            gathered = _gathered(by_value, op, len(t.group))
            sizes.append(2 * gathered + gathered // len(t.group))
        elif op.kind == REDUCE_SCATTER:
            sizes.append(by_value[op.args[0].id].nbytes)
        elif op.kind == ALL_REDUCE:  # its output, held a moment past its last use
            sizes.append(by_value[op.outputs[0]].nbytes)
        elif op.kind == ALL_TO_ALL:
            sizes.append(by_value[op.args[0].id].nbytes + by_value[op.outputs[0]].nbytes)
    return sum(heapq.nlargest(2, sizes))


def _update_temp(low, order) -> int:
    """The largest workspace of one batched call of parameter updates
    (`OpRule.batched_temp`), per maximal run of the rank's update ops of one
    kind and equal literals in the order they run, other ops left out:
    each group the executor batches (`codegen.batch_groups`) is part of one."""
    best = 0
    ups = [op for op in (low.op_of[t.op] for t in order)
           if rule_for(op.kind).batched_temp is not None]
    for _, group in itertools.groupby(ups, key=lambda op: (op.kind, op.kwargs)):
        run = list(group)
        workspace = rule_for(run[0].kind).batched_temp
        assert workspace is not None
        best = max(best, workspace([_local_sig(low, op) for op in run], dict(run[0].kwargs),
                                   low.device))
    return best


def _local_sig(low, op) -> tuple:
    """`op`'s argument signature on this rank: its buffers' local shapes."""
    values = low.view.values
    return to_sig(op.args, lambda i: TensorMeta(low.bufs[i].shape, values[i].meta.dtype))


def expert_rows_bytes(op, sig, members: int) -> int:
    """Routed experts' own buffers (`ops/routed_experts.py`,
    `runtime/expert_dispatch.py`) at the worst case, every row of the
    line's `members` ranks choosing this rank's experts (dropless: no
    capacity bounds them): the rank's sorted rows and what comes back; the
    arriving rows, their experts' hidden values (in, gated) and outputs; in
    the backward also the gradients' rows and the recomputed values'
    gradients."""
    x, idx, w_in = sig[0], sig[1], sig[3]
    rows, h = math.prod(idx.shape), x.shape[-1]
    hidden = math.prod(w_in.shape) // w_in.shape[0] // h  # 2I
    arrive = members * rows
    backward = len(op.outputs) == 4
    per_row = (6 * h + 3 * hidden + 2) if backward else (3 * h + 3 * hidden // 2)
    mine = rows * (3 * h + 1 if backward else 2 * h)
    return (arrive * per_row + mine) * x.dtype.itemsize


def ring_bytes(op, sig) -> int:
    """A ring attention's own buffers (`runtime/ring_attention.py`): the
    keys' and values' block held and the one arriving; its fp32
    accumulators: the rows' output and log-sum-exp, or the backward's query
    gradients and the travelling key and value gradients, held and arriving."""
    backward = len(op.outputs) == 3
    q, k = (sig[1], sig[2]) if backward else (sig[0], sig[1])
    qn, kn = math.prod(q.shape), math.prod(k.shape)
    blocks = 4 * kn * k.dtype.itemsize
    return blocks + 4 * (qn + 4 * kn if backward else qn + qn // q.shape[-1])
