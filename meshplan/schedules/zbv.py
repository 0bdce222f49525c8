"""ZB-V: zero bubble with two chunks per stage in a V (Qi et al., ICLR 2024, §6).

Invariants:
- Compute actions only (F, I, W); `sendrecv.add_comm` adds SEND/RECV, given
  `stage_placement.StagePlacement.v(pp)`.
- vpp == 2, V placement: stage r runs virtual stage r on the way down
  ("down") and 2*pp-1-r on the way back up ("up"). Stage pp-1 runs the
  turn (virtual stages pp-1 and pp) with no transfer; stage 0 runs the
  first and the last virtual stage.
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
- Bubble ratio with unit F, I and W costs and free comm: (pp-1)/(6m), the
  least possible (stage pp-1 waits pp-1 units for its first input, then
  never idles), for m >= 3*pp // 2; above it for fewer micro-batches.
  Measured exactly on pp in 1..8, m in 1..4pp+2
  (tests/schedules/test_zero_bubble.py). So at unit costs ZB-V is no
  better than zb1p at vpp=2; its gain is memory (1F1B's) and a V whose
  turn, stages pp-1 and pp, needs no transfer.

Diagram, pp=2 m=4, unit costs per F, I, W, free comm (simulated; `.` = idle):

    time      0   1   2   3   4   5   6   7   8   9  10  11  12
    stage 0 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2
    stage 1   . 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1

    time     13  14  15  16  17  18  19  20  21  22  23  24
    stage 0 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3   .
    stage 1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
"""

from __future__ import annotations

from collections import Counter

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType

F, I, W = ActionType.F, ActionType.I, ActionType.W  # noqa: E741


def schedule_zbv(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """Pipeline stage `stage`'s ZB-V compute order (see the module docstring)."""
    if vpp != 2:
        raise ScheduleError(f"zbv places two virtual stages per stage in a V, got vpp={vpp}; "
                            "use --vpp 2")
    m, n = num_microbatches, max(num_microbatches, 2 * pp - 1)
    down, up = stage, 2 * pp - 1 - stage
    count: Counter[tuple[ActionType, int]] = Counter()  # actions emitted per (type, virtual stage)
    out: list[Action] = []

    def run(*steps: tuple[ActionType, int]) -> None:
        for kind, virtual in steps:
            out.append(Action(virtual, kind, count[kind, virtual]))
            count[kind, virtual] += 1

    run(*[(F, down)] * (2 * (pp - stage) - 1))
    run(*[(F, up), (F, down)] * stage)
    run(*[(F, up), (I, up), (W, up)] * (pp - stage))
    while count[F, down] < n or count[F, up] < count[F, down]:
        if count[F, down] < n:
            run((F, down))
        run((I, down), (W, down), (F, up), (I, up), (W, up))
    run(*[(I, down), (I, up)] * stage)
    run(*[(I, down), (W, down)] * (pp - stage))
    run(*[(W, up)] * (count[I, up] - count[W, up]))
    run(*[(W, down)] * (count[I, down] - count[W, down]))
    return [a for a in out if a.microbatch < m]
