"""Communication on torch.distributed: collectives on sub-groups, and
point-to-point pieces. The other modules that import `torch.distributed`
are `worker.py` (the process group: set up, warmed up, a closing barrier,
torn down) and `checkpoint.py` (barriers around `torch.distributed.checkpoint`).

Invariants:
- Sub-groups are made once, at load time, each by its members only
  (`new_group(use_local_synchronization=True)`), every rank making its own
  in the one order of `job_groups` (torch's rule against deadlock between
  overlapping groups). A rank finds its groups from the strategy and its
  own stage's ops (`rank_groups`): no rank reads another stage.
- Collectives work on uneven shards: an all-gather gathers each member's
  own local shape, an all-to-all sends each member its own cut
  (`all_to_all_single` with split sizes). Reduce-scatter runs as an
  all-reduce and a local slice (`bind.py`): the same numbers for more
  bytes; gloo's reduce-scatter (torch 2.13) is slower than its all-reduce
  (measured: `lowering/buckets.py`).
- p2p ops carry a tag derived from (op, micro-batch), so gloo matches them
  whatever order two ranks post them in.
- Every wait is bounded by the process group's timeout.
- Host staging (gloo with CUDA tensors: ranks sharing GPUs): every
  collective and p2p piece is copied to host memory, moved by gloo, and
  copied back to the rank's GPU; a received piece lands on the GPU when its
  work is waited. The same numbers, for testing plans, not for speed.
- With NCCL, ProcessGroupNCCL runs each collective and p2p batch on its own
  communication stream, ordered against the compute stream by CUDA events
  (its work objects' `wait()` makes the compute stream wait, not the host).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from meshplan.ir.kinds import ALL_REDUCE
from meshplan.schedules.trace import Span, Track

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Done:
    """The work of a collective that finished before it was returned."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


class _Recorded:
    """An asynchronous collective's work whose wait records its span, from
    its start to the wait's end (when spans are on)."""

    def __init__(self, work, comm: Comm, name: str, t0: float):
        self.work, self.comm, self.name, self.t0 = work, comm, name, t0

    def wait(self) -> bool:
        done = self.work.wait()
        self.comm.record(self.name, self.t0)
        return done


