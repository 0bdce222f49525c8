"""Kernel workspace of the whole compile, worked out once by the master.

`kernel_temps` finds every distinct local signature that an op taking
workspace (`ops.temp.has_temp`) has on any rank of its stage, and asks the
op's rule once per signature. Ops are first grouped by everything a local
signature depends on (kind, logical argument metas and literals, layouts,
stage grid): a layer repeated 96 times is looked at once, and for it only
the distinct local shapes of its arguments are enumerated, not every grid
coordinate (`ir.sbp.distinct_local_shapes`). The result goes into the Job (`Job.temps`),
so that lowering a rank infers nothing (`lowering/memory.py` looks it up).
"""

from __future__ import annotations

from meshplan.ir import Graph, TensorMeta
from meshplan.ir.mesh import Strategy
from meshplan.ir.sbp import NdSbp, distinct_local_shapes
from meshplan.ops.infer import to_sig
from meshplan.ops.temp import has_temp, temp_bytes, temp_key


def kernel_temps(graph: Graph, stage: tuple[int, ...], sbp: tuple[NdSbp, ...],
                 strategy: Strategy) -> tuple[tuple[str, int], ...]:
    """(temp_key, bytes) for every distinct local signature, sorted by key."""
    values = graph.values
    seen: set = set()
    sigs: dict[str, tuple] = {}
    for op in graph.ops:
        if not has_temp(op.kind):
            continue
        grid = strategy.placement(stage[op.id]).grid
        refs = op.refs()
        logical = (op.kind, to_sig(op.args, lambda i: values[i].meta),
                   tuple(sbp[r] for r in refs), grid)
        if logical in seen:
            continue
        seen.add(logical)
        metas = [values[r].meta for r in refs]
        for shapes in distinct_local_shapes([(m.shape, sbp[r]) for m, r in zip(metas, refs)],
                                            grid):
            local = {r: TensorMeta(sh, m.dtype) for r, sh, m in zip(refs, shapes, metas)}
            sig = to_sig(op.args, local.__getitem__)
            sigs.setdefault(temp_key(op.kind, sig), (op.kind, sig))
    return tuple((key, temp_bytes(*sigs[key])) for key in sorted(sigs))
