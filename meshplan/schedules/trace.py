"""Timelines of one step, simulated or measured, as Chrome/Perfetto traces.

Invariants:
- A `Span` is one thing one rank did: an action (F, B, I, W, SEND, RECV, STEP)
  or a collective inside one; times are seconds from one origin shared by
  every rank of the trace (the simulation's zero, or the barrier before the
  measured step).
- A trace has one process track (`pid`) per rank and two thread tracks:
  `Track.COMPUTE` (F, B, I, W, STEP) and `Track.COMM` (SEND, RECV,
  collectives, waiting for sends). Every span is one complete ("X") event;
  a compute action's carries a `cname` of its kind (`CNAME`).
- The bubble ratio is computed the same way for both kinds of timeline: a
  rank's busy time is the sum of its compute spans, the step time is the
  latest end over ranks, and a rank's ratio is (step - busy) / busy; the
  reported ratio is the largest over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType


class Track(Enum):
    """The thread track a span is drawn on."""

    COMPUTE = 0
    COMM = 1


@dataclass(frozen=True, slots=True)
class Span:
    """One timed piece of one rank's step (seconds from the trace origin)."""

    name: str
    track: Track
    start: float
    end: float

    def to_json(self) -> list:
        return [self.name, self.track.value, self.start, self.end]

    @staticmethod
    def from_json(row: Sequence) -> Span:
        return Span(str(row[0]), Track(int(row[1])), float(row[2]), float(row[3]))


def track_of(action: Action) -> Track:
    """COMPUTE for F, B, I, W and STEP; COMM for SEND and RECV."""
    return Track.COMM if action.type.is_comm else Track.COMPUTE


def action_span(action: Action, start: float, end: float) -> Span:
    return Span(str(action), track_of(action), start, end)


def action_of(span: Span) -> Action | None:
    """The action a span times; None for a collective or a wait."""
    try:
        return Action.parse(span.name)
    except ScheduleError:
        return None


# Chrome's reserved colour names, one per compute kind, so that I and W (and
# F, B) each get their own colour in the trace viewer (Perfetto colours by name).
CNAME = {ActionType.F: "thread_state_running", ActionType.B: "thread_state_iowait",
         ActionType.I: "rail_response", ActionType.W: "rail_idle", ActionType.STEP: "grey"}


def _colour(span: Span) -> dict:
    a = action_of(span)
    return {"cname": CNAME[a.type]} if a is not None and a.type in CNAME else {}


def _args(span: Span) -> dict:
    """Stage, micro-batch and type of an action's span (nothing for others)."""
    a = action_of(span)
    return {} if a is None else {"stage": a.virtual_stage, "microbatch": a.microbatch,
                                 "type": a.type.value}


def chrome_events(spans: Mapping[int, Sequence[Span]], unit_us: float = 1e6) -> dict:
    """The Chrome trace JSON of `spans` (rank -> spans); one second of span
    time lasts `unit_us` microseconds of trace time."""
    events: list[dict] = []
    for rank in sorted(spans):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for track in Track:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": track.value,
                           "args": {"name": track.name.lower()}})
        for s in sorted(spans[rank], key=lambda s: (s.start, s.track.value)):
            events.append({"name": s.name, "cat": track_name(s), "ph": "X", "pid": rank,
                           "tid": s.track.value, "ts": s.start * unit_us,
                           "dur": (s.end - s.start) * unit_us, "args": _args(s)} | _colour(s))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def track_name(s: Span) -> str:
    return "compute" if s.track is Track.COMPUTE else "comm"


def ratio(idle: float, busy: float) -> float:
    """idle / busy, with 0/0 = 0 and x/0 = inf."""
    if busy > 0:
        return idle / busy
    return 0.0 if idle <= 0 else math.inf


def bubble(spans: Mapping[int, Sequence[Span]]) -> dict:
    """Step time, busy time and bubble ratio per rank, and the largest ratio."""
    busy = {r: sum(s.end - s.start for s in ss if s.track is Track.COMPUTE)
            for r, ss in spans.items()}
    step = max((s.end for ss in spans.values() for s in ss), default=0.0)
    per_rank = {r: ratio(step - b, b) for r, b in busy.items()}
    return {"step_s": step, "busy_s": busy, "per_rank_bubble": per_rank,
            "bubble_ratio": max(per_rank.values(), default=0.0)}
