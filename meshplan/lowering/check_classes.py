"""check over plan classes: the proofs of `lowering/check.py` for every rank
of a plan directory, argued over its classes (`lowering/classes.py`).

A rank's plan is its class's body resolved at its grid coordinate. Proven:

- per rank (linear, a few dict lookups each): its head names its own rank
  (the file's), this Job, its stage and its coordinate (`rank_at(stage,
  coord)` is the rank: a renaming sending two ranks to one id fails here),
  and a class whose body is of that stage, for the same device, with the
  same coordinates on the fixed axes, and the one body every other rank of
  that class names;
- per class, on its representative (the member at coordinate 0 on every free
  axis), every proof of `check_plans`: ids, tasks against the Job, the groups'
  lines, matched transfers, collective order, the schedule and its
  simulation, shared copies, devices, the split and live values.

Why the representatives stand for every rank: members of a class differ
only by a translation along free axes, under which a body's groups (lines
along axes, or across the stages of a shared parameter's copies), peers (at
the member's own coordinate on free axes) and slices (offsets linear in the
coordinate) move with the member. So
- ids are unique: each rank's ids carry its rank, and the heads' ranks are
  distinct; within a plan, the class's ids are those of its representative;
- a member's send and its peer's receive are its representative's pair
  translated: the peer of a representative is a representative (its free
  coordinates are the sender's, 0), so matching them proves every pair;
- a group along a free axis holds members of one class (equal bodies, so one
  collective order); a group along a fixed axis or across stages through a
  representative holds only representatives, which are compared;
- all ranks of a stage run their class's actions: the representatives of a
  stage's classes are compared, and the schedule is simulated on one per stage.
The gradient norm's proof (with clipping) needs every rank's counted pieces:
it reads each member's norm tasks (its class's, with its own groups), linear
in the ranks.

A partial directory (`compile --ranks`) is checked rank by rank, each given
rank's plan resolved: the representatives may be missing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.ir import Phase
from meshplan.ir.job import Job
from meshplan.ir.kinds import ALL_REDUCE, CLIP_COEF, GRAD_SQ, SQ_SUM
from meshplan.lowering.check import CheckResult, RankCheck, check_plans
from meshplan.lowering.check_norm import clips
from meshplan.lowering.check_norm_classes import norm_over_classes
from meshplan.lowering.classes import GroupNames, fixed_axes
from meshplan.lowering.files import PlanDir, read_heads, read_job
from meshplan.lowering.rankplan import RankPlan

_NORM = {GRAD_SQ, SQ_SUM, ALL_REDUCE, CLIP_COEF}


def check_dir(out: Path, partial: bool = True) -> tuple[Job, CheckResult]:
    """The Job of plan directory `out` and every proof over its ranks (those
    it holds, with `partial`); a directory that cannot be read is a
    `PlanError`, a plan that fails a proof is in the result."""
    job = read_job(out)
    d, heads = read_heads(out, job, partial)
    return job, check_dir_plans(job, d, heads)


def check_dir_plans(job: Job, d: PlanDir, heads: dict[int, dict]) -> CheckResult:
    """Every proof over the ranks whose `heads` were read from `d`: over the
    classes when every rank is there, else rank by rank (a partial directory,
    `compile --ranks`)."""
    if len(heads) < job.mesh.world:
        return check_plans(job, {r: d.plan(h) for r, h in heads.items()})
    fixed = fixed_axes(job)
    places = [job.strategy.placement(st) for st in range(job.strategy.pp)]
    errors: list[str] = []
    members: dict[str, list[int]] = {}
    body_of: dict[tuple, tuple[int, str]] = {}  # (stage, fixed coords) -> (rank, class)
    for r, h in sorted(heads.items()):
        e = _head_errors(places, d, r, h, fixed)
        if not e:  # a head whose place is checked: its class is (stage, fixed coordinates)
            key = (h["stage"], tuple(h["coord"][a] for a in fixed))
            first, klass = body_of.setdefault(key, (r, h["class"]))
            if klass != h["class"]:
                e = (f"ranks {first} and {r} are of one class (stage {key[0]}, fixed "
                     f"coordinates {list(key[1])}) but name different bodies; recompile the "
                     "whole directory")
        if e:
            errors.append(e)
            continue
        members.setdefault(h["class"], []).append(r)
    if errors:
        return CheckResult(ok=False, errors=errors[:20])
    reps: dict[int, RankPlan] = {}
    rep_of: dict[int, int] = {}  # rank -> the representative standing for it
    for ranks in members.values():
        rep = next(r for r in ranks if all(c == 0 for a, c in enumerate(heads[r]["coord"])
                                           if a not in fixed))
        rep_of.update((r, rep) for r in ranks)
        reps[rep] = d.plan(heads[rep])
    norm_errors, norm = None, None
    if clips(job):
        classes = {}
        for k, ranks in members.items():
            r, body = rep_of[ranks[0]], d.body(k, "")
            classes[k] = (heads[r]["stage"], tuple(heads[r]["coord"][a] for a in fixed),
                          reps[r], [body["groups"][t[7]] for t in body["tasks"]])
        norm_errors = norm_over_classes(job, classes, fixed)
        if norm_errors is None:  # a chain with a listed group: every rank's norm read
            norm = _norm_plans(job, d, heads, members, reps, rep_of)
    res = check_plans(job, reps, set(rep_of) - set(reps), norm, norm_errors)
    res.ranks = {r: RankCheck.of(reps[rep_of[r]]) for r in sorted(heads)}
    return res


def _head_errors(places, d: PlanDir, r: int, h: dict, fixed) -> str:
    stage, coord = h["stage"], tuple(h["coord"])
    place = places[stage] if 0 <= stage < len(places) else None
    if place is None or len(coord) != len(place.grid) or not all(
            0 <= c < n for c, n in zip(coord, place.grid)) or place.rank_at(coord) != r:
        return (f"rank {r}: its head places it at stage {stage}, coordinate {list(coord)}, "
                f"which is not rank {r}'s place; recompile the whole directory")
    body = d.body(h["class"], f"rank {r}'s head")
    if body.get("stage") != stage or body.get("fixed") != [[a, coord[a]] for a in fixed] \
            or body.get("device") != h.get("device"):
        return (f"rank {r}: its head names class {h['class'][:12]}, which is not the class of "
                f"stage {stage} at coordinate {list(coord)}; recompile the whole directory")
    return ""


@dataclass(frozen=True)
class _NormView:
    """What the norm's proof reads of a rank's plan: its norm tasks, its coordinate."""

    tasks: tuple
    coord: tuple[int, ...]


def _norm_plans(job: Job, d: PlanDir, heads, members, reps, rep_of) -> dict:
    """Every rank's norm tasks: its class's, with the groups at its coordinate
    (a line resolved once for all its members)."""
    g, s = job.graph, job.strategy
    out: dict[int, object] = {}
    lines: dict[tuple, tuple[int, ...]] = {}
    for klass, ranks in members.items():
        rep = reps[rep_of[ranks[0]]]
        body = d.body(klass, "")
        # the norm's tasks: its squares and sums, and the step's all-reduces
        keep = [(i, t, body["groups"][body["tasks"][i][7]]) for i, t in enumerate(rep.tasks)
                if g.ops[t.op].kind in _NORM
                and (g.ops[t.op].kind != ALL_REDUCE or t.phase is Phase.OPTIMIZER)]
        for r in ranks:
            if r in reps:
                out[r] = reps[r]
                continue
            stage, coord = heads[r]["stage"], tuple(heads[r]["coord"])
            tasks = []
            for _, t, ref in keep:
                if not t.group:
                    tasks.append(t)
                    continue
                at = coord[:ref[1]] + (0,) + coord[ref[1] + 1:] if ref[0] == "axis" else coord
                key = (stage, repr(ref), at)
                if key not in lines:
                    lines[key] = GroupNames(s, stage, coord).of(ref)
                tasks.append(replace(t, group=lines[key]))
            out[r] = _NormView(tuple(tasks), coord)
    return out
