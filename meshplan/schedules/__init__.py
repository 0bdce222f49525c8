"""Pipeline schedules as data: compute orders, one comm lowering, checks.

Invariants:
- A schedule is a pure function `(pp, vpp, num_microbatches, rank) ->
  list[Action]` of compute actions (F, B, I, W) only; every rank's order is
  built the same way on every rank, with no communication between them.
  Its stage-to-rank placement is `placement_of(name, pp, vpp)`.
- `sendrecv.add_comm` is the only place SEND/RECV actions are made.
- `validate.validate` and `simulate.simulate` check a lowered schedule
  without processes or torch.distributed.
- `compute_actions` is the checked entry point; `SCHEDULES` maps the
  `--schedule` names to the raw functions. The zero-bubble ones
  (`Schedule.splits_backward`) run I and W; the others B.
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.errors import ScheduleError
from meshplan.ir.choices import Schedule
from meshplan.ir.stage_placement import StagePlacement, placement_of
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.gpipe import schedule_gpipe
from meshplan.schedules.grid import format_grid
from meshplan.schedules.interleaved import schedule_interleaved
from meshplan.schedules.one_f_one_b import schedule_1f1b
from meshplan.schedules.sendrecv import Transfer, add_comm, chain_edges
from meshplan.schedules.simulate import SimResult, chrome_trace, simulate
from meshplan.schedules.validate import validate
from meshplan.schedules.zb1p import schedule_zb1p
from meshplan.schedules.zbv import schedule_zbv

ScheduleFn = Callable[[int, int, int, int], list[Action]]

SCHEDULES: dict[Schedule, ScheduleFn] = {
    Schedule.GPIPE: schedule_gpipe,
    Schedule.ONE_F_ONE_B: schedule_1f1b,
    Schedule.INTERLEAVED: schedule_interleaved,
    Schedule.ZB1P: schedule_zb1p,
    Schedule.ZBV: schedule_zbv,
}

__all__ = [
    "SCHEDULES", "Action", "ActionType", "SimResult",
    "StagePlacement", "Transfer", "add_comm", "chain_edges", "chrome_trace",
    "compute_actions", "format_grid", "placement_of", "simulate", "validate",
]


def compute_actions(name: Schedule | str, pp: int, vpp: int, num_microbatches: int,
                    rank: int) -> list[Action]:
    """Rank `rank`'s compute actions under schedule `name`, after checking the counts.

    `interleaved` with vpp == 1 returns the 1F1B order: torch's interleaved
    formula warms up 2*(pp-rank-1) forwards there instead of pp-rank-1 (see
    [Note: interleaved at vpp=1] in interleaved.py).
    """
    schedules = {str(k): f for k, f in SCHEDULES.items()}
    if name not in schedules:
        raise ScheduleError(f"unknown schedule {name!r}; use --schedule one of "
                            f"{', '.join(sorted(SCHEDULES))}")
    for label, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule {name}: {label} must be a positive integer, "
                                f"got {value!r}")
    if not isinstance(rank, int) or not 0 <= rank < pp:
        raise ScheduleError(f"schedule {name}: rank must be in 0..{pp - 1} for pp={pp}, "
                            f"got {rank!r}")
    if name == Schedule.INTERLEAVED and vpp == 1:
        schedule_interleaved(pp, vpp, num_microbatches, rank)  # same counts check
        return schedule_1f1b(pp, vpp, num_microbatches, rank)
    return schedules[name](pp, vpp, num_microbatches, rank)
