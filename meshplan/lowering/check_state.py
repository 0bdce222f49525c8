"""Proof 9 of `lowering/check.py`: every state a rank writes rests where it is read.

A state (parameter, buffer, gradient accumulator, optimizer slot) is read
at its input's buffer and written back from its update's value. Proven on
each rank's plan: where a rank holds both, the update's buffer has the
state buffer's local shape and dtype, so the next micro-batch and the next
step read the same part of the tensor that this one wrote. (A gradient
accumulator laid out by one use and written by another in a different
layout failed this: the write was a tp shard of a state held whole.)
"""

from __future__ import annotations


def states_rest(job, plans) -> list[str]:
    """Errors of proof 9 (empty when every update fits its state)."""
    g = job.graph
    state = {g.values[v].name: v for v in g.inputs}
    errors: list[str] = []
    for r, p in sorted(plans.items()):
        held = {b.value: b for b in p.buffers}
        for u in g.updates:
            old, new = held.get(state.get(u.name, -1)), held.get(u.value)
            if old is None or new is None or (old.shape, old.dtype) == (new.shape, new.dtype):
                continue
            errors.append(f"rank {r}: state '{u.name}' rests as {list(old.shape)} "
                          f"{old.dtype.name} but its update (value {u.value}) writes "
                          f"{list(new.shape)} {new.dtype.name}; recompile the plan")
            break
    return errors
