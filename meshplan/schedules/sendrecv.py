"""The one shared lowering that adds SEND/RECV to compute-only schedules.

Invariants:
- No schedule writes its own communication; `add_comm` is the only maker
  of SEND/RECV actions.
- A transfer `Transfer(kind, src, dst)` means the compute actions of
  transfer kind `kind` (`ActionType.transfer`: F for F; B for B and I) of
  virtual stage `src` produce what those of stage `dst` consume, for the
  same micro-batch. So the input gradient (SEND_B/RECV_B) leaves with I (or
  B) and arrives before I (or B) of the stage before; W moves nothing. The
  default transfers are the chain: F from v to v+1 and B from v+1 to v.
- A transfer between virtual stages of the same stage (the
  `StagePlacement`'s, interleaved by default) needs no action: with the V
  placement, virtual stages pp-1 and pp. Across stages: the producer's
  stage gets SEND right after the producing compute action; the consumer's
  stage gets RECV right before the consuming one.
- Output is deterministic: stages keep their key order, several SENDs after
  one action (or RECVs before one) follow the order of `edges`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from meshplan.errors import ScheduleError
from meshplan.ir.stage_placement import StagePlacement, placement_for
from meshplan.schedules.action import Action, ActionType

_SEND = {ActionType.F: ActionType.SEND_F, ActionType.B: ActionType.SEND_B}
_RECV = {ActionType.F: ActionType.RECV_F, ActionType.B: ActionType.RECV_B}

@dataclass(frozen=True, slots=True)
class Transfer:
    """Output of `kind` at virtual stage `src` feeds `kind` at `dst` (per micro-batch)."""

    kind: ActionType
    src: int
    dst: int

    def cross_stage(self, placement: StagePlacement) -> bool:
        return not placement.same_rank(self.src, self.dst)


EdgeLike = Union[Transfer, tuple[int, int, Union[str, ActionType]]]


def chain_edges(num_virtual_stages: int) -> list[Transfer]:
    """The pipeline chain: F v -> v+1 and B v+1 -> v for each neighbour pair."""
    out = [Transfer(ActionType.F, v, v + 1) for v in range(num_virtual_stages - 1)]
    out += [Transfer(ActionType.B, v + 1, v) for v in range(num_virtual_stages - 1)]
    return out


def num_virtual_stages_of(actions: Mapping[int, Sequence[Action]]) -> int:
    """Number of virtual stages the actions mention (the largest + 1)."""
    stages = [a.virtual_stage for acts in actions.values() for a in acts if a.virtual_stage >= 0]
    peers = [a.peer for acts in actions.values() for a in acts if a.peer >= 0]
    return max(stages + peers, default=-1) + 1


def normalize_edges(edges: Iterable[EdgeLike] | None,
                    num_virtual_stages: int) -> list[Transfer]:
    """`edges` as Transfers (chain when None); ScheduleError on a malformed one."""
    if edges is None:
        return chain_edges(num_virtual_stages)
    out = []
    for edge in edges:
        if isinstance(edge, Transfer):
            out.append(edge)
            continue
        try:
            src, dst, kind = edge
            kind = kind if isinstance(kind, ActionType) else ActionType(kind)
        except (TypeError, ValueError):
            raise ScheduleError(f"bad transfer {edge!r}; expected (src_stage, dst_stage, "
                                f"'F' or 'B')") from None
        if kind not in (ActionType.F, ActionType.B) or src == dst:
            raise ScheduleError(f"bad transfer {edge!r}: kind must be 'F' or 'B' and "
                                f"src_stage != dst_stage")
        out.append(Transfer(kind, int(src), int(dst)))
    return out


def add_comm(compute: dict[int, list[Action]], pp: int,
             edges: Iterable[EdgeLike] | None = None,
             placement: StagePlacement | None = None) -> dict[int, list[Action]]:
    """Each stage's actions with SEND/RECV added for every transfer between stages.

    `compute` maps stage -> its compute actions (F, B, I, W, STEP); `edges`
    lists `(src, dst, "F"|"B")` transfers between virtual stages, the chain
    by default; `placement` says which virtual stages a stage runs
    (interleaved by default).
    """
    for stage, acts in compute.items():
        for a in acts:
            if a.type.is_comm:
                raise ScheduleError(f"add_comm takes compute actions only; stage {stage} "
                                    f"already has {a}")
    transfers = normalize_edges(edges, num_virtual_stages_of(compute))
    virtual = max([num_virtual_stages_of(compute)] + [max(t.src, t.dst) + 1 for t in transfers])
    where = placement_for(pp, virtual, placement)
    transfers = [t for t in transfers if t.cross_stage(where)]
    sends: dict[tuple[ActionType, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[ActionType, int], list[int]] = defaultdict(list)
    for t in transfers:
        sends[(t.kind, t.src)].append(t.dst)
        recvs[(t.kind, t.dst)].append(t.src)
    return {stage: _lower_stage(acts, sends, recvs) for stage, acts in compute.items()}


def _lower_stage(acts: Sequence[Action], sends: dict, recvs: dict) -> list[Action]:
    out: list[Action] = []
    for a in acts:
        kind = a.type.transfer if a.type.is_compute else None
        if kind is None:  # STEP or W
            out.append(a)
            continue
        v, mb = a.virtual_stage, a.microbatch
        out.extend(Action(v, _RECV[kind], mb, src) for src in recvs.get((kind, v), ()))
        out.append(a)
        out.extend(Action(v, _SEND[kind], mb, dst) for dst in sends.get((kind, v), ()))
    return out
