"""ZeRO-3's parameter all-gathers, grouped by layer for prefetching.

Invariants:
- A prefetchable gather is an all-gather (over a grid axis) of a parameter
  read from the state: a ZeRO-3 parameter gathered for its use. Within one
  task group (a chunk's forward, backward or weight phase) they form groups
  of consecutive gathers of one layer: the instance of the strategy's layer
  pattern their module path names, else their module path.
- The runtime (`runtime/gather_prefetch.py`) starts layer j+1's gathers,
  as one collective, when layer j's first one is needed, so at most two
  layers' gathered flat tensors are alive beyond what the task order alone
  keeps; the memory layout counts the most two consecutive layers' take
  (`prefetched_bytes`).
"""

from __future__ import annotations

import re
from collections import defaultdict

from meshplan.ir import Role
from meshplan.ir.kinds import ALL_GATHER
from meshplan.ir.mesh import DERIVED
from meshplan.lowering.rankplan import TaskKind, template_of


def gather_groups(tasks, op_of, values, layer_pattern: str) -> dict[tuple, list[list]]:
    """{task group: [[gather task, ...] per layer, in task order]}."""
    rx = re.compile(layer_pattern) if layer_pattern and layer_pattern != DERIVED else None
    out: dict[tuple, list[list]] = defaultdict(list)
    last: dict[tuple, str] = {}
    for t in tasks:
        op = op_of(t.op)
        if t.kind is not TaskKind.COLLECTIVE or op.kind != ALL_GATHER or \
                values[op.args[0].id].role is not Role.PARAM:
            continue
        key = template_of(t)
        m = rx.match(op.module_path) if rx else None
        layer = m.group(0) if m and m.group(0) else op.module_path
        if last.get(key) != layer:
            out[key].append([])
            last[key] = layer
        out[key][-1].append(t)
    return out


def prefetched_bytes(tasks, op_of, values, layer_pattern: str, nbytes) -> int:
    """What prefetching keeps alive beyond the task order's own count of the
    gathered parameters (`nbytes(task)`: a gather's bytes as it travels,
    padded): when layer j's first gather is taken, layer j's gathered flat
    tensors (alive until its last parameter is taken) and layer j+1's,
    started then; the most of that over consecutive layers."""
    groups = gather_groups(tasks, op_of, values, layer_pattern)
    most = 0
    for gs in groups.values():
        sizes = [sum(nbytes(t) for t in g) for g in gs] + [0]
        most = max([most] + [a + b for a, b in zip(sizes, sizes[1:])])
    return most
