"""A bounded text grid of a schedule (time steps × stages) for error messages.

Invariants:
- Row `i` shows the `i`-th action of every column (an action-list index,
  not simulated time); column `r` is stage r (`column="stage"`, a schedule's
  lists) or rank r (`column="rank"`, `meshplan check`'s plans).
- A marked action's row ends with `<-- ERROR HERE (stage r: <action>)`.
- The grid stays bounded whatever the schedule size: rows near the marks
  (or the first rows when there is no mark), at most `max_columns` columns.
  Used by validate, simulate, `meshplan check` and `meshplan show`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from meshplan.schedules.action import Action

Mark = tuple[int, int]  # (column, index into that column's action list)


def _marks(mark: Mark | Iterable[Mark] | None) -> list[Mark]:
    if mark is None:
        return []
    items: tuple[Any, ...] = tuple(mark)
    if len(items) == 2 and all(isinstance(x, int) for x in items):
        return [(items[0], items[1])]  # a single (column, index) pair
    return [(r, i) for r, i in items]


def _row_ranges(marks: list[Mark], n_rows: int, context: int, max_rows: int) -> list[range]:
    if not marks:
        return [range(0, min(n_rows, max_rows))]
    spans = sorted((max(0, i - context), min(n_rows, i + context + 1)) for _, i in marks)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [range(lo, hi) for lo, hi in merged]


def _columns_shown(columns: list[int], marks: list[Mark], max_columns: int) -> list[int]:
    if len(columns) <= max_columns:
        return columns
    shown = {r for r, _ in marks if r in columns}
    for r in columns:
        if len(shown) >= max_columns:
            break
        shown.add(r)
    return sorted(shown)


def format_grid(actions: Mapping[int, Sequence[Action]], mark: Mark | Iterable[Mark] | None = None,
                *, context: int = 5, max_rows: int = 24, max_columns: int = 8,
                column: str = "stage") -> str:
    """The schedule as a bounded grid; `mark` = (column, index) or a list of
    them; `column` names what a column is ("stage", or "rank" for plans)."""
    marks = _marks(mark)[:8]
    shown = _columns_shown(sorted(actions), marks, max_columns)
    n_rows = max([len(actions[r]) for r in actions] + [i + 1 for _, i in marks], default=0)
    cells = {r: [str(a) for a in actions.get(r, ())] for r in shown}
    labels = [len(c) for col in cells.values() for c in col] + [len(f"{column} {r}")
                                                                 for r in shown]
    width = max(labels, default=4) + 2
    lines = ["step  " + "".join(f"{column} {r}".ljust(width) for r in shown).rstrip()]
    if len(shown) < len(actions):
        lines[0] += f"   ({len(actions) - len(shown)} {column}s hidden)"
    shown_until = 0
    for rows in _row_ranges(marks, n_rows, context, max_rows):
        if rows.start > shown_until:
            lines.append(f"  ... {rows.start - shown_until} steps")
        for i in rows:
            row = "".join((cells[r][i] if i < len(cells[r]) else "").ljust(width) for r in shown)
            line = f"{i:>4}  {row}".rstrip()
            hits = [f"{column} {r}: {_label(actions, r, i)}" for r, j in marks if j == i]
            lines.append(line + (f"  <-- ERROR HERE ({'; '.join(hits)})" if hits else ""))
        shown_until = rows.stop
    if n_rows > shown_until:
        lines.append(f"  ... {n_rows - shown_until} more steps")
    return "\n".join(lines)


def _label(actions: Mapping[int, Sequence[Action]], column: int, index: int) -> str:
    acts = actions.get(column, ())
    return str(acts[index]) if 0 <= index < len(acts) else "end of list"


def ascii_timeline(timeline: Mapping[int, Sequence[tuple[Action, float, float]]],
                   label: Callable[[Action], str] = str) -> str:
    """A simulated timeline as a stage × time diagram, one column per time unit.

    For unit-cost simulations (integer times): each compute/STEP action fills
    the columns it occupies with `label(action)`, idle columns show `.`;
    SEND/RECV are not drawn (a RECV wait shows as idle).
    """
    spans = {r: [(a, s, e) for a, s, e in timeline[r] if not a.type.is_comm and e > s]
             for r in sorted(timeline)}
    end = int(max([e for sp in spans.values() for _, _, e in sp], default=0))
    cells = {r: ["."] * end for r in spans}
    for r, sp in spans.items():
        for a, s, e in sp:
            for t in range(int(s), int(e)):
                cells[r][t] = label(a)
    width = max([len(c) for row in cells.values() for c in row] + [len(str(end - 1))]) + 1
    head = f"stage {max(spans, default=0)}"
    lines = ["time".ljust(len(head)) + "".join(str(t).rjust(width) for t in range(end))]
    lines += [f"stage {r}".ljust(len(head)) + "".join(c.rjust(width) for c in cells[r])
              for r in spans]
    return "\n".join(lines)
