"""Routed experts over an expert-parallel line (`KernelVariant.EXPERTS`).

A rank holds a shard of the tokens and `L = E / n` whole experts, member
`m` of its line the experts `[m L, (m + 1) L)`. The forward:

1. sort its rows (token, choice) by expert, as the op does alone;
2. exchange the counts: member m is told how many of this rank's rows go
   to each of its L experts (one all-to-all of n L integers): the splits
   are data-dependent, so they travel before the rows;
3. dispatch: each member is sent its experts' rows, which the sort made
   consecutive (one all-to-all, uneven splits);
4. the rows that arrived, grouped by source and then by expert, are
   regrouped by expert; the experts compute (`ops/routed_experts.py`);
5. combine: the outputs go back the way the rows came (one all-to-all),
   and each rank weighs, restores and sums its own tokens' rows.

The backward sends each row with its output's gradient and its gate, and
the expert computes the rows', the gates' and its weights' gradients; the
first two come back. The weights' gradients stay: they are this rank's
shard (Shard(0)), summed over every row of the line that chose them.

Invariants:
- Every member of the line calls the same all-to-alls in the same order
  (a counts exchange, then the rows, then the way back), whatever it holds:
  a member with no rows for another sends it zero elements.
- A token's result is the op's: each row meets its own expert's weights by
  the same arithmetic (`experts_forward`); only the sum of a weight's
  gradient over its rows is in another order.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from meshplan.ops.routed_experts import (
    experts_backward,
    experts_forward,
    sorted_rows,
    unsort_grads,
    unsort_sum,
)

# exchange(flat, sizes, counts) -> the flat parts the members sent, in member order
Exchange = Callable[[Tensor, list, list], Tensor]


class _Routes:
    """Where this rank's sorted rows go, and where the arrived rows come from."""

    def __init__(self, idx: Tensor, n: int, local: int, exchange: Exchange):
        self.perm, self.token, counts = sorted_rows(idx, n * local)
        mine = torch.tensor(counts, dtype=torch.int64, device=idx.device)  # NCCL: on the device
        got = exchange(mine, [local] * n, [local] * n).view(n, local).cpu()  # [source, expert]
        mine = mine.cpu()
        self.sent = mine.view(n, local).sum(1).tolist()   # rows to each member
        self.came = got.sum(1).tolist()                   # rows from each member
        self.per_expert = got.sum(0).tolist()             # arrived rows per local expert
        # arrived rows are (source, expert)-ordered: `order` groups them by expert
        starts = torch.cumsum(got.reshape(-1), 0) - got.reshape(-1)
        self.order = torch.cat([torch.arange(int(starts[s * local + e]),
                                             int(starts[s * local + e] + got[s, e]))
                                for e in range(local) for s in range(n)] or
                               [torch.zeros(0, dtype=torch.int64)])
        self.exchange = exchange

    def there(self, rows: Tensor) -> Tensor:
        """This rank's sorted rows (any width) to their experts' members,
        grouped by expert there."""
        got = self._move(rows, self.sent, self.came)
        return got[self.order.to(got.device)]

    def back(self, rows: Tensor) -> Tensor:
        """Rows grouped by expert (as `there` gave them) back to the ranks
        they came from, in each one's sorted order."""
        out = torch.empty_like(rows)
        out[self.order.to(rows.device)] = rows
        return self._move(out, self.came, self.sent)

    def _move(self, rows: Tensor, send: list, recv: list) -> Tensor:
        width = rows.shape[1:]
        each = 1
        for w in width:
            each *= w
        flat = self.exchange(rows.contiguous().reshape(-1), [r * each for r in send],
                             [r * each for r in recv])
        return flat.view(-1, *width)


def routed_experts_ep(exchange: Exchange, n: int) -> Callable:
    """The forward kernel over a line of `n` members."""

    def kernel(x: Tensor, idx: Tensor, gates: Tensor, w_in: Tensor, w_out: Tensor, *,
               act: str, transposed: bool) -> Tensor:
        routes = _Routes(idx, n, w_in.shape[0], exchange)
        rows = routes.there(x[routes.token])
        y = routes.back(experts_forward(rows, routes.per_expert, w_in, w_out, act, transposed))
        weighted = y * gates.reshape(-1)[routes.perm].unsqueeze(-1)
        return unsort_sum(weighted, routes.perm, *idx.shape).to(x.dtype)

    return kernel


def routed_experts_backward_ep(exchange: Exchange, n: int) -> Callable:
    """The backward kernel over a line of `n` members."""

    def kernel(x: Tensor, idx: Tensor, gates: Tensor, w_in: Tensor, w_out: Tensor,
               grad: Tensor, *, act: str, transposed: bool):
        routes = _Routes(idx, n, w_in.shape[0], exchange)
        h = x.shape[1]
        rows = routes.there(torch.cat([x[routes.token], grad[routes.token].to(x.dtype)], 1))
        g = routes.there(gates.reshape(-1)[routes.perm].unsqueeze(-1)).squeeze(-1)
        gx, gg, gwi, gwo = experts_backward(rows[:, :h], g, rows[:, h:], routes.per_expert,
                                            w_in, w_out, act, transposed)
        gx = routes.back(gx.to(x.dtype))
        gg = routes.back(gg.unsqueeze(-1)).squeeze(-1)
        return (*unsort_grads(gx, gg, routes.perm, routes.token, x, gates), gwi, gwo)

    return kernel
