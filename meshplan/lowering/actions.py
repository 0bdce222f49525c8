"""A rank's action list: its schedule's compute actions, the shared comm
lowering for the Job's stage-crossing transfers, and one STEP at the end
(gradient reduction across dp and the optimizer)."""

from __future__ import annotations

from meshplan.ir.choices import Schedule
from meshplan.ir.mesh import Strategy
from meshplan.schedules import compute_actions
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.sendrecv import add_comm


def rank_actions(strategy: Strategy, stage: int, edges) -> list[Action]:
    """Actions of the ranks of pipeline stage `stage`, in execution order."""
    s = strategy
    # One stage: 1F1B degenerates to F0 B0 F1 B1 ..., each micro-batch's
    # activations freed before the next starts.
    if s.schedule == Schedule.CSV:
        compute = [Action.parse(text) for text in s.schedule_orders[stage]]
    else:
        schedule = s.schedule if s.pp > 1 or s.vpp > 1 else Schedule.ONE_F_ONE_B
        compute = compute_actions(schedule, s.pp, s.vpp, s.num_microbatches, stage)
    lowered = add_comm({stage: compute}, s.pp, edges=list(edges),
                       placement=s.stage_placement)[stage]
    return list(lowered) + [Action(-1, ActionType.STEP, -1)]
