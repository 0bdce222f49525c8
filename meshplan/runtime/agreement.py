"""The distributed check: before step 0, each rank checks its own plan
against its peers', so that no rank starts a step its peers do not share.

`meshplan check` proves a plan directory; a job whose ranks lower
themselves (torchrun) has no directory to prove. Each rank then checks,
with small messages:
1. one world all-gather of three int64 per rank: the Job's digest, its
   stage and the digest of its action list: every rank holds this Job, and
   the ranks of a stage run one action list;
2. per transfer peer, one exchange of two int64: the digests of what the
   rank sends to the peer and of what it receives from it (op, box, dtype
   of each piece): each side's sends are the other's receives;
3. per collective group, an all-gather of one int64 over the group: the
   digest of the group's collectives in the rank's order (`check`'s
   `expand_collectives`): every member issues them in one order;
4. one world all-reduce of the verdict, so that every rank stops before
   step 0 when any pair or group disagrees.
A failing rank raises one `PlanError` line naming the first ranks that
disagree with it; the others name the failure as elsewhere. Cost per rank:
the all-gather of 1. grows with the world (24 bytes a rank); 2 and 3 with the
rank's peers and groups, not the world.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from meshplan.errors import PlanError
from meshplan.ir.job import StageView
from meshplan.ir.kinds import TRANSFER
from meshplan.ir.pieces import recv_pieces, send_pieces
from meshplan.lowering.rankplan import RankPlan, TaskKind, expand_collectives
from meshplan.schedules import stage_placement


def digest64(value) -> int:
    """A signed 64-bit digest of `value`'s repr (equal values, equal digests)."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little",
                          signed=True)


def agree(plan: RankPlan, view: StageView, groups: dict) -> None:
    """Raise `PlanError` unless every rank's plan agrees with its peers'
    (`groups`: this rank's process groups by member tuple, `Comm.groups`).
    Every rank takes part in every exchange of a phase, whatever it found
    (else its peers would wait); the pairs and groups are checked only once
    every rank holds this Job (else they need not be symmetric)."""
    _verdict(_world(plan, view, dist.get_world_size()))
    _verdict(_pairs(plan, view) + _groups(plan, view, groups))


def _verdict(errors: list[str]) -> None:
    """Raise on every rank when any rank found something; a rank that did
    names what it found."""
    ok = torch.tensor([0 if errors else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    rank = dist.get_rank()
    if errors:
        raise PlanError(f"rank {rank}: {errors[0]}; the ranks' plans disagree, so no step "
                        "ran: compile or lower every rank from one Job and one meshplan")
    if not int(ok.item()):
        raise PlanError(f"rank {rank}: another rank's plan disagrees with its peers' (its "
                        "error names the ranks), so no step ran")


def _world(plan: RankPlan, view: StageView, world: int) -> list[str]:
    mine = torch.tensor([digest64(view.digest), plan.stage, digest64(plan.actions)],
                        dtype=torch.int64)
    every = torch.empty(world * 3, dtype=torch.int64)
    _all_gather(every, mine)
    every = every.view(world, 3)
    other_job = (every[:, 0] != mine[0]).nonzero().flatten().tolist()
    if other_job:
        return [f"ranks {_few(other_job)} hold another Job than this rank's "
                f"({view.digest[:12]})"]
    same_stage = every[:, 1] == plan.stage
    other = (same_stage & (every[:, 2] != mine[2])).nonzero().flatten().tolist()
    if other:
        return [f"ranks {_few(other)} of stage {plan.stage} run another action list than "
                "this rank"]
    return []


def _job_peers(view: StageView, rank: int) -> set[int]:
    """The ranks the Job has this rank exchange pieces with (`ir.pieces`, as
    lowering computes them): the same pairs on both sides of each, whatever
    the plans say."""
    s, out = view.strategy, set()
    if s.pp == 1:
        return out
    for op in view.ops:
        if op.kind != TRANSFER:
            continue
        kw = dict(op.kwargs)
        src_stage, dst_stage = kw["src_stage"], view.op_stage[op.id]
        src, dst = op.args[0].id, op.outputs[0]
        args = (view.values[src].meta.shape, s.placement(src_stage), view.sbp[src],
                s.placement(dst_stage), view.sbp[dst])
        if view.stage == src_stage:
            out.update(p.dst for p in send_pieces(*args, rank))
        if view.stage == dst_stage:
            out.update(p.src for p in recv_pieces(*args, rank))
    return out


def _pieces(plan: RankPlan, peers: set[int]) -> dict[int, tuple[list, list]]:
    """Per peer: the pieces this rank sends it and receives from it."""
    dtype = {b.id: b.dtype.name for b in plan.buffers}
    out: dict[int, tuple[list, list]] = {p: ([], []) for p in peers}
    for t in plan.tasks:
        if t.kind in (TaskKind.SEND, TaskKind.RECV):
            buf = (t.inputs or t.outputs)[0]
            out.setdefault(t.peer, ([], []))[t.kind is TaskKind.RECV].append(
                (t.op, t.box, dtype.get(buf)))
    return out


def _pairs(plan: RankPlan, view: StageView) -> list[str]:
    pieces = _pieces(plan, _job_peers(view, plan.rank))
    mine = {p: torch.tensor([digest64(sorted(s)), digest64(sorted(r))], dtype=torch.int64)
            for p, (s, r) in pieces.items()}
    theirs = {p: torch.empty(2, dtype=torch.int64) for p in pieces}
    ops = [dist.P2POp(dist.isend, mine[p], p) for p in sorted(pieces)] + \
        [dist.P2POp(dist.irecv, theirs[p], p) for p in sorted(pieces)]
    for w in dist.batch_isend_irecv(ops) if ops else ():
        w.wait()
    return [f"rank {p} and this rank disagree on the pieces they send each other"
            for p in sorted(pieces) if theirs[p].tolist() != mine[p].tolist()[::-1]]


def _groups(plan: RankPlan, view: StageView, groups: dict) -> list[str]:
    ops = {op.id: op for op in view.ops}
    seqs = expand_collectives(plan, stage_placement(view.strategy), ops, plan.buckets)
    errors = []
    for g in sorted(groups):
        mine = torch.tensor([digest64(seqs.get(g, []))], dtype=torch.int64)
        every = torch.empty(len(g), dtype=torch.int64)
        _all_gather(every, mine, group=groups[g])
        other = [m for m, d in zip(g, every.tolist()) if d != int(mine)]
        if other:
            errors.append(f"ranks {_few(other)} of group {_few(list(g))} issue its "
                          "collectives in another order than this rank")
    return errors


def _all_gather(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
    """`x` of every member into `out` (torch 2.13 names it `all_gather_single`)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _few(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:4])) + (" ..." if len(ranks) > 4 else "")
