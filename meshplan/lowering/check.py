"""check: prove a set of RankPlans consistent before anything runs.

Proves, in order (each failure is one message; `errors` lists them all):
1. ids are unique across ranks, every task id decodes to its own rank, and
   every task reads and writes only buffers of its own rank's plan;
   every op of the rank's stage in the Job is exactly one of its tasks (no
   collective, gradient reduction or optimizer update dropped or doubled),
   and every collective's group (a ring attention's too) is the rank's line
   along the op's axis;
2. every send task has exactly one matching recv task on its peer (peer,
   box, shape, dtype, bytes) and vice versa, and every SEND action of a
   micro-batch has the peer's RECV action of the same micro-batch;
3. every collective (and ring attention: its steps are sends to the next
   member and receives from the one before, which each member posts before
   it waits) has the same participants and the same position in the
   per-group order on every member (the group's sequence of (op,
   micro-batch) instances, expanded from each member's action order); every
   gradient bucket starts in its task group after the last value it carries
   is made, and a per-micro-batch bucket before its reductions run
   (`buckets.misplaced`);
4. all ranks of a stage run the same action list, and that list is a
   valid schedule (`schedules.validate`: one F and one B per virtual stage
   and micro-batch, in order, each SEND and RECV once, inputs received
   before use; and one STEP, last); a discrete-event
   simulation of the stages (the schedule simulator, with per-action costs
   from the op cost model) finishes with no deadlock; it reports the bubble
   ratio, the predicted step time and each rank's planned peak memory;
5. every copy of a parameter takes the same update: each rank reading a
   trained parameter updates it, and copies on several stages (a tied
   weight) run the same optimizer op on one gradient all-reduced across
   exactly those stages (`lowering/check_shared.py`);
6. every plan is for one device type, the same on every rank; each task id's
   device-type field says it; and no task of a non-cpu plan runs a CPU-only
   kernel (a name containing `_for_cpu`);
7. with the backward split (zero-bubble schedules), I never waits for W,
   and every value one action leaves for a later one (an activation, an
   output gradient a deferred W reads) has a memory slot for each
   micro-batch the action order keeps alive at once
   (`lowering/check_live.py`);
8. with clipping, every rank's gradient norm counts every trained parameter
   exactly once: the pieces its grad_sq tasks count, brought together by
   the all-reduces from each rank's sum to its factor, tile each parameter
   (`lowering/check_norm.py`);
9. every state a rank writes rests where it is read: each update's value
   has its state's local shape and dtype on the rank
   (`lowering/check_state.py`).
Failures that point at an action come with the schedule grid and
`<-- ERROR HERE`.

Given only some ranks' plans, the result is `partial` and names the `missing`
ranks and the proofs `skipped` for want of them: transfers and collectives
are matched among the plans given, and with a whole stage missing there is
no schedule proof and no simulation (no bubble ratio, no step time).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from functools import partial

from meshplan.costmodel import CPU_DEFAULT, DeviceModel
from meshplan.errors import ScheduleError
from meshplan.ir import Phase
from meshplan.ir.job import Job
from meshplan.ir.kinds import CLIP_COEF, TRANSFER
from meshplan.ir.stage_placement import StagePlacement
from meshplan.lowering.action_times import action_costs
from meshplan.lowering.buckets import buckets_of, misplaced, run_order
from meshplan.lowering.check_live import split_and_live
from meshplan.lowering.check_norm import norm_coverage
from meshplan.lowering.check_shared import shared_copies
from meshplan.lowering.check_state import states_rest
from meshplan.lowering.ids import DEVICE_TYPES, LOCAL_BITS, TaskId
from meshplan.lowering.rankplan import (
    RankPlan,
    TaskKind,
    expand_collectives,
    joins_group,
    line_axis,
)
from meshplan.schedules import stage_placement
from meshplan.schedules.action import ActionType
from meshplan.schedules.grid import format_grid
from meshplan.schedules.simulate import simulate
from meshplan.schedules.validate import validate


@dataclass(frozen=True)
class RankCheck:
    """One checked rank's plan, in numbers."""

    planned_peak_bytes: int
    peak_by_category: dict[str, int]
    tasks: int
    buffers: int
    stage: int

    @staticmethod
    def of(p: RankPlan) -> RankCheck:
        """`p`'s figures (a class's members share them)."""
        return RankCheck(p.memory.peak_bytes(), dict(p.memory.peak[:-1]), len(p.tasks),
                         len(p.buffers), p.stage)


