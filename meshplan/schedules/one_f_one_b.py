"""1F1B: a short forward warmup, then one forward / one backward in turn.

Invariants:
- Compute actions only (F, B); `sendrecv.add_comm` adds SEND/RECV.
- vpp == 1 and num_microbatches >= pp.
- Rank r runs `min(pp - r - 1, m)` warmup forwards, then pairs (F, B) while
  forwards remain, then the remaining backwards. So stage r holds at most
  pp - r activations at once (GPipe holds m), with the same bubble,
  (pp-1)/m with uniform costs.
- `order_1f1b` is the shared skeleton; interleaved 1F1B reuses it with its
  own warmup and its own op -> (stage, microbatch) maps.

Diagram, pp=4 m=8, unit costs, free comm (simulated; `.` = idle):

    time     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21
    stage 0 F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 F6 B3 F7 B4  . B5  . B6  . B7
    stage 1  . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .
    stage 2  .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6  . B7  .  .
    stage 3  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  .
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType

OpMap = Callable[[int], tuple[int, int]]  # op index k -> (virtual stage, microbatch)


def order_1f1b(num_ops: int, warmup: int, fwd: OpMap, bwd: OpMap) -> list[Action]:
    """`warmup` forwards, then (forward, backward) pairs, then the backwards left.

    `fwd(k)` / `bwd(k)` give the stage and microbatch of the k-th forward /
    backward of this stage; each kind has `num_ops` ops.
    """
    assert 0 <= warmup <= num_ops
    out = [Action(*_forward(fwd(k))) for k in range(warmup)]
    for j in range(num_ops - warmup):
        out.append(Action(*_forward(fwd(warmup + j))))
        out.append(Action(*_backward(bwd(j))))
    out.extend(Action(*_backward(bwd(j))) for j in range(num_ops - warmup, num_ops))
    return out


def _forward(stage_mb: tuple[int, int]) -> tuple[int, ActionType, int]:
    return stage_mb[0], ActionType.F, stage_mb[1]


def _backward(stage_mb: tuple[int, int]) -> tuple[int, ActionType, int]:
    return stage_mb[0], ActionType.B, stage_mb[1]


def schedule_1f1b(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """Pipeline stage `stage`'s 1F1B compute order (see the module docstring)."""
    m = num_microbatches
    if vpp != 1:
        raise ScheduleError(
            f"1f1b runs one virtual stage per stage but got vpp={vpp}; "
            f"use --vpp 1 or --schedule interleaved"
        )
    if m < pp:
        raise ScheduleError(
            f"1f1b needs num_microbatches >= pp, got num_microbatches={m} pp={pp}; "
            f"use --num-microbatches {pp} or more, or --schedule gpipe"
        )
    warmup = min(pp - stage - 1, m)
    return order_1f1b(m, warmup, lambda k: (stage, k), lambda k: (stage, k))
