"""Discrete-event simulation of a lowered schedule: step time, bubbles, deadlocks.

Invariants:
- Each stage runs its actions in list order, one at a time.
- F, B, I, W (and STEP) occupy the stage for their cost; an action starts
  when the stage is free and its inputs exist: F(v, mb) needs the F output
  of its producer stages; B(v, mb) and I(v, mb) need F(v, mb) and the input
  gradient (made by B or I) of their producers; W(v, mb) needs I(v, mb). A
  producer on another stage (the `StagePlacement`'s, interleaved by
  default) is read through this stage's RECV; one on the same stage (pp == 1,
  custom edges, stages pp-1 and pp of the V) is waited for directly.
- Costs per compute kind, per virtual stage, with B = I + W: give cost_b
  (then I and W cost half of it each), or cost_i and cost_w (then B costs
  their sum).
- SEND is asynchronous: it takes no time, and is posted once its producing
  compute action has finished. RECV blocks its stage until
  max(its own start, SEND time + cost_comm(kind, src, dst)).
- With no stage contention besides the stage itself, every event time is the
  longest path to it in the dependency graph; the simulator therefore fires
  actions in dependency order (a stage blocked on an event is woken when the
  event happens), not through a global clock. Results are deterministic.
- A schedule where no stage can move while some have actions left is a
  deadlock: `ok=False`, `deadlock` names each stuck stage, its action and
  what it waits for, with the grid, and `stuck` maps each stuck stage to
  that action's index; nothing is raised. Then `step_time` and
  `bubble_ratio` are inf and the other fields cover finished actions only.
- bubble ratio of a stage = (step_time - busy) / busy; `bubble_ratio` is the
  max over stages.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement, placement_for
from meshplan.schedules import trace
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.grid import format_grid
from meshplan.schedules.sendrecv import EdgeLike, Transfer, normalize_edges, num_virtual_stages_of

# ("C", kind, stage, mb): output of kind F or B (from B or I) made, or W done;
# ("S"|"R", kind, src, dst, mb): send posted / recv done.
Event = tuple
Span = tuple[Action, float, float]
Cost = Callable[[int], float]
F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W  # noqa: E741


@dataclass(frozen=True, slots=True)
class SimResult:
    """What `simulate` predicts; see the module docstring for the meaning of each field."""

    ok: bool
    deadlock: str | None
    step_time: float
    busy: dict[int, float]
    finish: dict[int, float]
    bubble_ratio: float
    per_stage_bubble: dict[int, float]
    timeline: dict[int, list[Span]] = field(repr=False)
    stuck: dict[int, int] = field(default_factory=dict)  # stage -> index it is stuck at


def simulate(actions: Mapping[int, Sequence[Action]], pp: int,
             cost_f: Cost = lambda stage: 1.0, cost_b: Cost | None = None,
             cost_comm: Callable[[ActionType, int, int], float] = lambda kind, src, dst: 0.0,
             *, cost_i: Cost | None = None, cost_w: Cost | None = None,
             cost_step: float = 0.0, edges: Iterable[EdgeLike] | None = None,
             placement: StagePlacement | None = None) -> SimResult:
    """Simulate `actions` (stage -> lowered list) and predict the step.

    `cost_f(stage)`, `cost_b(stage)` (1 by default), `cost_i`, `cost_w` are
    per virtual stage (see the module docstring for B = I + W);
    `cost_comm(kind, src_stage, dst_stage)` gets kind ActionType.F or
    ActionType.B; `edges` and `placement` are those given to `add_comm`.
    """
    transfers = normalize_edges(edges, num_virtual_stages_of(actions))
    stages = max([num_virtual_stages_of(actions)] + [max(t.src, t.dst) + 1 for t in transfers])
    sim = _Sim(actions, placement_for(pp, stages, placement), transfers,
               kind_costs(cost_f, cost_b, cost_i, cost_w), cost_comm, cost_step)
    sim.run()
    return sim.result()


def kind_costs(cost_f: Cost, cost_b: Cost | None, cost_i: Cost | None,
               cost_w: Cost | None) -> dict[ActionType, Cost]:
    """The cost of each compute kind, with B = I + W (see the module docstring)."""
    if (cost_i is None) != (cost_w is None):
        raise ScheduleError("simulate: give cost_i and cost_w together (B = I + W)")
    if cost_i is None or cost_w is None:
        full = cost_b or (lambda stage: 1.0)
        return {F: cost_f, B: full, I: lambda s: full(s) / 2, W: lambda s: full(s) / 2}
    if cost_b is not None:
        raise ScheduleError("simulate: give cost_b, or cost_i and cost_w (B = I + W), not both")
    split_i, split_w = cost_i, cost_w
    return {F: cost_f, B: lambda s: split_i(s) + split_w(s), I: split_i, W: split_w}


class _Sim:
    def __init__(self, actions, placement: StagePlacement, transfers: list[Transfer], cost,
                 cost_comm, cost_step):
        self.actions, self.placement = actions, placement
        self.cost, self.cost_comm, self.cost_step = cost, cost_comm, cost_step
        self.inputs: dict[tuple[ActionType, int], list[Transfer]] = defaultdict(list)
        for t in transfers:
            self.inputs[(t.kind, t.dst)].append(t)
        self.times: dict[Event, float] = {}
        self.waiters: dict[Event, list[int]] = defaultdict(list)
        self.pc = dict.fromkeys(actions, 0)
        self.free = dict.fromkeys(actions, 0.0)
        self.busy = dict.fromkeys(actions, 0.0)
        self.timeline: dict[int, list[Span]] = {r: [] for r in actions}
        self.ready: deque[int] = deque(sorted(actions))  # stages that may be able to move

    def needs(self, a: Action) -> list[Event]:
        """The events `a` waits for (besides its stage being free)."""
        if a.type is ActionType.STEP:
            return []
        kind, mb = a.type.kind, a.microbatch
        if a.type.is_send:
            return [("C", kind, a.virtual_stage, mb)]
        if a.type.is_recv:
            return [("S", kind, a.peer, a.virtual_stage, mb)]
        own = {F: [], B: [F], I: [F], W: [B]}[kind]  # W waits for its I's input gradient
        out: list[Event] = [("C", k, a.virtual_stage, mb) for k in own]
        xfer = a.type.transfer
        if xfer is None:  # W: no transfer in
            return out
        for t in self.inputs.get((xfer, a.virtual_stage), ()):
            cross = not self.placement.same_rank(t.src, t.dst)
            out.append(("R", xfer, t.src, t.dst, mb) if cross else ("C", xfer, t.src, mb))
        return out

    def fire(self, stage: int, a: Action) -> None:
        """Run `a` on `stage` now that its inputs exist; record its event."""
        start = max([self.free[stage]] + [self.times[e] for e in self.needs(a)])
        kind = a.type.kind if a.type is not ActionType.STEP else None
        event: Event | None
        if a.type.is_recv:
            sent = self.times[("S", kind, a.peer, a.virtual_stage, a.microbatch)]
            start = self.free[stage]
            end = max(start, sent + self.cost_comm(kind, a.peer, a.virtual_stage))
            event = ("R", kind, a.peer, a.virtual_stage, a.microbatch)
        elif a.type.is_send:
            end, event = start, ("S", kind, a.virtual_stage, a.peer, a.microbatch)
        else:
            dur = self.cost_step if kind is None else self.cost[kind](a.virtual_stage)
            made = None if kind is None else a.type.transfer or kind
            end = start + dur
            event = None if made is None else ("C", made, a.virtual_stage, a.microbatch)
            self.busy[stage] += dur
        self.free[stage] = end
        self.timeline[stage].append((a, start, end))
        if event is not None:
            self.times[event] = end
            self.ready.extend(self.waiters.pop(event, ()))

    def run(self) -> None:
        while self.ready:
            stage = self.ready.popleft()
            acts = self.actions[stage]
            while self.pc[stage] < len(acts):
                a = acts[self.pc[stage]]
                missing = [e for e in self.needs(a) if e not in self.times]
                if missing:
                    self.waiters[missing[0]].append(stage)
                    break
                self.fire(stage, a)
                self.pc[stage] += 1

    def stuck(self) -> list[int]:
        return [r for r in sorted(self.actions) if self.pc[r] < len(self.actions[r])]

    def result(self) -> SimResult:
        finish = {r: (spans[-1][2] if spans else 0.0) for r, spans in self.timeline.items()}
        stuck = self.stuck()
        if stuck:
            return SimResult(False, self.explain(stuck), math.inf, dict(self.busy), finish,
                             math.inf, {r: math.inf for r in self.actions}, self.timeline,
                             {r: self.pc[r] for r in stuck})
        step = max(finish.values(), default=0.0)
        per_stage = {r: trace.ratio(step - b, b) for r, b in self.busy.items()}
        return SimResult(True, None, step, dict(self.busy), finish,
                         max(per_stage.values(), default=0.0), per_stage, self.timeline)

    def explain(self, stuck: list[int]) -> str:
        """One line per stuck stage (its action and what it waits for), then the grid."""
        lines = [f"deadlock: stages {stuck} cannot make progress"]
        for r in stuck[:8]:
            a = self.actions[r][self.pc[r]]
            waits = [self.describe(e) for e in self.needs(a) if e not in self.times]
            lines.append(f"  stage {r} is blocked at step {self.pc[r]} on {a}, waiting for "
                         f"{' and '.join(waits)}")
        if len(stuck) > 8:
            lines.append(f"  ... and {len(stuck) - 8} more stuck stages")
        lines.append("fix: reorder so every RECV's SEND is posted before the receiver needs it "
                     "(sendrecv.add_comm on a valid compute order does this)")
        marks = [(r, self.pc[r]) for r in stuck]
        return "\n".join(lines) + "\n" + format_grid(self.actions, marks)

    def describe(self, e: Event) -> str:
        """An event in words, with where its producer is (or that none exists)."""
        tag, kind = e[0], e[1]
        if tag == "C":
            want, v = Action(e[2], kind, e[3]), e[2]
            split = Action(e[2], I, e[3])  # B's input gradient may come from I
            if kind is B and split in self.actions.get(self.placement.rank_of(v), ()):
                want = split
        elif tag == "S":
            want, v = Action(e[2], _SEND[kind], e[4], e[3]), e[2]
        else:
            want, v = Action(e[3], _RECV[kind], e[4], e[2]), e[3]
        stage = self.placement.rank_of(v)
        acts = self.actions.get(stage, ())
        if want not in acts:
            return f"{want} on stage {stage}, which stage {stage} never runs"
        return f"{want} on stage {stage} (step {list(acts).index(want)}, not reached)"


_SEND = {ActionType.F: ActionType.SEND_F, ActionType.B: ActionType.SEND_B}
_RECV = {ActionType.F: ActionType.RECV_F, ActionType.B: ActionType.RECV_B}


def chrome_trace(result: SimResult, unit_us: float = 1000.0) -> dict:
    """Chrome/Perfetto trace JSON: one process per stage, one complete event per action.

    One simulated cost unit lasts `unit_us` microseconds (1 ms by default).
    """
    return trace.chrome_events(spans_of(result), unit_us)


def spans_of(result: SimResult) -> dict[int, list[trace.Span]]:
    """The simulated timeline as trace spans (stage -> spans, in cost units)."""
    return {r: [trace.action_span(a, s, e) for a, s, e in result.timeline[r]]
            for r in sorted(result.timeline)}


def finish_times(orders: Mapping[int, Sequence[Action]], placement: StagePlacement,
                 cost: Mapping[tuple[int, str], float],
                 comm: Mapping[tuple[int, int], float]):
    """`simulate`'s finish and busy time per stage for compute-only orders
    over the chain of virtual stages, in one lean pass: (finish, busy), or
    None when the orders deadlock.

    Same model as `simulate` on `add_comm(orders)` (a property test holds
    the two equal): an action starts when its stage is free and its inputs
    exist; an input made on another stage arrives `comm[(src, dst)]` after
    it was made. `cost[(v, k)]` is per virtual stage, k in "fiw" (B = I + W).
    """
    stages = sorted(orders)
    n_mb = 1 + max((a.microbatch for acts in orders.values() for a in acts), default=0)
    rank_of = placement.rank_of
    virtual = placement.num_stages
    made_f: list[float | None] = [None] * (virtual * n_mb)  # F output of (virtual stage, mb)
    made_g: list[float | None] = [None] * (virtual * n_mb)  # input gradient of (virtual stage, mb)
    kinds = {F: 0, B: 1, I: 2, W: 3}
    lists = {}
    for r in stages:
        todo = []
        for a in orders[r]:
            k = kinds[a.type]
            v = a.virtual_stage
            dur = (cost[(v, "f")] if k == 0 else cost[(v, "i")] + cost[(v, "w")] if k == 1
                   else cost[(v, "i")] if k == 2 else cost[(v, "w")])
            todo.append((k, v, a.microbatch, dur))
        lists[r] = todo
    pc = dict.fromkeys(stages, 0)
    free = dict.fromkeys(stages, 0.0)
    busy = dict.fromkeys(stages, 0.0)
    waiting: dict[tuple[int, int], list[int]] = {}
    ready = deque(stages)
    while ready:
        r = ready.popleft()
        todo, i, t = lists[r], pc[r], free[r]
        while i < len(todo):
            k, v, mb, dur = todo[i]
            start = t
            if k == 0 and v > 0:
                got = made_f[(v - 1) * n_mb + mb]
                if got is None:
                    waiting.setdefault((0, (v - 1) * n_mb + mb), []).append(r)
                    break
                src = v - 1
                start = max(start, got + (comm.get((src, v), 0.0) if rank_of(src) != r else 0.0))
            elif k in (1, 2) and v < virtual - 1:
                got = made_g[(v + 1) * n_mb + mb]
                if got is None:
                    waiting.setdefault((1, (v + 1) * n_mb + mb), []).append(r)
                    break
                src = v + 1
                start = max(start, got + (comm.get((src, v), 0.0) if rank_of(src) != r else 0.0))
            t = start + dur
            busy[r] += dur
            i += 1
            if k == 0:
                made_f[v * n_mb + mb] = t
                ready.extend(waiting.pop((0, v * n_mb + mb), ()))
            elif k in (1, 2):
                made_g[v * n_mb + mb] = t
                ready.extend(waiting.pop((1, v * n_mb + mb), ()))
        pc[r], free[r] = i, t
    if any(pc[r] < len(lists[r]) for r in stages):
        return None
    return free, busy