@dataclass
class CheckResult:
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    bubble_ratio: float | None = None
    predicted_step_s: float | None = None
    ranks: dict[int, RankCheck] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)  # ranks of the world without a plan
    skipped: list[str] = field(default_factory=list)  # proofs that needed them

    @property
    def partial(self) -> bool:
        return bool(self.missing)

    def to_json(self) -> dict:
        return {"ok": self.ok, "partial": self.partial, "missing": spans(self.missing),
                "skipped": self.skipped, "errors": self.errors,
                "bubble_ratio": self.bubble_ratio, "predicted_step_s": self.predicted_step_s,
                "ranks": {str(r): asdict(v) for r, v in sorted(self.ranks.items())}}


def spans(ranks: list[int]) -> str:
    """[1, 2, 3, 4, 6, 7] -> "1-4, 6-7"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_plans(job: Job, plans: dict[int, RankPlan], covered=frozenset(),
                norm_plans=None, norm_errors: list[str] | None = None) -> CheckResult:
    """Run every proof over `plans` (all ranks' or some); never raises for a
    bad plan. Ranks in `covered` are not missing: their plans are translates
    of given ones (`lowering/check_classes.py`), so their transfers and
    collectives are proven by those; `norm_plans` (default `plans`) are the
    plans the gradient norm's proof reads, every rank's, unless its
    `norm_errors` are given (argued over classes)."""
    absent = _absent(job, plans) - set(covered)
    res = CheckResult(missing=sorted(absent))
    res.skipped = _skipped(job, plans, absent)
    for proof in (_unique_ids, _references, _tasks_match_job, partial(_p2p, absent=absent),
                  _collectives, _stages_agree, _schedule, shared_copies, _devices,
                  split_and_live, states_rest):
        res.errors += proof(job, plans)
    if not res.missing:  # the norm's total sums over ranks that may be missing
        res.errors += norm_errors if norm_errors is not None else norm_coverage(
            job, plans if norm_plans is None else norm_plans)
    if not res.errors:
        _simulate(job, plans, res)
    res.ok = not res.errors
    res.ranks = {r: RankCheck.of(p) for r, p in sorted(plans.items())}
    return res


def _skipped(job: Job, plans, missing: set[int]) -> list[str]:
    """The proofs a partial set of plans cannot make."""
    tasks = [t for p in plans.values() for t in p.tasks]
    out = []
    if any(t.peer in missing for t in tasks if t.kind in (TaskKind.SEND, TaskKind.RECV)):
        out.append("send/recv with the missing ranks")
    if any(missing.intersection(t.group) for t in tasks):
        out.append("collective order on the missing ranks")
    if _stage_plans(job, plans) is None:
        out += ["schedule", "simulation"]
    if missing and any(op.kind == CLIP_COEF for op in job.graph.ops):
        out.append("gradient norm coverage")
    return out


def _unique_ids(job: Job, plans) -> list[str]:
    """Task ids, and the (rank << LOCAL_BITS) ids of buffers, blocks and memory arenas,
    are each unique across all ranks."""
    errors = []
    tasks: Counter = Counter()
    local: Counter = Counter()
    for r, p in plans.items():
        tasks.update(t.id for t in p.tasks)
        local.update([b.id for b in p.buffers] + [b.id for b in p.memory.blocks]
                     + [c[0] for c in p.memory.arenas])
        wrong = next((t for t in p.tasks if TaskId.unpack(t.id).rank != r), None)
        if wrong is not None:
            errors.append(f"rank {r}: task {wrong.id:#x} (op {wrong.op}) decodes to rank "
                          f"{TaskId.unpack(wrong.id).rank}; task ids must carry their rank")
        bad = next((b for b in p.buffers if b.id >> LOCAL_BITS != r), None)
        if bad is not None:
            errors.append(f"rank {r}: buffer {bad.id:#x} is not in the rank's id space "
                          f"({r} << {LOCAL_BITS})")
    for name, seen in (("task", tasks), ("buffer/block/chunk", local)):
        dups = sorted(i for i, n in seen.items() if n > 1)
        if dups:
            errors.append(f"{len(dups)} duplicated {name} ids, e.g. {dups[0]:#x} (rank "
                          f"{dups[0] >> LOCAL_BITS}); ids must be unique across ranks")
    return errors


def _references(job: Job, plans) -> list[str]:
    """Every task's buffer ids name buffers of its own plan (so the proofs
    below, and the cost model, can look them up)."""
    errors = []
    for r, p in sorted(plans.items()):
        own = {b.id for b in p.buffers}
        for t in p.tasks:
            missing = next((i for i in t.inputs + t.outputs if i >= 0 and i not in own), None)
            if missing is not None:
                errors.append(f"rank {r}: task {t.id:#x} (op {t.op}) uses buffer {missing:#x}, "
                              "which is not among the rank's buffers; recompile the plan")
                break
    return errors


def _tasks_match_job(job: Job, plans) -> list[str]:
    """Every op of a rank's stage is exactly one of its tasks (no collective,
    gradient or optimizer update dropped or doubled), and every collective's
    group is the rank's line along the op's mesh axis in its placement (for
    a shared parameter's all-reduce, its line through the copies' stages)."""
    s = job.strategy
    errors = []
    for r, p in sorted(plans.items()):
        want = Counter(op.id for op in job.graph.ops if job.stage[op.id] == p.stage
                       and op.kind != TRANSFER)
        have = Counter(t.op for t in p.tasks if t.kind not in (TaskKind.SEND, TaskKind.RECV))
        for op_id in sorted(set(want) | set(have)):
            if want[op_id] != have[op_id]:
                op = job.graph.ops[op_id]
                errors.append(f"rank {r} runs {have[op_id]} task(s) of op {op_id} ({op.kind} at "
                              f"'{op.module_path}') but its stage has {want[op_id]}; recompile")
                break
        place = s.placement(p.stage)
        coord = place.coord(r)
        for t in p.tasks:
            if not joins_group(t):
                continue
            kw = dict(job.graph.ops[t.op].kwargs)
            inside = line_axis(t.variant)
            if inside is not None:  # a ring's blocks, routed experts' rows travel along it
                kw = {"axis": inside}
            if "stages" in kw:  # across the stages holding copies of a shared parameter
                axis = f"stages {list(kw['stages'])}"
                line = tuple(s.placement(st).rank_at(coord) for st in kw["stages"])
            else:
                axis = kw["axis"]
                line = tuple(place.rank_at(coord[:axis] + (k,) + coord[axis + 1:])
                             for k in range(place.grid[axis]))
            if t.group != line:
                errors.append(f"rank {r}: collective op {t.op} runs over {list(t.group)} but "
                              f"its axis {axis} line is {list(line)}; recompile")
                break
    return errors


def _absent(job: Job, plans) -> set[int]:
    """The ranks of the world whose plans were not given."""
    return set(range(job.mesh.world)) - set(plans)


def _p2p(job: Job, plans, absent: set[int]) -> list[str]:
    errors = []
    by_id = {t.id: (r, t) for r, p in plans.items() for t in p.tasks
             if t.kind in (TaskKind.SEND, TaskKind.RECV)}
    bufs = {b.id: b for p in plans.values() for b in p.buffers}
    for tid, (r, t) in sorted(by_id.items()):
        if t.peer in absent:
            continue  # a partial set of plans: `skipped` says so
        other = by_id.get(t.peer_task)
        want = TaskKind.RECV if t.kind is TaskKind.SEND else TaskKind.SEND
        if other is None or other[0] != t.peer or other[1].kind is not want:
            errors.append(f"rank {r}: {t.kind.value} of op {t.op} "
                          f"({job.graph.ops[t.op].module_path or '<root>'}) to rank {t.peer} has "
                          f"no matching {want.value} there; the plans disagree on this transfer")
            continue
        peer_t = other[1]
        mine = bufs.get(((t.inputs or t.outputs) or (-1,))[0])
        theirs = bufs.get(((peer_t.inputs or peer_t.outputs) or (-1,))[0])
        if mine is None or theirs is None:
            continue  # a dangling buffer id: `_references` reports it
        if (peer_t.peer_task != tid or peer_t.box != t.box or mine.dtype != theirs.dtype):
            errors.append(f"rank {r}: {t.kind.value} of op {t.op} and its peer on rank {t.peer} "
                          f"disagree on the piece: box {t.box} vs {peer_t.box}, dtype "
                          f"{mine.dtype.name} vs {theirs.dtype.name}")
    errors += _p2p_actions(job, plans, absent)
    return errors


def _p2p_actions(job: Job, plans, absent: set[int]) -> list[str]:
    """Every SEND action instance has its peer's RECV action instance."""
    where = stage_placement(job.strategy)
    recvs = set()
    for r, p in plans.items():
        for a in p.actions:
            if a.type in (ActionType.RECV_F, ActionType.RECV_B):
                recvs.add((r, a.type, a.peer, a.virtual_stage, a.microbatch))
    errors = []
    for r, p in plans.items():
        peers_of = _send_peers(p, where)
        for i, a in enumerate(p.actions):
            if a.type not in (ActionType.SEND_F, ActionType.SEND_B):
                continue
            want = ActionType.RECV_F if a.type is ActionType.SEND_F else ActionType.RECV_B
            v = a.virtual_stage
            for peer in peers_of.get((v, a.type), ()):
                if peer not in absent and (peer, want, v, a.peer, a.microbatch) not in recvs:
                    grid = format_grid({q: plans[q].actions for q in (r, peer) if q in plans},
                                       mark=(r, i), column="rank")
                    errors.append(f"rank {r}: {a} has no {want.value} of micro-batch "
                                  f"{a.microbatch} on rank {peer}\n{grid}")
                    return errors
    return errors


