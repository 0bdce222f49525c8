"""Uneven pipeline stages by cost: layers per virtual stage that balance the
stages' work, counting the embedding, the head and the loss.

Invariants:
- `balance(weights, k)` cuts the layers (weights in model order) into `k`
  contiguous non-empty segments whose heaviest is as light as possible
  (exact: a binary search over the achievable segment sums, each checked
  greedily); among the layouts with that bound it takes the one a left-to-
  right fill gives while leaving a layer for every later segment. Equal
  weights that divide evenly give equal segments.
- A rank of an interleaved or V placement holds `vpp` segments, so its
  load is at most `vpp` times the bound; the segments, not the ranks, are
  balanced (the simulator then prices the ranks).
- `graph_layer_weights` prices each layer's forward ops on the logical
  (unsplit) shapes with the op cost model; forward ops before the first
  layer count with it, those after the last with the last, as the pipeline
  pass places them (`pipeline.find_layers`). tp and dp scale every layer
  alike, so the logical shapes balance as well as the physical ones.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase
from meshplan.ops.cost import bytes_moved
from meshplan.ops.infer import to_sig
from meshplan.ops.table import rule_for
from meshplan.passes.pipeline import find_layers

# A CPU-class default for the relative cost of flops and bytes (FLOP/s, bytes/s)
FLOPS, BYTES = 5e10, 1e10


def balance(weights: Sequence[float], k: int) -> tuple[int, ...]:
    """Layers per segment: `k` contiguous segments of `weights`, the heaviest
    as light as possible."""
    n = len(weights)
    if not 1 <= k <= n:
        raise ConfigError(f"{n} layers cannot fill {k} pipeline segments (pp*vpp); lower pp "
                          f"or vpp so that pp*vpp <= {n}")
    prefix = list(itertools.accumulate(weights, initial=0.0))
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect.bisect_left(sums, max(weights))
    hi = len(sums) - 1
    while lo < hi:  # the least achievable bound
        mid = (lo + hi) // 2
        if _segments_needed(weights, sums[mid]) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _fill(weights, k, sums[lo])


def _segments_needed(weights: Sequence[float], bound: float) -> int:
    count, load = 1, 0.0
    for w in weights:
        if load + w > bound * (1 + 1e-12):
            count, load = count + 1, 0.0
        load += w
    return count


def _fill(weights: Sequence[float], k: int, bound: float) -> tuple[int, ...]:
    out, i, n = [], 0, len(weights)
    for seg in range(k):
        left = k - seg - 1  # segments after this one, each needs a layer
        take, load = 0, 0.0
        while i + take < n - left and (take == 0 or load + weights[i + take]
                                       <= bound * (1 + 1e-12)):
            load += weights[i + take]
            take += 1
        # a layout within the bound exists, so what is left fits the rest
        out.append(take)
        i += take
    assert i == n and min(out) >= 1, (out, n)
    return tuple(out)


def graph_layer_weights(graph: Graph, layer_pattern: str) -> list[float]:
    """Seconds of each layer's forward ops (plus the ops around the layers),
    on the CPU-class default rates."""
    layers, op_layer = find_layers(graph, layer_pattern)
    weights = [0.0] * len(layers)
    values = graph.values
    for op in graph.ops:
        if op.phase is not Phase.FORWARD:
            continue
        sig = to_sig(op.args, lambda i: values[i].meta)
        outs = tuple(values[o].meta for o in op.outputs if o >= 0)
        fl = rule_for(op.kind).flops
        flops = fl(sig) if fl is not None else 0.0
        weights[op_layer.get(op.id, 0)] += max(flops / FLOPS, bytes_moved(sig, outs) / BYTES)
    return weights
