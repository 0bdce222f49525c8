"""ZB1P: zero-bubble ZB-H1, interleaved (Qi et al., ICLR 2024).

Invariants:
- Compute actions only (F, I, W); `sendrecv.add_comm` adds SEND/RECV. The
  backward is split: I (input gradients, which the previous stage waits
  for) runs where interleaved 1F1B runs B, and W (weight gradients, which
  nobody waits for) is deferred to fill the bubble.
- Interleaved placement: stage r runs virtual stages `chunk * pp + r`.
- Micro-batches go in rounds of `per_round = m // max(1, m // pp)` (pp
  when pp divides m); m must be a multiple of the number of rounds.
- Reproduces torch.distributed.pipelining's ScheduleInterleavedZeroBubble
  order exactly (tests/schedules/goldens/zero_bubble_orders.txt):
  * warmup = min((vpp - 1) * per_round + pp - 1 - r, vpp * m) forwards
    (one fewer per hop than interleaved 1F1B's two);
  * then the 1F1B skeleton of `one_f_one_b.order_1f1b` with the
    `interleaved.rounds_of` stage / micro-batch maps, each B written I;
  * stage r's W lag r backwards behind its I: after its j-th I, stage r runs
    the W of its (j - r)-th backward (j >= r); the last r W's run at the
    end. So stage r keeps at most r + 1 inputs of W alive at once.
- Bubble ratio with unit F, I and W costs and free comm: (pp-1)/(3*vpp*m),
  a third of interleaved 1F1B's; at vpp = 1 the paper's ZB-H1 (pp-1)/(3m).
  Measured exactly on pp in {1,2,3,4,8}, vpp in {1,2,3}, m in {pp,2pp,4pp}
  (tests/schedules/test_zero_bubble.py). No order does better there: the
  last stage waits pp-1 units for its first input.

Diagram, pp=2 vpp=2 m=4, unit costs per F, I, W, free comm (simulated;
virtual stage s = chunk * 2 + stage, `.` = idle):

    time      0   1   2   3   4   5   6   7   8   9  10  11  12
    stage 0 0F0 0F1 2F0 2F1   . 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0
    stage 1   . 1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1

    time     13  14  15  16  17  18  19  20  21  22  23  24
    stage 0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3
    stage 1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3
"""

from __future__ import annotations

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.interleaved import rounds_of
from meshplan.schedules.one_f_one_b import order_1f1b


def zb1p_per_round(pp: int, num_microbatches: int) -> int:
    """Micro-batches per round; ScheduleError unless they split into whole rounds."""
    m = num_microbatches
    rounds = max(1, m // pp)
    if m % rounds != 0:
        below, above = rounds * (m // rounds), rounds * (m // rounds + 1)
        raise ScheduleError(
            f"zb1p runs micro-batches in {rounds} rounds (num_microbatches // pp), so "
            f"num_microbatches must be a multiple of {rounds}, got num_microbatches={m} "
            f"pp={pp}; use --num-microbatches {below} or {above}")
    return m // rounds


def schedule_zb1p(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """Pipeline stage `stage`'s ZB1P compute order (see the module docstring)."""
    m = num_microbatches
    per_round = zb1p_per_round(pp, m)
    warmup = min((vpp - 1) * per_round + pp - 1 - stage, vpp * m)
    order = order_1f1b(vpp * m, warmup, *rounds_of(pp, vpp, per_round, stage))
    return split_backward(order, lag=stage)


def split_backward(order: list[Action], lag: int) -> list[Action]:
    """`order` with each B written I, and the W of its j-th backward right
    after its (j + lag)-th I; the W's left over run at the end, in order."""
    out: list[Action] = []
    done: list[Action] = []  # the I's run so far
    for a in order:
        if a.type is not ActionType.B:
            out.append(a)
            continue
        done.append(a)
        out.append(Action(a.virtual_stage, ActionType.I, a.microbatch))
        if len(done) > lag:
            w = done[len(done) - 1 - lag]
            out.append(Action(w.virtual_stage, ActionType.W, w.microbatch))
    out.extend(Action(w.virtual_stage, ActionType.W, w.microbatch)
               for w in done[max(0, len(done) - lag):])
    return out
