"""What each pipeline schedule is: one `ScheduleSpec` record per schedule.

Invariants:
- `REGISTRY` is the one place a schedule's facts are written: its action
  function, its stage placement, its vpp and micro-batch rules, whether it
  splits the backward, its degenerate forms and its closed-form activation
  count. Every reader (the strategy check, the CLI's defaults, the search
  space and estimate, lowering) asks it; no other module compares or lists
  schedule names (`tests/schedules/test_registry.py`). Adding a schedule is
  one record here and its action function.
- A schedule's name is the string users write (`--schedule 1f1b`); the Job
  keeps it as that string (`Strategy.schedule`), so a Job's bytes do not
  depend on this module.
- Records are in the search's order of preference: of two candidates that
  tie, the search keeps the one whose schedule comes first.
- `csv` is the user's own orders (`Strategy.schedule_orders`, read by
  `csv_io`): it has no action function, its placement and its backward split
  are read off the orders, and the search never picks it.
- Vocabulary: a *stage* is a pipeline position (0..pp-1, the ranks of one
  `Strategy.ranks_of_stage`); a *virtual stage* is a piece of the model
  (0..pp*vpp-1, `Action.virtual_stage`); stage s holds virtual stages
  `StagePlacement.stages_of(s)`, its chunk c being the c-th.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

from meshplan.errors import ConfigError
from meshplan.ir.mesh import Strategy
from meshplan.ir.stage_placement import StagePlacement, placement_read_off
from meshplan.schedules.action import Action
from meshplan.schedules.gpipe import schedule_gpipe
from meshplan.schedules.interleaved import schedule_interleaved
from meshplan.schedules.one_f_one_b import schedule_1f1b
from meshplan.schedules.zb1p import schedule_zb1p
from meshplan.schedules.zbv import schedule_zbv

# (pp, vpp, num_microbatches, stage) -> that pipeline stage's compute actions
ScheduleFn = Callable[[int, int, int, int], list[Action]]
# (pp, num_microbatches, stage) -> micro-batches in flight on that stage's one chunk
LiveFn = Callable[[int, int, int], int]
_SPLIT = re.compile(r"\d+[IW]\d+")  # an I or W action's text


class MicroBatches(enum.Enum):
    """How many micro-batches a schedule needs per step (m), given pp."""

    ANY = "any"
    AT_LEAST_PP = "at least pp"
    ROUNDS_OF_PP = "a multiple of pp"  # and at least pp: rounds of pp micro-batches


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """One pipeline schedule's facts."""

    name: str
    # its compute orders; None: given by the user as orders (csv)
    actions: ScheduleFn | None
    # where its virtual stages run, from (pp, vpp); None: read off the orders
    placement: Callable[[int, int], StagePlacement] | None = StagePlacement.interleaved
    splits_backward: bool = False  # runs I and W apart (the Job splits the backward)
    microbatches: MicroBatches = MicroBatches.ANY
    chunks: int = 0            # the one vpp it runs at (an error otherwise); 0: any
    # the schedule that runs instead at vpp > 1 ("": this one runs several chunks)
    many_chunks: str = ""
    one_chunk: str = ""        # the schedule whose order it runs at vpp == 1 ("": its own)
    one_stage: str = ""        # the schedule whose order it runs at pp == vpp == 1
    live: LiveFn | None = None  # closed form of the activations it keeps (None: simulate)

    @property
    def interleaves(self) -> bool:
        """Whether it may run several chunks per stage."""
        return not self.many_chunks

    @property
    def searched(self) -> bool:
        """Whether the search may pick it (not the user's own orders)."""
        return self.actions is not None

    def at_vpp(self, vpp: int) -> str:
        """The schedule that runs at `vpp`: this one, or `many_chunks` at vpp > 1."""
        return self.many_chunks if vpp > 1 and self.many_chunks else self.name

    def vpps_to_search(self, max_vpp: int) -> tuple[int, ...]:
        """The vpp values the search tries: its one vpp, 1 if it does not
        interleave, else 1..max_vpp (from 2 when vpp 1 is another's order)."""
        if self.chunks:
            return (self.chunks,)
        if not self.interleaves:
            return (1,)
        return tuple(range(2 if self.one_chunk else 1, max_vpp + 1))


