"""Communication on torch.distributed: collectives on sub-groups, and
point-to-point pieces. The only module (with `launch.py`) that imports
`torch.distributed`.

Invariants:
- Sub-groups are made once, at load time, with local synchronization (only
  their members call), in one deterministic order.
- Collectives work on uneven shards: an all-gather gathers each member's
  own local shape; gloo lacks reduce-scatter and all-to-all, so there they
  are an all-reduce (or all-gather) followed by a local slice — the same
  numbers, more bytes.
- p2p ops carry a tag derived from (op, micro-batch), so gloo matches them
  whatever order two ranks post them in.
- Every wait is bounded by the process group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Comm:
    """The process groups of one rank, and its collective kernels."""

    def __init__(self, rank: int, groups: list[tuple[int, ...]], backend: str):
        self.rank = rank
        self.backend = backend
        self.groups: dict[tuple[int, ...], object] = {}
        for g in sorted(set(groups)):
            if len(g) > 1 and rank in g:
                self.groups[g] = dist.new_group(list(g), use_local_synchronization=True)

    def all_reduce(self, x: torch.Tensor, group, op: str) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=_OPS[op], group=self.groups[group])
        return out

    def all_gather(self, x: torch.Tensor, group, dim: int, shapes) -> torch.Tensor:
        """Gather along `dim`; `shapes` are every member's local shapes."""
        parts = [torch.empty(s, dtype=x.dtype, device=x.device) for s in shapes]
        dist.all_gather(parts, x.contiguous(), group=self.groups[group])
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, group, dim: int, start: int, stop: int):
        """Sum over the group, keep [start, stop) of `dim`."""
        full = self.all_reduce(x, group, "sum")
        return full.narrow(dim, start, stop - start).contiguous()

    def all_to_all(self, x, group, src_dim: int, gathered_shapes, dst_dim: int, start: int,
                   stop: int):
        """Shard(src_dim) -> Shard(dst_dim): gather `src_dim`, keep my part of `dst_dim`."""
        full = self.all_gather(x, group, src_dim, gathered_shapes)
        return full.narrow(dst_dim, start, stop - start).contiguous()


def p2p(ops: list[tuple[str, torch.Tensor, int, int]]) -> list:
    """Post ('send'|'recv', tensor, peer, tag) ops together; returns their works."""
    if not ops:
        return []
    p2p_ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=tag)
               for kind, t, peer, tag in ops]
    return dist.batch_isend_irecv(p2p_ops)


def tag_of(op_id: int, microbatch: int) -> int:
    """A p2p tag unique per (op, micro-batch) within a step."""
    return (op_id << 12) | (microbatch & 0xFFF)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
