"""A stage's action list (every rank of the stage runs it): its schedule's
compute actions, the shared comm lowering for the Job's stage-crossing
transfers, and one STEP at the end (gradient reduction across dp and the
optimizer)."""

from __future__ import annotations

from meshplan.ir.mesh import Strategy
from meshplan.schedules import compute_actions, spec_of, stage_placement
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.sendrecv import add_comm


def stage_actions(strategy: Strategy, stage: int, edges) -> list[Action]:
    """Actions of the ranks of pipeline stage `stage`, in execution order."""
    s = strategy
    spec = spec_of(s.schedule)
    if spec.actions is None:  # the user's own orders
        compute = [Action.parse(text) for text in s.schedule_orders[stage]]
    else:
        # One stage: the schedule's `one_stage` form (1F1B: F0 B0 F1 B1 ...,
        # each micro-batch's activations freed before the next starts).
        name = spec.one_stage if s.pp == s.vpp == 1 and spec.one_stage else s.schedule
        compute = compute_actions(name, s.pp, s.vpp, s.num_microbatches, stage)
    lowered = add_comm({stage: compute}, s.pp, edges=list(edges),
                       placement=stage_placement(s))[stage]
    return list(lowered) + [Action(-1, ActionType.STEP, -1)]