DEFAULT = "1f1b"  # the schedule when none is named (and the one at pp == 1 in the search)
CSV = "csv"  # the user's own orders (`--schedule-csv`, `Strategy.schedule_orders`)
REGISTRY: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("1f1b", schedule_1f1b, microbatches=MicroBatches.AT_LEAST_PP,
                 many_chunks="interleaved", live=lambda pp, m, stage: min(m, pp - stage)),
    ScheduleSpec("interleaved", schedule_interleaved, microbatches=MicroBatches.ROUNDS_OF_PP,
                 one_chunk="1f1b", one_stage="1f1b"),
    ScheduleSpec("zb1p", schedule_zb1p, splits_backward=True,
                 microbatches=MicroBatches.ROUNDS_OF_PP, one_stage="1f1b"),
    ScheduleSpec("zbv", schedule_zbv, placement=StagePlacement.v, splits_backward=True,
                 chunks=2, one_stage="1f1b"),
    ScheduleSpec("gpipe", schedule_gpipe, many_chunks="interleaved", one_stage="1f1b",
                 live=lambda pp, m, stage: m),
    ScheduleSpec(CSV, None, placement=None),
)}


def names() -> tuple[str, ...]:
    """Every schedule's name, in the registry's order."""
    return tuple(REGISTRY)


def searched() -> tuple[str, ...]:
    """The schedules the search may pick, in its order of preference."""
    return tuple(name for name, spec in REGISTRY.items() if spec.searched)


def spec_of(name: str) -> ScheduleSpec:
    """The record of schedule `name`; an unknown name is one ConfigError line."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"unknown schedule '{name}': choose one of {', '.join(REGISTRY)}")
    return spec


def default_schedule(vpp: int) -> str:
    """The schedule run when none is named: 1F1B, interleaved at vpp > 1."""
    return REGISTRY[DEFAULT].at_vpp(vpp)


@cache
def placement_of(schedule: str, pp: int, vpp: int,
                 orders: tuple[tuple[str, ...], ...] = ()) -> StagePlacement:
    """The placement schedule `schedule` runs its virtual stages in; a
    schedule given as compute orders (`orders[stage]`, actions as text) runs
    each virtual stage where its actions are. Cached: lowering and the
    search ask on every use (a CSV's orders would otherwise be read again)."""
    if orders:
        return placement_read_off(pp, orders)
    place = spec_of(schedule).placement
    assert place is not None, f"schedule {schedule} is given by its orders"
    return place(pp, vpp)


def stage_placement(s: Strategy) -> StagePlacement:
    """Which pipeline stage runs each of `s`'s virtual stages."""
    return placement_of(s.schedule, s.pp, s.vpp, s.schedule_orders)


def splits_backward(s: Strategy) -> bool:
    """Whether `s`'s schedule runs I and W apart (the Job then splits the
    backward); a schedule given as orders does when they hold an I or W."""
    if s.schedule_orders:
        return any(_SPLIT.fullmatch(a) for order in s.schedule_orders for a in order)
    return spec_of(s.schedule).splits_backward


@contextmanager
def registered(spec: ScheduleSpec) -> Iterator[ScheduleSpec]:
    """`spec` added to the registry for the `with` block (a test's toy
    schedule); `placement_of`'s cache is cleared on both ends. The search
    caches by name too: give each toy record a name of its own."""
    assert spec.name not in REGISTRY, f"schedule {spec.name} is registered already"
    placement_of.cache_clear()
    REGISTRY[spec.name] = spec
    try:
        yield spec
    finally:
        del REGISTRY[spec.name]
        placement_of.cache_clear()
