"""Interleaved 1F1B (virtual pipeline, VPP): vpp chunks per stage.

Invariants:
- Compute actions only (F, B); `sendrecv.add_comm` adds SEND/RECV.
- Stage r runs virtual stages `chunk * pp + r` for chunk in 0..vpp-1.
- num_microbatches % pp == 0; micro-batches go in rounds of pp.
- Reproduces torch.distributed.pipelining's ScheduleInterleaved1F1B order
  exactly (checked against /work/shared/goldens/interleaved_1f1b_orders.txt):
  * warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, vpp * m) forwards;
  * the k-th forward runs chunk (k // pp) % vpp on micro-batch
    (k // (pp * vpp)) * pp + k % pp: pp micro-batches on chunk 0, the same
    pp on chunk 1, ..., then the next round (depth first);
  * the j-th backward mirrors it, chunks from the last down:
    chunk vpp - 1 - (j // pp) % vpp, same micro-batch formula;
  * then the 1F1B skeleton of `one_f_one_b.order_1f1b`.
- Bubble ratio (pp-1)/(vpp*m) with uniform per-chunk costs and free comm;
  measured exactly on pp in {1,2,3,4,8}, vpp in {1,2,3}, m in {pp,2pp,4pp},
  m == pp (capped warmup) included (tests/schedules/test_bubble.py).

[Note: interleaved at vpp=1] With vpp == 1 torch's formula still warms up
2 * (pp - r - 1) forwards (1F1B warms up pp - r - 1), so its order differs
from 1F1B wherever neither warmup is capped by m (pp=4 m=8: stages 0-2;
stage 0 runs 6 forwards before its first backward instead of 3). Measured: same
bubble with uniform costs, but up to 2x the activations in flight.
`schedule_interleaved()` keeps torch's order; `compute_actions("interleaved", vpp=1)`
returns 1F1B's.

Diagram, pp=2 vpp=2 m=4, unit costs per chunk action, free comm (simulated;
virtual stage s = chunk * 2 + stage, `.` = idle):

    time      0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
    stage 0 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1   . 2B2   . 2B3 0B2 0B3
    stage 1   . 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3   .
"""

from __future__ import annotations

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action
from meshplan.schedules.one_f_one_b import OpMap, order_1f1b


def interleaved_warmup(pp: int, vpp: int, num_microbatches: int, stage: int) -> int:
    """Number of warmup forwards of pipeline stage `stage` (torch's formula, capped at vpp*m)."""
    return min(2 * (pp - stage - 1) + (vpp - 1) * pp, vpp * num_microbatches)


def schedule_interleaved(pp: int, vpp: int, num_microbatches: int, stage: int) -> list[Action]:
    """Pipeline stage `stage`'s interleaved 1F1B compute order (see the module docstring)."""
    m = num_microbatches
    if m % pp != 0:
        below, above = (m // pp) * pp, (m // pp + 1) * pp
        valid = f"{above}" if below == 0 else f"{below} or {above}"
        raise ScheduleError(
            f"interleaved needs num_microbatches to be a multiple of pp, got "
            f"num_microbatches={m} pp={pp}; use --num-microbatches {valid}"
        )

    warmup = interleaved_warmup(pp, vpp, m, stage)
    return order_1f1b(vpp * m, warmup, *rounds_of(pp, vpp, pp, stage))


def rounds_of(pp: int, vpp: int, per_round: int, stage: int) -> tuple[OpMap, OpMap]:
    """The k-th forward / backward of pipeline stage `stage` -> (virtual stage,
    microbatch), depth first.

    Micro-batches go in rounds of `per_round`: forwards run a round on chunk
    0, the same round on chunk 1, ..., then the next round; backwards mirror
    it from the last chunk down.
    """
    def mb_of(k: int) -> int:
        return (k // (per_round * vpp)) * per_round + k % per_round

    def fwd(k: int) -> tuple[int, int]:
        return ((k // per_round) % vpp) * pp + stage, mb_of(k)

    def bwd(j: int) -> tuple[int, int]:
        return (vpp - 1 - (j // per_round) % vpp) * pp + stage, mb_of(j)

    return fwd, bwd
