"""Pipeline schedules as data: compute orders, one comm lowering, checks.

Invariants:
- What each schedule is (its action function, placement, vpp and
  micro-batch rules, backward split, degenerate forms) is its
  `registry.ScheduleSpec`, asked through `spec_of(name)`; no other module
  compares schedule names.
- A schedule's action function is a pure function `(pp, vpp,
  num_microbatches, stage) -> list[Action]` of compute actions (F, B, I, W)
  only, `stage` being a pipeline position (0..pp-1) and each action's
  `Action.virtual_stage` a virtual stage; every stage's order is built the same way
  on every stage, with no communication between them. Its placement of
  virtual stages on pipeline stages is `placement_of(name, pp, vpp)`.
- `sendrecv.add_comm` is the only place SEND/RECV actions are made.
- `validate.validate` and `simulate.simulate` check a lowered schedule
  without processes or torch.distributed.
- `compute_actions` is the checked entry point; it runs a schedule's
  degenerate form where the registry says (interleaved at vpp 1 is 1F1B).
  The zero-bubble ones (`ScheduleSpec.splits_backward`) run I and W; the
  others B.
"""

from __future__ import annotations

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.grid import format_grid
from meshplan.schedules.registry import (
    REGISTRY,
    ScheduleSpec,
    placement_of,
    spec_of,
    splits_backward,
    stage_placement,
)
from meshplan.schedules.sendrecv import Transfer, add_comm, chain_edges
from meshplan.schedules.simulate import SimResult, chrome_trace, simulate
from meshplan.schedules.validate import validate

__all__ = [
    "REGISTRY", "Action", "ActionType", "ScheduleSpec", "SimResult",
    "StagePlacement", "Transfer", "add_comm", "chain_edges", "chrome_trace",
    "compute_actions", "format_grid", "placement_of", "simulate", "spec_of",
    "splits_backward", "stage_placement", "validate",
]


def compute_actions(name: str, pp: int, vpp: int, num_microbatches: int,
                    stage: int) -> list[Action]:
    """Pipeline stage `stage`'s compute actions under schedule `name`, after
    checking the counts.

    A schedule whose `one_chunk` is set runs that schedule's order at vpp == 1
    (interleaved: 1F1B, since torch's interleaved formula warms up
    2*(pp-stage-1) forwards there instead of pp-stage-1; see [Note:
    interleaved at vpp=1] in interleaved.py), after its own counts check.
    """
    spec = REGISTRY.get(name)
    if spec is None or spec.actions is None:
        raise ScheduleError(f"unknown schedule {name!r}; use --schedule one of "
                            f"{', '.join(sorted(n for n, s in REGISTRY.items() if s.actions))}")
    for label, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule {name}: {label} must be a positive integer, "
                                f"got {value!r}")
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise ScheduleError(f"schedule {name}: stage must be in 0..{pp - 1} for pp={pp}, "
                            f"got {stage!r}")
    own = spec.actions(pp, vpp, num_microbatches, stage)
    if vpp == 1 and spec.one_chunk:
        return compute_actions(spec.one_chunk, pp, vpp, num_microbatches, stage)
    return own
