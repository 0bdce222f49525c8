"""The benchmarks' one harness for where a rank's step time goes.

Invariant: it reads the executor's own timing spans (`RankExecutor.spans`:
one `Span` per action, and one for waiting on the sends, in
`time.perf_counter()` seconds) and never patches the executor or its
transfers. A what-if runs through public calls between steps
(`before_step`), not by replacing methods.
"""

from __future__ import annotations

import time
from collections import defaultdict

from meshplan.schedules.action import ActionType
from meshplan.schedules.trace import Span, action_of

_PHASE = {ActionType.F: "forward", ActionType.B: "backward",
          ActionType.I: "backward (input)", ActionType.W: "backward (weight)",
          ActionType.STEP: "optimizer",
          ActionType.RECV_F: "recv (wait)", ActionType.RECV_B: "recv (wait)",
          ActionType.SEND_F: "send (post)", ActionType.SEND_B: "send (post)"}


def phase_of(span: Span) -> str:
    """The phase an executor span counts in: its action's, else its own name."""
    action = action_of(span)
    return span.name if action is None else _PHASE[action.type]


def profiled_step(ex, state: dict, microbatches) -> tuple[float, list[Span]]:
    """One step of `ex` with its spans on: (wall seconds, the step's spans)."""
    spans: list[Span] = []
    ex.spans = spans
    t0 = time.perf_counter()
    try:
        ex.step(state, microbatches)
    finally:
        ex.spans = None
    return time.perf_counter() - t0, spans


def phase_seconds(steps: list[tuple[float, list[Span]]]) -> dict[str, float]:
    """Mean seconds per step in each phase of `profiled_step` results; "other"
    is the wall time no span covers."""
    acc: dict[str, float] = defaultdict(float)
    for _, spans in steps:
        for s in spans:
            acc[phase_of(s)] += s.end - s.start
    n = len(steps)
    out = {k: v / n for k, v in acc.items()}
    out["other"] = sum(wall for wall, _ in steps) / n - sum(out.values())
    return out
