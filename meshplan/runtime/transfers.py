"""Stage-crossing transfers of one rank: its send and receive pieces, by
action, resolved to slices at load time.

Invariants: a piece is the intersection of the sender's and receiver's boxes
(`ir.pieces`), addressed here relative to each side's local tensor; sends
are posted asynchronously and waited at the end of the step; the next
receive action's pieces are posted one action ahead (as torch's pipelining
does), and a receive assembles the value's local tensor before the action
that reads it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from meshplan.ir import Phase
from meshplan.lowering.rankplan import TaskKind
from meshplan.runtime.comm import p2p, tag_of
from meshplan.schedules import stage_placement
from meshplan.schedules.action import ActionType


def _slices(box, base) -> tuple[slice, ...]:
    return tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(box, base))


class Transfers:
    def __init__(self, plan, ctx, device, p2p=None):
        """`p2p`: how to post pieces (default `runtime.comm.p2p`, i.e. gloo)."""
        view = ctx.view
        where = stage_placement(view.strategy)
        self.device = device
        self._p2p = p2p
        # keyed by action: (virtual stage, type, peer virtual stage); a stage may
        # send one micro-batch to several (an encoder's output to every decoder stage)
        self.sends = defaultdict(list)   # key -> [(vid, slices, peer rank, op)]
        self.recvs = defaultdict(list)   # key -> [(vid, slices, shape, peer rank, op)]
        self.shapes = {}                 # received vid -> (local shape, dtype)
        self.pending: list = []
        self.posted: dict = {}           # (stage, type, peer, mb) -> (works, places, bufs)
        for t in plan.tasks:
            op = view.op_of[t.op]
            forward = t.phase is Phase.FORWARD
            # A transfer op sits with its receiver; it names its sender's stage and chunk
            receiver = where.stage_at(view.op_stage[op.id], view.op_chunk[op.id])
            if t.kind is TaskKind.SEND:
                vid = op.args[0].id
                key = (where.stage_at(plan.stage, t.chunk), ActionType.SEND_F if forward else
                       ActionType.SEND_B, receiver)
                self.sends[key].append((vid, _slices(t.box, ctx.box(vid)), t.peer, t.op))
            elif t.kind is TaskKind.RECV:
                vid = op.outputs[0]
                kw = dict(op.kwargs)
                sender = where.stage_at(kw["src_stage"], kw["src_chunk"])
                key = (receiver, ActionType.RECV_F if forward else ActionType.RECV_B, sender)
                box = ctx.box(vid)
                piece = tuple(b - a for a, b in t.box)
                self.recvs[key].append((vid, _slices(t.box, box), piece, t.peer, t.op))
                meta = view.values[vid].meta
                self.shapes[vid] = (tuple(b - a for a, b in box), meta.dtype.torch)

    def p2p(self, ops: list) -> list:
        if self._p2p is not None:
            return self._p2p(ops)

        return p2p(ops)

    def send(self, action, env: dict) -> list[int]:
        """Post `action`'s sends; returns the values it sent (each once)."""
        ops, keep = [], []
        sent = self.sends.get((action.virtual_stage, action.type, action.peer), ())
        for vid, sl, peer, op_id in sent:
            piece = env[vid][sl].contiguous()
            ops.append(("send", piece, peer, tag_of(op_id, action.microbatch)))
            keep.append(piece)
        self.pending.append((self.p2p(ops), keep))
        return list(dict.fromkeys(vid for vid, *_ in sent))

    def post_recv(self, action) -> None:
        """Post the receives of `action` now (before it runs), unless posted."""
        key = (action.virtual_stage, action.type, action.peer, action.microbatch)
        if key in self.posted:
            return
        bufs, ops, places = {}, [], []
        for vid, sl, piece, peer, op_id in self.recvs.get(key[:3], ()):
            if vid not in bufs:
                shape, dtype = self.shapes[vid]
                bufs[vid] = torch.empty(shape, dtype=dtype, device=self.device)
            tmp = torch.empty(piece, dtype=bufs[vid].dtype, device=self.device)
            ops.append(("recv", tmp, peer, tag_of(op_id, action.microbatch)))
            places.append((vid, sl, tmp))
        self.posted[key] = (self.p2p(ops), places, bufs)

    def recv(self, action, env: dict, mem) -> None:
        """Wait for `action`'s pieces (posting them first if not yet) and
        assemble each received value's local tensor."""
        self.post_recv(action)
        works, places, bufs = self.posted.pop((action.virtual_stage, action.type, action.peer,
                                               action.microbatch))
        for work in works:
            work.wait()
        for vid, sl, tmp in places:
            bufs[vid][sl] = tmp
        for vid, buf in bufs.items():
            env[vid] = buf
            mem.add(buf)

    def wait_sends(self) -> None:
        for works, _ in self.pending:
            for w in works:
                w.wait()
        self.pending.clear()
