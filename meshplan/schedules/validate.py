"""Static checks of a schedule's per-stage action lists, no processes.

Invariants a valid schedule keeps (`validate` raises one ScheduleError whose
message has the bounded grid with `<-- ERROR HERE` on the offending action;
`find_fault` returns the same fault as data). Each message names the stage,
the action and the rule:
1. every action of stage r names a virtual stage that the `StagePlacement`
   (interleaved by default) gives stage r, so each virtual stage has one owner,
   and a micro-batch in 0..m-1;
2. for each (virtual stage, micro-batch) the stage runs one F, then one B or
   one I followed by one W: B and I come after F, W after I, B never
   beside I or W, nothing twice;
3. every (virtual stage, micro-batch) of the stage is complete: F and B, or F, I
   and W (so as many I as W);
4. a compute action that consumes a transfer (F: the forward input; B and
   I: the input gradient; W: none) comes after its producer (same stage) or
   after its RECV (other stage); a SEND comes after its producer;
5. every SEND has exactly one matching RECV (same kind, micro-batch, stages
   swapped as stage/peer, on the peer's stage) and vice versa, and each names
   a cross-stage transfer of `edges` (the chain by default).
With `lowered=False` the lists are compute orders (a CSV): no SEND/RECV may
appear and rule 4 checks same-stage producers only; a cross-stage wait cycle
is the simulator's to find.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement
from meshplan.schedules.action import Action, ActionType
from meshplan.schedules.grid import format_grid
from meshplan.schedules.sendrecv import EdgeLike, Transfer, normalize_edges

__all__ = ["Fault", "find_fault", "format_grid", "validate"]

_RECV = {ActionType.F: ActionType.RECV_F, ActionType.B: ActionType.RECV_B}
F, B, I, W = ActionType.F, ActionType.B, ActionType.I, ActionType.W  # noqa: E741
Key = tuple[ActionType, int, int, int]  # (kind, src stage, dst stage, microbatch)


@dataclass(frozen=True, slots=True)
class Fault:
    """The first broken rule: its message and where (stage, index in its list)."""

    message: str
    stage: int
    index: int


class _Fail(Exception):
    def __init__(self, message: str, mark: tuple[int, int]):
        super().__init__(message)
        self.fault = Fault(message, *mark)


@dataclass
class _Ctx:
    placement: StagePlacement
    m: int
    lowered: bool
    inputs: dict[tuple[ActionType, int], list[Transfer]]
    cross: set[Transfer]
    sends: dict[Key, tuple[int, int]] = field(default_factory=dict)
    recvs: dict[Key, tuple[int, int]] = field(default_factory=dict)


def validate(actions: Mapping[int, Sequence[Action]], pp: int, vpp: int, m: int,
             edges: Iterable[EdgeLike] | None = None, *,
             placement: StagePlacement | None = None) -> None:
    """Raise ScheduleError unless `actions` (stage -> lowered list) is a valid schedule."""
    head = f"invalid schedule (pp={pp} vpp={vpp} num_microbatches={m})"
    bad = [r for r in actions if not (isinstance(r, int) and 0 <= r < pp)]
    if bad:
        raise ScheduleError(f"{head}: stages {bad} are outside 0..{pp - 1}")
    fault = find_fault(actions, pp, vpp, m, edges, placement=placement)
    if fault is not None:
        grid = format_grid(actions, (fault.stage, fault.index))
        raise ScheduleError(f"{head}: {fault.message}\n{grid}")


def find_fault(actions: Mapping[int, Sequence[Action]], pp: int, vpp: int, m: int,
               edges: Iterable[EdgeLike] | None = None, *,
               placement: StagePlacement | None = None, lowered: bool = True) -> Fault | None:
    """The first rule `actions` breaks (see the module docstring), or None.

    The keys of `actions` must be stages in 0..pp-1."""
    where = placement or StagePlacement.interleaved(pp, vpp)
    if (where.pp, where.vpp) != (pp, vpp):
        raise ScheduleError(f"stage placement is for pp={where.pp} vpp={where.vpp}, the "
                            f"schedule for pp={pp} vpp={vpp}")
    transfers = normalize_edges(edges, pp * vpp)
    inputs: dict[tuple[ActionType, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        inputs[(t.kind, t.dst)].append(t)
    cross = {t for t in transfers if t.cross_stage(where)}
    ctx = _Ctx(where, m, lowered, inputs, cross)
    try:
        for stage in sorted(actions):
            _scan_stage(stage, actions[stage], ctx)
        _check_complete(actions, ctx)
        _check_matching(ctx.sends, ctx.recvs)
    except _Fail as fail:
        return fail.fault
    return None


def _scan_stage(stage: int, acts: Sequence[Action], ctx: _Ctx) -> None:
    ran: set[tuple[ActionType, int, int]] = set()  # compute actions run (type, stage, mb)
    for i, a in enumerate(acts):
        where = (stage, i)
        if a.type is ActionType.STEP:
            continue
        _check_place(a, stage, ctx, where)
        if a.type.is_compute:
            _check_order(a, ran, where)
            _check_inputs(a, ctx, ran, where)
            ran.add((a.type, a.virtual_stage, a.microbatch))
        elif not ctx.lowered:
            raise _Fail(f"stage {stage} has {a}, but a compute order holds F, B, I and W only; "
                        f"the lowering (sendrecv.add_comm) adds SEND/RECV", where)
        elif a.type.is_send:
            key = (a.type.kind, a.virtual_stage, a.peer, a.microbatch)
            _check_comm(a, key, ctx.cross, ctx.sends, where)
            if not _produced(ran, a.type.kind, a.virtual_stage, a.microbatch):
                raise _Fail(f"stage {stage} sends {a} before computing "
                            f"{a.virtual_stage}{a.type.kind.value}{a.microbatch}; move the SEND "
                            f"after it", where)
            ctx.sends[key] = where
        else:
            key = (a.type.kind, a.peer, a.virtual_stage, a.microbatch)
            _check_comm(a, key, ctx.cross, ctx.recvs, where)
            ctx.recvs[key] = where


def _produced(ran: set, kind: ActionType, stage: int, mb: int) -> bool:
    """Whether transfer `kind` of (stage, mb) exists: F after F, B after B or I."""
    makers = (F,) if kind is F else (B, I)
    return any((t, stage, mb) in ran for t in makers)


def _check_place(a: Action, stage: int, ctx: _Ctx, where) -> None:
    own = ctx.placement.stages_of(stage)
    if a.virtual_stage not in own:
        raise _Fail(f"stage {stage} runs {a} but virtual stage {a.virtual_stage} is not one "
                    f"of its ({', '.join(map(str, own))}); each virtual stage has one owner "
                    "stage", where)
    if not 0 <= a.microbatch < ctx.m:
        raise _Fail(f"stage {stage} runs {a} but micro-batches are 0..{ctx.m - 1}", where)


def _check_order(a: Action, ran: set, where) -> None:
    stage, s, mb, t = where[0], a.virtual_stage, a.microbatch, a.type
    if (t, s, mb) in ran:
        raise _Fail(f"stage {stage} runs {a} twice; each (virtual stage, micro-batch) runs one "
                    f"{t.value}", where)
    other = [o for o in ((I, W) if t is B else (B,) if t in (I, W) else ()) if (o, s, mb) in ran]
    if other:
        raise _Fail(f"stage {stage} runs {a} after {s}{other[0].value}{mb}; a (virtual "
                    f"stage, micro-batch) runs B, or I then W, not both", where)
    if t in (B, I) and (F, s, mb) not in ran:
        raise _Fail(f"stage {stage} runs {a} before its forward {s}F{mb}; "
                    f"{t.value}(v, mb) must follow F(v, mb)", where)
    if t is W and (I, s, mb) not in ran:
        raise _Fail(f"stage {stage} runs {a} before {s}I{mb}; W(v, mb) must follow "
                    f"I(v, mb)", where)


def _check_inputs(a: Action, ctx: _Ctx, ran: set, where) -> None:
    stage, mb = where[0], a.microbatch
    xfer = a.type.transfer
    if xfer is None:  # W: no transfer in
        return
    for t in ctx.inputs.get((xfer, a.virtual_stage), ()):
        if t not in ctx.cross:
            if not _produced(ran, t.kind, t.src, mb):
                raise _Fail(f"stage {stage} runs {a} before {t.src}{t.kind.value}{mb}, whose "
                            f"output it consumes; run that first", where)
        elif ctx.lowered and (t.kind, t.src, t.dst, mb) not in ctx.recvs:
            recv = Action(a.virtual_stage, _RECV[t.kind], mb, t.src)
            raise _Fail(f"stage {stage} runs {a} before receiving its input {recv}; "
                        f"put {recv} before it (sendrecv.add_comm does)", where)


def _check_comm(a: Action, key: Key, cross: set[Transfer], seen: dict, where) -> None:
    kind, src, dst, mb = key
    if Transfer(kind, src, dst) not in cross:
        raise _Fail(f"stage {where[0]} has {a} but there is no cross-stage {kind.value} "
                    f"transfer from virtual stage {src} to {dst}", where)
    if key in seen:
        raise _Fail(f"stage {where[0]} has {a} twice (first at step {seen[key][1]})", where)


def _check_complete(actions: Mapping[int, Sequence[Action]], ctx: _Ctx) -> None:
    for stage in range(ctx.placement.pp):
        acts = actions.get(stage, ())
        ran = {(a.type, a.virtual_stage, a.microbatch) for a in acts if a.type.is_compute}
        for v in ctx.placement.stages_of(stage):
            for mb in range(ctx.m):
                missing = _missing(stage, ran, v, mb)
                if missing:
                    raise _Fail(missing, (stage, len(acts)))


def _missing(stage: int, ran: set, s: int, mb: int) -> str | None:
    if (F, s, mb) not in ran:
        return f"stage {stage} never runs {s}F{mb}; every (virtual stage, micro-batch) needs one F"
    if (B, s, mb) not in ran and (I, s, mb) not in ran:
        return (f"stage {stage} never runs {s}B{mb} (nor {s}I{mb} and {s}W{mb}); every "
                f"(virtual stage, micro-batch) needs one backward: B, or I then W")
    if (I, s, mb) in ran and (W, s, mb) not in ran:
        return (f"stage {stage} runs {s}I{mb} but never {s}W{mb}; every I needs its W "
                f"(as many I as W)")
    return None


def _check_matching(sends: dict[Key, tuple[int, int]], recvs: dict[Key, tuple[int, int]]) -> None:
    for key, where in sends.items():
        if key not in recvs:
            kind, src, dst, mb = key
            raise _Fail(f"stage {where[0]} sends {kind.value} of micro-batch {mb} from virtual "
                        f"stage {src} to {dst}, but no stage posts the matching "
                        f"{dst}RECV_{kind.value}{mb}", where)
    for key, where in recvs.items():
        if key not in sends:
            kind, src, dst, mb = key
            raise _Fail(f"stage {where[0]} waits for {kind.value} of micro-batch {mb} from "
                        f"virtual stage {src}, but no stage posts the matching "
                        f"{src}SEND_{kind.value}{mb}", where)