def _send_peers(p: RankPlan, where: StagePlacement) -> dict:
    out = defaultdict(set)
    for t in p.tasks:
        if t.kind is TaskKind.SEND:
            kind = ActionType.SEND_F if t.phase is Phase.FORWARD else ActionType.SEND_B
            out[(where.stage_at(p.stage, t.chunk), kind)].add(t.peer)
    return out


def _collectives(job: Job, plans) -> list[str]:
    where = stage_placement(job.strategy)
    per_group: dict[tuple, dict[int, list]] = defaultdict(dict)
    errors = []
    for r, p in plans.items():
        buckets, op_of = p.buckets, job.graph.ops.__getitem__
        if buckets != buckets_of(job, p) or p.run_ids not in (
                (), tuple(t.id for t in run_order(p.tasks, buckets, op_of))):
            errors.append(f"rank {r}: its plan's gradient buckets or their run order are not "
                          "the ones its Job implies; recompile the plan")
        errors += [f"rank {r}: {e}" for e in misplaced(p.tasks, buckets, op_of)]
        for group, seq in expand_collectives(p, where, job.graph.ops, buckets).items():
            if r not in group:
                return [f"rank {r} joins a collective of group {group} it is not in"]
            per_group[group][r] = seq
    for group, seqs in sorted(per_group.items()):
        members = [r for r in group if r in plans]
        ref = seqs.get(members[0], [])
        for r in members[1:]:
            mine = seqs.get(r, [])
            if mine != ref:
                k = next((i for i, (x, y) in enumerate(zip(ref, mine)) if x != y),
                         min(len(ref), len(mine)))
                got = mine[k] if k < len(mine) else "nothing"
                errors.append(f"collective order differs in group {list(group)}: at position "
                              f"{k} rank {members[0]} runs {ref[k] if k < len(ref) else 'nothing'}"
                              f" (op, micro-batch) but rank {r} runs {got}; every member must "
                              "issue the group's collectives in one order")
                break
    return errors


