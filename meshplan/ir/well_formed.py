"""Structural checks of a `Graph` (assertions: internal errors only).

Where it runs, always: on the graph capture makes (and on one read back
from the capture cache) and on the train step autodiff builds. With checks
on (`checks=True`, as the tests pass it, or `MESHPLAN_CHECKS=1`), the pass
manager (`passes/manager.py`) runs it after every pass of the compile, and
`check_job_well_formed` on the Job once made; a failure names the pass. With checks
off the passes do not call it.

Invariant checked: SSA (each value defined once, before use), dense ids,
the loss is a scalar, updates name real values, and the step (its
OPTIMIZER ops) reads only the state (the graph's inputs, and the values
updates name: the gradient accumulators' last sums) and what the step itself
makes: it runs once, after every micro-batch's values are gone.
"""

from __future__ import annotations

from meshplan.ir.graph import ABSENT, Graph, Phase, Role


def check_well_formed(graph: Graph) -> None:
    """Assert the graph's structural invariants (internal errors only)."""
    for i, v in enumerate(graph.values):
        assert v.id == i, f"value id {v.id} at position {i}"
    defined: set[int] = set()
    per_microbatch: set[int] = set()  # what an op run per micro-batch made, not a state
    states = {u.value for u in graph.updates}
    for vid in graph.inputs:
        assert graph.values[vid].role is not Role.INTERNAL, f"input {vid} has no role"
        assert vid not in defined, f"input {vid} listed twice"
        defined.add(vid)
    for i, op in enumerate(graph.ops):
        assert op.id == i, f"op id {op.id} at position {i}"
        for r in op.refs():
            assert r in defined, f"op {op.id} {op.kind} reads {r} before it is defined"
            assert op.phase is not Phase.OPTIMIZER or r not in per_microbatch, \
                f"step op {op.id} {op.kind} reads {r}, a value made per micro-batch"
        for o in op.outputs:
            if o == ABSENT:
                continue
            assert o not in defined, f"value {o} defined twice (op {op.id} {op.kind})"
            defined.add(o)
            if op.phase is not Phase.OPTIMIZER and o not in states:
                per_microbatch.add(o)
        assert op.grad_of < op.id, f"op {op.id} is the gradient of a later op"
    assert graph.loss in defined, "loss value is never defined"
    assert graph.values[graph.loss].meta.shape == (), "loss is not a scalar"
    for u in graph.updates:
        assert u.value in defined, f"update {u.name} names undefined value {u.value}"
    for name, vid in graph.reports:
        assert vid in defined, f"report {name} names undefined value {vid}"