class Comm:
    """The process groups of one rank, and its collective kernels."""

    def __init__(self, rank: int, groups: list[tuple[int, ...]], backend: str,
                 device: torch.device | None = None):
        """`groups`: this rank's groups (`rank_groups`), in `job_groups`' order."""
        self.rank = rank
        self.backend = backend
        self.cuda = device is not None and device.type == "cuda"
        self.host_staged = backend == "gloo" and self.cuda
        self.p2p = staged_p2p if self.host_staged else None  # None: `p2p` below
        self.groups: dict[tuple[int, ...], object] = {}
        for g in groups:
            if len(g) > 1 and rank in g:
                self.groups[g] = dist.new_group(list(g), use_local_synchronization=True)
        self.spans: list | None = None  # when a list: each collective's Span is appended

    def all_reduce(self, x: torch.Tensor, group, op: str) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.host_staged:
            out = x.to("cpu", memory_format=torch.contiguous_format, copy=True)
        else:
            out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=_OPS[op], group=self.groups[group])
        self.record(f"all_reduce({op}) {list(group)}", t0)
        return out.to(x.device) if self.host_staged else out

    def all_reduce_async(self, x: torch.Tensor, group, op: str = "sum",
                         name: str = "bucket"):
        """Reduce `x` (a tensor of the caller's own) in place over `group`, in
        the background; returns the work to wait on (a gradient bucket)."""
        t0 = time.perf_counter()
        if self.host_staged:  # staged through the host: done before returning
            x.copy_(self.all_reduce(x, group, op))
            return _DONE
        work = dist.all_reduce(x, op=_OPS[op], group=self.groups[group], async_op=True)
        return _Recorded(work, self, f"all_reduce {name} {list(group)}", t0)

    def all_reduce_world(self, x: torch.Tensor, op: str) -> None:
        """In place over every rank (the fp16 overflow flag)."""
        if self.host_staged:
            host = x.cpu()
            dist.all_reduce(host, op=_OPS[op])
            x.copy_(host)
            return
        dist.all_reduce(x, op=_OPS[op])

    def all_to_all(self, flat: torch.Tensor, sizes: list[int], counts: list[int],
                   group) -> torch.Tensor:
        """Send `flat`'s consecutive runs of `sizes` elements to the group's
        members in order; returns what they send this rank (`counts[k]`
        elements from member k), in member order, in one flat tensor: one
        `all_to_all_single`, uneven splits allowed (gloo and NCCL have it)."""
        t0 = time.perf_counter()
        device = flat.device
        if self.host_staged:
            flat = flat.cpu()
        out = flat.new_empty(sum(counts))
        dist.all_to_all_single(out, flat, output_split_sizes=counts, input_split_sizes=sizes,
                               group=self.groups[group])
        self.record(f"all_to_all {list(group)}", t0)
        return out.to(device)

    def all_gather(self, x: torch.Tensor, group, dim: int, shapes,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather along `dim`; `shapes` are every member's local shapes. Uneven
        parts (a dim that does not divide by the group) travel padded to the
        largest, as gloo and NCCL gather equal sizes only, and are cut back.
        `out`: a tensor of the gathered shape to write the result into."""
        return self.all_gather_async(x, group, dim, shapes, out)()

    def all_gather_async(self, x: torch.Tensor, group, dim: int, shapes,
                         out: torch.Tensor | None = None):
        """`all_gather`, started in the background: returns the call that
        waits for it and gives the gathered tensor."""
        take = self.all_gather_many_async([x], group, [dim], [shapes], [out])
        return lambda: take(0)

    def all_gather_many_async(self, xs: list[torch.Tensor], group, dims: list[int],
                              shapes: list, outs: list | None = None
                              ) -> Callable[[int], torch.Tensor]:
        """Gather tensors `xs` (one dtype; each along its `dims[k]`, every
        member's local shapes `shapes[k]`) in one collective, started in the
        background: each member's parts, each padded to the largest along
        its dim, travel as one flat tensor (one collective a ZeRO-3 layer,
        as FSDP2 gathers a block). Returns `take(k)`, which waits (the first
        time) and gives the k-th gathered tensor; the flat tensors go when
        every one is taken (on the host, their storage is freed then, and
        the one sent once waited). `outs[k]` (None: a fresh tensor) is
        where the k-th gathered tensor is written (`into_place`)."""
        t0 = time.perf_counter()
        where = "cpu" if self.host_staged else xs[0].device
        mine, full, rows = [], [], []
        for x, dim, shp in zip(xs, dims, shapes):
            r = [s[dim] for s in shp]
            most = max(r)
            part = x.contiguous().to(where)
            if part.shape[dim] < most:
                pad = list(part.shape)
                pad[dim] = most - part.shape[dim]
                part = torch.cat([part, part.new_zeros(pad)], dim=dim)
            mine.append(part.reshape(-1))
            full.append([tuple(most if d == dim else n for d, n in enumerate(s)) for s in shp])
            rows.append(r)
        sizes = [math.prod(f[0]) for f in full]
        assert all(math.prod(s) == n for f, n in zip(full, sizes) for s in f), \
            "a gathered tensor's members differ beyond its gathered dim"
        host = where == "cpu" or where == torch.device("cpu")
        # on the host a copy of its own even for one tensor: freed once waited
        flat = torch.cat(mine) if len(mine) > 1 or host else mine[0]
        parts: list | None = [torch.empty_like(flat) for _ in shapes[0]]
        work = dist.all_gather(parts, flat, group=self.groups[group], async_op=True)
        state = {"waited": False, "left": len(xs)}
        devices = [x.device for x in xs]  # not `xs`: a caller's copy may go at once
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)

        def take(k: int) -> torch.Tensor:
            nonlocal parts
            assert parts is not None, "every gathered tensor was taken already"
            if not state["waited"]:
                work.wait()
                state["waited"] = True
                if host:
                    flat.untyped_storage().resize_(0)
                self.record(f"all_gather {list(group)}", t0)
            dim, cut = dims[k], rows[k]
            pieces = [p[offsets[k]:offsets[k + 1]].view(f) for p, f in zip(parts, full[k])]
            if any(n < f[dim] for n, f in zip(cut, full[k])):
                pieces = [p.narrow(dim, 0, n) for p, n in zip(pieces, cut)]
            out = into_place(pieces, dim, outs[k] if outs else None, devices[k])
            state["left"] -= 1
            if state["left"] == 0:
                if host:  # freed now: the finished work, which gloo's worker thread
                    # lets go of a moment later, holds them too (as FSDP frees its own)
                    for p in parts:
                        p.untyped_storage().resize_(0)
                parts = None
            return out
        return take

    def shift(self, x: torch.Tensor, group, op: int, step: int) -> Callable[[], torch.Tensor]:
        """Send `x` to the member after this rank in `group` (a ring) and
        receive the one before's into a tensor like it, in the background:
        returns the call that waits for both and gives the received tensor.
        Tagged by ring `op` and `step` (a transfer's tags name other ops);
        one op's steps in one micro-batch differ, its micro-batches arrive
        in the order every member runs them."""
        t0 = time.perf_counter()
        tag = tag_of(op, step)
        me = group.index(self.rank)
        got = torch.empty_like(x, memory_format=torch.contiguous_format)
        works = (self.p2p or p2p)([("send", x.contiguous(), group[(me + 1) % len(group)], tag),
                                   ("recv", got, group[me - 1], tag)])

        def take() -> torch.Tensor:
            for w in works:
                w.wait()
            self.record(f"ring shift {list(group)}", t0)
            return got
        return take

    def record(self, name: str, t0: float, track: Track = Track.COMM) -> None:
        """A span from `t0` to now (when spans are on): a collective's, or
        a ring attention block's compute."""
        if self.spans is not None:
            if self.cuda:  # traced: the work's time on the device
                torch.cuda.synchronize()
            self.spans.append(Span(name, track, t0, time.perf_counter()))


def into_place(pieces: list[torch.Tensor], dim: int, out: torch.Tensor | None,
               device) -> torch.Tensor:
    """`pieces` joined along `dim`, on `device`: written into `out` when
    given and of the joined shape and dtype, contiguous (a parameter
    gathered into its own storage, so the step holds no second copy of
    it), else into a fresh tensor."""
    if out is not None:
        shape = list(pieces[0].shape)
        shape[dim] = sum(p.shape[dim] for p in pieces)
        if list(out.shape) != shape or out.dtype != pieces[0].dtype or not out.is_contiguous():
            out = None
    if out is None:
        return torch.cat(pieces, dim=dim).to(device)
    if out.device == pieces[0].device:
        return torch.cat(pieces, dim=dim, out=out)
    return out.copy_(torch.cat(pieces, dim=dim))  # staged through the host


def job_groups(strategy, ops=()) -> list[tuple[int, ...]]:
    """Every collective group of a job, in the one order ranks make them:
    each stage's grid lines along each axis, then the lines across the
    stages that hold copies of a shared parameter (from the all-reduces
    among `ops`, e.g. the Job's), sorted."""
    return _grid_lines(strategy) + _shared_lines(strategy, ops)


def rank_groups(strategy, rank: int, ops) -> list[tuple[int, ...]]:
    """The groups of `job_groups` that hold `rank`, in that order, from its
    own stage's `ops` (a `StageView`'s): a shared line through `rank` comes
    from an all-reduce on its stage, and its grid lines from its placement."""
    place = strategy.placement(strategy.stage_of_rank(rank))
    coord = place.coord(rank)
    own = [tuple(place.rank_at(coord[:axis] + (k,) + coord[axis + 1:]) for k in range(n))
           for axis, n in enumerate(place.grid) if n > 1]
    return own + [line for line in _shared_lines(strategy, ops) if rank in line]


def _shared_lines(strategy, ops) -> list[tuple[int, ...]]:
    """The lines of ranks, one per grid coordinate, across the stages of each
    shared parameter's all-reduce among `ops`, sorted."""
    out = set()
    for op in ops:
        stages = dict(op.kwargs).get("stages") if op.kind == ALL_REDUCE else None
        if stages is None:
            continue
        place = strategy.placement(stages[0])
        out.update(tuple(strategy.placement(s).rank_at(place.coord(r)) for s in stages)
                   for r in place.ranks)
    return sorted(out)


def _grid_lines(strategy) -> list[tuple[int, ...]]:
    out = []
    for stage in range(strategy.pp):
        place = strategy.placement(stage)
        for axis, n in enumerate(place.grid):
            if n < 2:
                continue
            seen = set()
            for r in place.ranks:
                c = list(place.coord(r))
                line = []
                for k in range(n):
                    c[axis] = k
                    line.append(place.rank_at(tuple(c)))
                if tuple(line) not in seen:
                    seen.add(tuple(line))
                    out.append(tuple(line))
    return out


def p2p(ops: list[tuple[str, torch.Tensor, int, int]]) -> list:
    """Post ('send'|'recv', tensor, peer, tag) ops together; returns their works."""
    if not ops:
        return []
    p2p_ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=tag)
               for kind, t, peer, tag in ops]
    return dist.batch_isend_irecv(p2p_ops)


class _Staged:
    """A host-staged receive: waiting copies the host piece to the GPU."""

    def __init__(self, work, host: torch.Tensor, dst: torch.Tensor):
        self.work, self.host, self.dst = work, host, dst

    def wait(self) -> None:
        self.work.wait()
        self.dst.copy_(self.host)


def staged_p2p(ops: list[tuple[str, torch.Tensor, int, int]]) -> list:
    """`p2p` through host memory: sends copy to the host first, receives land
    in a host buffer and reach their GPU tensor when waited."""
    staged, wrap = [], []
    for kind, t, peer, tag in ops:
        host = torch.empty(t.shape, dtype=t.dtype) if kind == "recv" else t.cpu()
        staged.append((kind, host, peer, tag))
        wrap.append((host, t) if kind == "recv" else None)
    works = p2p(staged)
    return [w if r is None else _Staged(w, *r) for w, r in zip(works, wrap)]


def tag_of(op_id: int, microbatch: int) -> int:
    """A p2p tag unique per (op, micro-batch) within a step."""
    return (op_id << 12) | (microbatch & 0xFFF)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """`data` from rank `src` to every rank (as a uint8 tensor, not pickle)."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
           else torch.empty(int(n.item()), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return bytes(buf.numpy().tobytes())


def gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, on every rank (padded uint8 tensors)."""
    world = dist.get_world_size()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n)
    top = int(max(x.item() for x in sizes))
    mine = torch.zeros(top, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [bytes(p[: int(k.item())].numpy().tobytes()) for p, k in zip(parts, sizes)]