def _stages_agree(job: Job, plans) -> list[str]:
    first: dict[int, RankPlan] = {}
    for r, p in sorted(plans.items()):
        ref = first.setdefault(p.stage, p)
        if p.actions != ref.actions:
            k = next((i for i, (x, y) in enumerate(zip(ref.actions, p.actions)) if x != y), 0)
            grid = format_grid({ref.rank: ref.actions, r: p.actions}, mark=(r, k),
                               column="rank")
            return [f"ranks {ref.rank} and {r} of stage {p.stage} run different action lists "
                    f"(from action {k})\n{grid}"]
    return []


def _stage_plans(job: Job, plans) -> dict[int, RankPlan] | None:
    """One plan per stage (the lowest rank's); None when a stage is missing."""
    reps: dict[int, RankPlan] = {}
    for _, p in sorted(plans.items()):
        reps.setdefault(p.stage, p)
    return reps if len(reps) >= job.strategy.pp else None


def _edges(job: Job, reps: dict[int, RankPlan]) -> list[tuple[int, int, str]]:
    """The stage-crossing transfers the plans send: (src, dst virtual stage, F|B)."""
    where = stage_placement(job.strategy)
    return sorted({(where.stage_at(p.stage, t.chunk), _dst_stage(job, t),
                    "F" if t.phase is Phase.FORWARD else "B")
                   for p in reps.values() for t in p.tasks if t.kind is TaskKind.SEND})


