"""Schedules as CSV, in torch.distributed.pipelining's pipeline CSV format.

Invariants:
- One row per rank, rank 0 first, no header; each cell is one action in
  torch's text (`0F0`, `1B3`, `2I0`, `2W0`; lowered: `0SEND_F0`,
  `1RECV_B2`). An empty cell is an idle step (torch writes its bubbles so)
  and is skipped on reading. This is what torch's `_dump_csv` writes and
  `_load_csv` reads (the csv module; torch ends lines with CRLF, we with
  LF; both readers take either).
- `dump_csv` writes each rank's actions as they are, compute-only or
  lowered, except STEP: torch's format has none (every step ends with one).
- `load_csv` reads a compute-only schedule (F, B, I, W) and returns it only
  if it passes, in this order: one row per rank; every cell an action; one
  owner rank per stage (the placement given, or read off the rows: each
  rank holds vpp stages, together 0..pp*vpp-1); the rules of
  `validate.find_fault` for compute orders (F before I before W, or F before
  B; as many I as W; every micro-batch complete); and no wait cycle across
  ranks once lowered (simulated). A bad CSV raises one ScheduleError line
  naming the row (rank), the 1-based column, the cell and the rule broken.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.sendrecv import add_comm
from meshplan.schedules.simulate import simulate
from meshplan.schedules.validate import find_fault

Cells = dict[int, list[tuple[int, Action]]]  # rank -> (1-based column, action) per non-empty cell


def dump_csv(orders: Mapping[int, Sequence[Action]]) -> str:
    """`orders` (rank -> actions, ranks 0..n-1) as torch's pipeline CSV text."""
    if sorted(orders) != list(range(len(orders))):
        raise ScheduleError(f"dump_csv needs ranks 0..{len(orders) - 1}, got {sorted(orders)}")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(len(orders)):
        writer.writerow([str(a) for a in orders[rank] if a.type is not ActionType.STEP])
    return out.getvalue()


def load_csv(text: str, pp: int, vpp: int, num_microbatches: int,
             placement: StagePlacement | None = None) -> dict[int, list[Action]]:
    """The compute orders (rank -> actions) of a checked CSV schedule (see the
    module docstring); the placement is read off the rows when not given."""
    cells = _parse(text, pp)
    where = placement or _owners(cells, pp, vpp)
    orders = {r: [a for _, a in row] for r, row in cells.items()}
    fault = find_fault(orders, pp, vpp, num_microbatches, placement=where, lowered=False)
    if fault is not None:
        raise _bad(cells, fault.stage, fault.index, fault.message)
    _check_deadlock(cells, orders, pp, where)
    return orders


def _bad(cells: Cells, rank: int, index: int, rule: str) -> ScheduleError:
    return ScheduleError(f"bad schedule CSV: row {rank + 1} (rank {rank}), "
                         f"{_at(cells, rank, index)}: {rule}")


def _at(cells: Cells, rank: int, index: int) -> str:
    """Where the `index`-th action of `rank` is: its column and cell."""
    row = cells[rank]
    return f"column {row[index][0]} ({row[index][1]})" if index < len(row) else "end of row"


def _parse(text: str, pp: int) -> Cells:
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) != pp:
        raise ScheduleError(f"bad schedule CSV: {len(rows)} rows for pp={pp}; rule: one row "
                            f"per rank, rank 0 first")
    cells: Cells = {}
    for rank, row in enumerate(rows):
        cells[rank] = []
        for col, cell in enumerate(row, start=1):
            if not cell.strip():
                continue
            at = f"bad schedule CSV: row {rank + 1} (rank {rank}), column {col} ({cell.strip()!r})"
            try:
                a = Action.parse(cell)
            except ScheduleError:
                raise ScheduleError(f"{at}: not an action; rule: a cell is "
                                    f"<stage><F|B|I|W><microbatch> (e.g. 2I0) or empty") from None
            if not a.type.is_compute:
                raise ScheduleError(f"{at}: not a compute action; rule: a schedule CSV holds "
                                    f"F, B, I and W only, the lowering adds SEND/RECV")
            cells[rank].append((col, a))
    return cells


def _owners(cells: Cells, pp: int, vpp: int) -> StagePlacement:
    """The placement the rows imply; ScheduleError where a stage has no or two owners."""
    owner: dict[int, tuple[int, int]] = {}  # stage -> (rank, column) first seen
    for rank, row in cells.items():
        for i, (col, a) in enumerate(row):
            if a.virtual_stage >= pp * vpp:
                raise _bad(cells, rank, i, f"stage {a.virtual_stage} is not in 0..{pp * vpp - 1} "
                           f"(pp={pp} vpp={vpp}); rule: stages are 0..pp*vpp-1")
            first = owner.setdefault(a.virtual_stage, (rank, col))
            if first[0] != rank:
                raise _bad(cells, rank, i, f"stage {a.virtual_stage} is also run by rank "
                           f"{first[0]} "
                           f"(row {first[0] + 1}, column {first[1]}); rule: each stage has "
                           f"one owner rank")
    missing = [s for s in range(pp * vpp) if s not in owner]
    if missing:
        raise ScheduleError(f"bad schedule CSV: no row runs stage {missing[0]}; rule: every "
                            f"stage 0..{pp * vpp - 1} has one owner rank")
    for rank in range(pp):
        held = sorted(s for s, (r, _) in owner.items() if r == rank)
        if len(held) != vpp:
            raise _bad(cells, rank, len(cells[rank]), f"rank {rank} runs stages {held}; "
                       f"rule: each rank holds vpp={vpp} stages")
    return StagePlacement(pp, tuple(owner[s][0] for s in range(pp * vpp)))


def _check_deadlock(cells: Cells, orders: dict[int, list[Action]], pp: int,
                    where: StagePlacement) -> None:
    """ScheduleError naming each rank's stuck cell if the lowered schedule deadlocks."""
    lowered = add_comm(orders, pp, placement=where)
    sim = simulate(lowered, pp, placement=where)
    if sim.ok:
        return
    stuck = {r: _compute_index(lowered[r], i) for r, i in sim.stuck.items()}
    (rank, index), *others = sorted(stuck.items())
    also = "".join(f", rank {r} at {_at(cells, r, i)}" for r, i in others)
    raise _bad(cells, rank, index, f"the schedule deadlocks: rank {rank} waits here{also}; "
               f"rule: no wait cycle across ranks (each input is sent before its consumer "
               f"waits for it)")


def _compute_index(lowered: list[Action], index: int) -> int:
    """The index among compute actions of the first one at or after lowered[index]."""
    return sum(a.type.is_compute for a in lowered[:index])
