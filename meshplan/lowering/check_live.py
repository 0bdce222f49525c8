"""Proof 7 of `lowering/check.py`: the split backward's order, and that what
an action leaves for a later one stays live.

Proven on each rank's plan:
- I never waits for W: no task of the backward phase (I) reads a buffer a
  weight-phase (W) task writes, and nothing a W task writes is sent, or read
  by a forward or backward task: W's results are weight gradients, which only
  W itself, the per-micro-batch accumulator updates and the STEP take.
- Every per-micro-batch buffer that one action writes and a later action
  reads (an activation saved for I or W, an output gradient I leaves for a
  deferred W, a received value) holds as many micro-batches as the rank's
  action order keeps alive at once: walking the actions, the most
  micro-batches between the action that writes it and the last that reads
  it never exceed its `copies` (the memory layout's slots). Worked out here
  from the actions alone, not from lowering's own count.
"""

from __future__ import annotations

from collections import defaultdict

from meshplan.ir import Phase
from meshplan.lowering.rankplan import (
    STATE_CATEGORIES,
    BufferCategory,
    RankPlan,
    TaskKind,
    action_templates,
    template_of,
)
from meshplan.schedules import stage_placement


def split_and_live(job, plans: dict[int, RankPlan]) -> list[str]:
    """Errors of proof 7 (empty when every rank keeps what it defers)."""
    where = stage_placement(job.strategy)
    errors: list[str] = []
    for r, p in sorted(plans.items()):
        errors += _i_before_w(r, p)
        errors += _slots(r, p, where)
    return errors


def _i_before_w(rank: int, p: RankPlan) -> list[str]:
    by_id = {t.id: t for t in p.tasks}
    for b in p.buffers:
        if not any(by_id[t].phase is Phase.WEIGHT for t in b.producers if t in by_id):
            continue
        for c in b.consumers:
            t = by_id.get(c)
            if t is not None and (t.kind is TaskKind.SEND or
                                  t.phase in (Phase.FORWARD, Phase.BACKWARD)):
                what = "sends" if t.kind is TaskKind.SEND else f"reads (in the {t.phase.value})"
                return [f"rank {rank}: task {t.id} (op {t.op}) {what} buffer {b.id} (value "
                        f"{b.value}) that the weight phase writes; I and F must not wait for "
                        "W: recompile the plans"]
    return []


def _slots(rank: int, p: RankPlan, where) -> list[str]:
    """Micro-batches alive at once per buffer that crosses actions, against its copies."""
    key_of = {t.id: template_of(t) for t in p.tasks if t.kind not in (TaskKind.SEND,
                                                                       TaskKind.RECV)}
    runs: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # template -> (index, mb)
    for i, a in enumerate(p.actions):
        for key in action_templates(a, where):
            runs[key].append((i, a.microbatch))
    for b in p.buffers:
        if b.category in STATE_CATEGORIES or b.category is BufferCategory.DATA:
            continue
        made = {key_of[t] for t in b.producers if t in key_of}
        used = {key_of[t] for t in b.consumers if t in key_of} - made
        if len(made) != 1 or not used:
            continue  # received, or made and used in one action
        alive = _most_alive(runs[made.pop()], [runs[k] for k in used])
        if alive > b.copies:
            return [f"rank {rank}: buffer {b.id} (value {b.value}) has {b.copies} slot(s) "
                    f"but the action order keeps {alive} micro-batches of it alive at once; "
                    "the memory layout undercounts what a deferred action keeps: recompile"]
    return []


def _most_alive(made: list[tuple[int, int]], used: list[list[tuple[int, int]]]) -> int:
    """The most micro-batches between their writing action and their last reading one."""
    start = {mb: i for i, mb in made}
    end: dict[int, int] = {}
    for run in used:
        for i, mb in run:
            end[mb] = max(end.get(mb, i), i)
    events = sorted([(start[mb], 1) for mb in end if mb in start] +
                    [(end[mb], -1) for mb in end if mb in start])
    alive = best = 0
    for _, step in events:
        alive += step
        best = max(best, alive)
    return best
