"""ZB-V: zero bubble with two chunks per rank in a V (Qi et al., ICLR 2024, §6).

Invariants:
- Compute actions only (F, I, W); `comm.add_comm` adds SEND/RECV, given
  `stage_placement.StagePlacement.v(pp)`.
- vpp == 2, V placement: rank r runs stage r on the way down ("down") and
  stage 2*pp-1-r on the way back up ("up"). Rank pp-1 runs the turn
  (stages pp-1 and pp) with no transfer; rank 0 runs the first and the
  last stage.
- Every I is followed at once by its W, except in the cool-down, where W's
  are deferred to fill the bubble.
- Reproduces torch.distributed.pipelining's ScheduleZBVZeroBubble order
  exactly (tests/schedules/goldens/zero_bubble_orders.txt). With n = max(m,
  2*pp - 1) micro-batches (the pipeline full at least once):
  * warm-up: 2*(pp - r) - 1 forwards of down; r times (F up, F down);
    pp - r times (F up, I up, W up);
  * steady, while down has forwards left or up is behind down: F down (if
    any left), I down, W down, F up, I up, W up;
  * cool-down: r times (I down, I up); pp - r times (I down, W down); then
    the W's left, up's before down's;
  * the actions of micro-batches m..n-1 are dropped (m < 2*pp - 1).
- Bubble with unit F, I and W costs and free comm: see test_zero_bubble.py.

Diagram, pp=2 m=4, unit costs per F, I, W, free comm (simulated; `.` = idle):

DIAGRAM
"""

from __future__ import annotations

from collections import Counter

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType

F, I, W = ActionType.F, ActionType.I, ActionType.W  # noqa: E741


def schedule_zbv(pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Action]:
    """Rank `rank`'s ZB-V compute order (see the module docstring)."""
    if vpp != 2:
        raise ScheduleError(f"zbv places two stages per rank in a V, got vpp={vpp}; use --vpp 2")
    m, n = num_microbatches, max(num_microbatches, 2 * pp - 1)
    down, up = rank, 2 * pp - 1 - rank
    count: Counter[tuple[ActionType, int]] = Counter()  # actions emitted per (type, stage)
    out: list[Action] = []

    def run(*steps: tuple[ActionType, int]) -> None:
        for kind, stage in steps:
            out.append(Action(stage, kind, count[kind, stage]))
            count[kind, stage] += 1

    run(*[(F, down)] * (2 * (pp - rank) - 1))
    run(*[(F, up), (F, down)] * rank)
    run(*[(F, up), (I, up), (W, up)] * (pp - rank))
    while count[F, down] < n or count[F, up] < count[F, down]:
        if count[F, down] < n:
            run((F, down))
        run((I, down), (W, down), (F, up), (I, up), (W, up))
    run(*[(I, down), (I, up)] * rank)
    run(*[(I, down), (W, down)] * (pp - rank))
    run(*[(W, up)] * (count[I, up] - count[W, up]))
    run(*[(W, down)] * (count[I, down] - count[W, down]))
    return [a for a in out if a.microbatch < m]
