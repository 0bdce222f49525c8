"""Static checks of a lowered schedule (compute + SEND/RECV), no processes.

Invariants a valid schedule keeps (each failure is one ScheduleError whose
message has the bounded grid with `<-- ERROR HERE` on the offending action):
- every action of rank r names a virtual stage of rank r (`stage % pp == r`,
  `stage < pp * vpp`) and a micro-batch in 0..m-1;
- every rank runs exactly one F and one B per (own stage, micro-batch), and
  B(v, mb) comes after F(v, mb);
- a compute action that consumes a transfer comes after its producer (same
  rank) or after its RECV (other rank); a SEND comes after its producer;
- every SEND has exactly one matching RECV (same kind, micro-batch, stages
  swapped as stage/peer, on the peer's rank) and vice versa, and each names a
  cross-rank transfer of `edges` (the chain by default).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from meshplan.errors import ScheduleError
from meshplan.schedules.action import Action, ActionType, rank_of
from meshplan.schedules.comm import EdgeLike, Transfer, normalize_edges
from meshplan.schedules.grid import format_grid

__all__ = ["format_grid", "validate"]

_RECV = {ActionType.F: ActionType.RECV_F, ActionType.B: ActionType.RECV_B}
Key = tuple[ActionType, int, int, int]  # (kind, src stage, dst stage, microbatch)


class _Fail(Exception):
    def __init__(self, message: str, mark: tuple[int, int]):
        super().__init__(message)
        self.message, self.mark = message, mark


def validate(actions: Mapping[int, Sequence[Action]], pp: int, vpp: int, m: int,
             edges: Iterable[EdgeLike] | None = None) -> None:
    """Raise ScheduleError unless `actions` (rank -> list) is a valid schedule."""
    head = f"invalid schedule (pp={pp} vpp={vpp} num_microbatches={m})"
    bad = [r for r in actions if not (isinstance(r, int) and 0 <= r < pp)]
    if bad:
        raise ScheduleError(f"{head}: ranks {bad} are outside 0..{pp - 1}")
    transfers = normalize_edges(edges, pp * vpp)
    inputs: dict[tuple[ActionType, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        inputs[(t.kind, t.dst)].append(t)
    cross = {t for t in transfers if t.cross_rank(pp)}
    try:
        sends: dict[tuple, tuple[int, int]] = {}  # (kind, src, dst, mb) -> (rank, index)
        recvs: dict[tuple, tuple[int, int]] = {}
        for rank in sorted(actions):
            _scan_rank(rank, actions[rank], pp, vpp, m, (inputs, cross), sends, recvs)
        _check_complete(actions, pp, vpp, m)
        _check_matching(sends, recvs)
    except _Fail as fail:
        grid = format_grid(actions, fail.mark)
        raise ScheduleError(f"{head}: {fail.message}\n{grid}") from None


def _scan_rank(rank: int, acts: Sequence[Action], pp: int, vpp: int, m: int,
               edges: tuple[dict, set[Transfer]], sends: dict, recvs: dict) -> None:
    inputs, cross = edges
    done: set[tuple[ActionType, int, int]] = set()  # computed (kind, stage, mb)
    for i, a in enumerate(acts):
        where = (rank, i)
        if a.type is ActionType.STEP:
            continue
        _check_place(a, rank, pp, vpp, m, where)
        if a.type.is_compute:
            _check_compute(a, pp, inputs, done, recvs, where)
            done.add((a.type, a.stage, a.microbatch))
        elif a.type.is_send:
            key = (a.type.kind, a.stage, a.peer, a.microbatch)
            _check_comm(a, key, cross, sends, where)
            if (a.type.kind, a.stage, a.microbatch) not in done:
                raise _Fail(f"rank {rank} sends {a} before computing "
                            f"{a.stage}{a.type.kind.value}{a.microbatch}; move the SEND "
                            f"after it", where)
            sends[key] = where
        else:
            key = (a.type.kind, a.peer, a.stage, a.microbatch)
            _check_comm(a, key, cross, recvs, where)
            recvs[key] = where


def _check_place(a: Action, rank: int, pp: int, vpp: int, m: int, where) -> None:
    if not 0 <= a.stage < pp * vpp or rank_of(a.stage, pp) != rank:
        own = ", ".join(str(c * pp + rank) for c in range(vpp))
        raise _Fail(f"rank {rank} runs {a} but stage {a.stage} is not one of its "
                    f"stages ({own})", where)
    if not 0 <= a.microbatch < m:
        raise _Fail(f"rank {rank} runs {a} but micro-batches are 0..{m - 1}", where)


def _check_compute(a: Action, pp: int, inputs: dict[tuple[ActionType, int], list[Transfer]],
                   done: set, recvs: dict, where) -> None:
    rank, mb = where[0], a.microbatch
    if (a.type, a.stage, mb) in done:
        raise _Fail(f"rank {rank} runs {a} twice; each (stage, micro-batch) runs one "
                    f"{a.type.value}", where)
    if a.type is ActionType.B and (ActionType.F, a.stage, mb) not in done:
        raise _Fail(f"rank {rank} runs {a} before its forward {a.stage}F{mb}; "
                    f"B(v, mb) must follow F(v, mb)", where)
    for t in inputs.get((a.type, a.stage), ()):
        if not t.cross_rank(pp):
            if (t.kind, t.src, mb) not in done:
                raise _Fail(f"rank {rank} runs {a} before {t.src}{t.kind.value}{mb}, whose "
                            f"output it consumes; run that first", where)
        elif (t.kind, t.src, t.dst, mb) not in recvs:
            recv = Action(a.stage, _RECV[t.kind], mb, t.src)
            raise _Fail(f"rank {rank} runs {a} before receiving its input {recv}; "
                        f"put {recv} before it (comm.add_comm does)", where)


def _check_comm(a: Action, key: Key, cross: set[Transfer], seen: dict, where) -> None:
    kind, src, dst, mb = key
    if Transfer(kind, src, dst) not in cross:
        raise _Fail(f"rank {where[0]} has {a} but there is no cross-rank {kind.value} "
                    f"transfer from stage {src} to stage {dst}", where)
    if key in seen:
        raise _Fail(f"rank {where[0]} has {a} twice (first at step {seen[key][1]})", where)


def _check_complete(actions: Mapping[int, Sequence[Action]], pp: int, vpp: int, m: int) -> None:
    for rank in range(pp):
        acts = actions.get(rank, ())
        have = {(a.type, a.stage, a.microbatch) for a in acts if a.type.is_compute}
        for chunk in range(vpp):
            stage = chunk * pp + rank
            for mb in range(m):
                for kind in (ActionType.F, ActionType.B):
                    if (kind, stage, mb) not in have:
                        raise _Fail(f"rank {rank} never runs {stage}{kind.value}{mb}; every "
                                    f"(stage, micro-batch) needs one F and one B",
                                    (rank, len(acts)))


def _check_matching(sends: dict[Key, tuple[int, int]], recvs: dict[Key, tuple[int, int]]) -> None:
    for key, where in sends.items():
        if key not in recvs:
            kind, src, dst, mb = key
            raise _Fail(f"rank {where[0]} sends {kind.value} of micro-batch {mb} from stage "
                        f"{src} to stage {dst}, but no rank posts the matching "
                        f"{dst}RECV_{kind.value}{mb}", where)
    for key, where in recvs.items():
        if key not in sends:
            kind, src, dst, mb = key
            raise _Fail(f"rank {where[0]} waits for {kind.value} of micro-batch {mb} from "
                        f"stage {src}, but no rank posts the matching {src}SEND_{kind.value}"
                        f"{mb}", where)