def _schedule(job: Job, plans) -> list[str]:
    reps = _stage_plans(job, plans)
    if reps is None:
        return []  # a partial set of plans: the other proofs only
    for stage, p in sorted(reps.items()):
        steps = [i for i, a in enumerate(p.actions) if a.type is ActionType.STEP]
        if steps != [len(p.actions) - 1]:
            return [f"rank {p.rank} (stage {stage}) has {len(steps)} STEP actions; a plan ends "
                    "in exactly one STEP (the optimizer); recompile it"]
    s = job.strategy
    try:
        validate({st: list(p.actions) for st, p in reps.items()}, s.pp, s.vpp,
                 s.num_microbatches, edges=_edges(job, reps), placement=stage_placement(s))
    except ScheduleError as e:
        return [str(e)]
    return []


def simulate_plans(job: Job, plans, dev: DeviceModel = CPU_DEFAULT):
    """The step simulated on one plan per stage (all ranks of a stage run the
    same actions), with per-action costs from the op cost model on device
    model `dev` (F, I and W each their own; B = I + W); None when `plans`
    lacks a stage."""
    reps = _stage_plans(job, plans)
    if reps is None:
        return None
    cost = action_costs(job, reps, dev)
    actions = {s: list(p.actions) for s, p in reps.items()}
    return simulate(actions, job.strategy.pp, cost_f=lambda v: cost[(v, "F")],
                    cost_i=lambda v: cost[(v, "I")], cost_w=lambda v: cost[(v, "W")],
                    cost_comm=lambda kind, src, dst: cost.get(("comm", src, dst), 0.0),
                    cost_step=max(cost.get(("step", s), 0.0) for s in reps),
                    edges=_edges(job, reps), placement=stage_placement(job.strategy))


def _simulate(job: Job, plans, res: CheckResult) -> None:
    sim = simulate_plans(job, plans)
    if sim is None:
        return  # a partial set of plans: proofs above only
    if not sim.ok:
        res.errors.append(f"the simulated step deadlocks: {sim.deadlock}")
        return
    res.bubble_ratio = sim.bubble_ratio
    res.predicted_step_s = sim.step_time


def _dst_stage(job: Job, t) -> int:
    op = job.graph.ops[t.op]
    return stage_placement(job.strategy).stage_at(job.stage[op.id], job.chunk[op.id])


def _devices(job: Job, plans) -> list[str]:
    """One device type for all ranks, in every task id; no CPU-only kernel
    in a plan for another device."""
    kinds = sorted({p.device for p in plans.values()})
    if len(kinds) > 1:
        return [f"plans are lowered for different device types {kinds}; compile every "
                "rank with one --device"]
    errors = []
    for r, p in sorted(plans.items()):
        code = DEVICE_TYPES.get(p.device)
        wrong = next((t for t in p.tasks if TaskId.unpack(t.id).device_type != code), None)
        if wrong is not None:
            errors.append(f"rank {r}: task {wrong.id} is not on device type {p.device}; "
                          "recompile the plans")
        if p.device != "cpu":
            bad = next((t for t in p.tasks if "_for_cpu" in p.kernel_of(t, job.graph)), None)
            if bad is not None:
                errors.append(f"rank {r}: task {bad.id} runs the CPU-only kernel "
                              f"{p.kernel_of(bad, job.graph)} in a {p.device} plan; "
                              "its op rule needs a kernel for this device")
    return errors
