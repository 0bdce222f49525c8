"""Activation checkpointing: re-emit a region's forward ops inside its backward.

A region is a match of the recompute pattern on forward module paths
(`blocks.3` under `blocks\\.\\d+`: one region per layer). For a checkpointed
region, every backward op of the region that reads a forward value made in
the region reads a *clone* instead: the forward op re-emitted, just before
its first use, in the backward phase, with the original op's stage, chunk,
kernel variant and the original outputs' layouts. So the forward task keeps
only what crosses the region's boundary (its input), and the memory layout,
which keeps a forward value alive until its last reader, sees the saving.

Invariants:
- Clones read clones of their region's values and the originals of
  everything else (the region's input, parameters, other regions' values),
  so recomputation is bit-identical to the forward it repeats.
- `full` recomputes every forward op of a region; `selective` keeps the
  outputs of the expensive ops (matmuls, attention, convolutions) and of
  communication (`OpRule.recompute` is `OpRecompute.KEEP`), and recomputes the cheap
  ones between them.
- Cross-stage transfers are never cloned. A random op is cloned like any
  other: its numbers are a function of its key and where the step stands
  (`ops/random_ops.py`), so the clone draws the forward's mask again
  (capture refuses every draw from torch's generator, which a replay could
  not repeat).
- Ops keep their relative order; clones are inserted, never moved, so the
  graph stays topologically ordered and every `grad_of` points backward.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

from meshplan.errors import ConfigError
from meshplan.ir import Graph, Phase
from meshplan.ir.choices import OpRecompute, Recompute
from meshplan.ir.kinds import TRANSFER
from meshplan.ops.table import rule_for
from meshplan.passes.boxing import Boxed
from meshplan.passes.rebuild import Rebuild


def recompute(boxed: Boxed, mode: Recompute, pattern: str) -> Boxed:
    """`boxed` with the regions matching `pattern` checkpointed (`mode` full
    or selective); unchanged for mode none."""
    if mode == Recompute.NONE:
        return boxed
    g = boxed.graph
    region = _regions(g, pattern, mode)
    if not region:
        return boxed
    producer = g.producers()
    rb = Rebuild(g, source=boxed)
    clones: dict[tuple[str, int], int] = {}

    def value_for(vid: int, where: str) -> int:
        """The id a backward op of region `where` reads for forward value `vid`."""
        p = producer.get(vid)
        if p is None or region.get(p.id) != where:
            return vid
        key = (where, vid)
        if key not in clones:
            args, kwargs = p.remap(partial(value_for, where=where))
            outs = []
            for o in p.outputs:
                if o < 0:
                    outs.append(o)
                    continue
                outs.append(rb.new_value_like(o))
                clones[(where, o)] = outs[-1]
            rb.append(replace(p, id=len(rb.b.ops), args=args, kwargs=kwargs,
                              outputs=tuple(outs), phase=Phase.BACKWARD,
                              grad_of=rb.omap[p.id]),
                      (boxed.stage[p.id], boxed.chunk[p.id], boxed.variant[p.id]))
        return clones[key]

    rx = re.compile(pattern)
    for op in g.ops:
        where = _region_of(rx, op.module_path) if op.phase is Phase.BACKWARD else None
        rb.keep(op, None if where is None else [value_for(r, where) for r in op.refs()])
    stage, chunk, variant = rb.annotations()
    assert rb.sbp is not None  # a Rebuild with a source carries the SBP
    return Boxed(rb.build(g), stage, chunk, tuple(rb.sbp), variant)


def _region_of(rx: re.Pattern[str], path: str) -> str | None:
    m = rx.match(path)
    return m.group(0) if m and m.group(0) else None


def _regions(g: Graph, pattern: str, mode: Recompute) -> dict[int, str]:
    """Region of each recomputable forward op."""
    try:
        rx = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"recompute pattern '{pattern}' is not a valid regular expression "
                          f"({err}); fix --recompute-pattern, e.g. 'blocks\\.\\d+'") from err
    out: dict[int, str] = {}
    for op in g.ops:
        if op.phase is not Phase.FORWARD or op.kind == TRANSFER:
            continue
        where = _region_of(rx, op.module_path)
        policy = rule_for(op.kind).recompute
        if where is None or (mode == Recompute.SELECTIVE and policy is OpRecompute.KEEP):
            continue
        out[op.id] = where
    if not out and mode == Recompute.FULL:
        raise ConfigError(f"recompute pattern '{pattern}' matches no forward module path; "
                          "give --recompute-pattern a regex like 'blocks\\.\\d+'")
    return out

