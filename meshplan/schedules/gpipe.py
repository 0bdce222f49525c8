"""GPipe: every forward of the step, then every backward.

Invariants:
- Compute actions only (F, B); `sendrecv.add_comm` adds SEND/RECV.
- vpp == 1: stage r runs only virtual stage r.
- Backwards run in micro-batch order 0..m-1, like the forwards.
- Peak activation memory is m micro-batches on every stage (the price of the
  simple order); bubble ratio is (pp-1)/m with uniform costs.

Diagram, pp=4 m=4, unit costs, free comm (simulated; `.` = idle):

    time     0  1  2  3  4  5  6  7  8  9 10 11 12 13
    stage 0 F0 F1 F2 F3  .  .  .  .  .  . B0 B1 B2 B3
    stage 1  . F0 F1 F2 F3  .  .  .  . B0 B1 B2 B3  .
    stage 2  .  . F0 F1 F2 F3  .  . B0 B1 B2 B3  .  .
    stage 3  .  .  . F0 F1 F2 F3 B0 B1 B2 B3  .  .  .
"""

from __future__ import annotations

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType


def schedule_gpipe(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """Pipeline stage `stage`'s compute order: F0..F(m-1), then B0..B(m-1)."""
    if vpp != 1:
        raise ScheduleError(
            f"gpipe runs one virtual stage per stage but got vpp={vpp}; "
            f"use --vpp 1 or --schedule interleaved"
        )
    m = num_microbatches
    forwards = [Action(stage, ActionType.F, mb) for mb in range(m)]
    backwards = [Action(stage, ActionType.B, mb) for mb in range(m)]
    return forwards + backwards
